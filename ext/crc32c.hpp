// CRC-32C (Castagnoli), the per-tensor checksum of the file format. Hardware (SSE 4.2) when the CPU has it.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ds {

// Standard CRC-32C: crc32c(0, "123456789", 9) == 0xE3069283; pass the previous value to continue.
std::uint32_t crc32c(std::uint32_t crc, const void* data, std::size_t n);

// Copies n bytes from src to dst and returns the CRC-32C of the bytes copied (continuing `crc`): each word is
// summed as it is stored, with non-temporal stores where the CPU sums in hardware, so the copy and the sum
// together read src once and never read dst; the sum is of the bytes dst holds even if src changes meanwhile.
std::uint32_t crc32c_copy(std::uint32_t crc, void* dst, const void* src, std::size_t n);

// The CRC of A||B from crc(A), crc(B) and len(B): lets pieces of one tensor be summed in any order.
std::uint32_t crc32c_combine(std::uint32_t crc_a, std::uint32_t crc_b, std::size_t len_b);

}  // namespace ds
