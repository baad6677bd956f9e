// Stage 1 of a save: lay a file out as a safetensors image.
//
//   [u64 little-endian N][JSON header, padded with spaces to N bytes][tensor bytes, back to back]
//
// 8 + N is a multiple of 4096, so the data section (and every chunk-sized piece of it) can be written with
// O_DIRECT. Tensors are ordered by element size, largest first, which keeps every tensor naturally aligned
// without leaving holes (the format forbids them). The header holds "datastates.crc32c": 8 hex digits per
// tensor in file order, and "datastates.crc32c_blocks": the block size B, then 8 hex digits per block segment
// (each tensor cut at the multiples of B in the data section, so that a range of a tensor can be read and
// verified alone), both written as zeros here and patched in once the data has been summed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace ds {

// A tensor as the copy stage reads it: its bytes are the row-major image of `shape` over `strides`.
struct TensorSrc {
  std::string name;
  std::string dtype;  // safetensors spelling: "F32", "BF16", ...
  std::vector<std::int64_t> shape;
  std::vector<std::int64_t> strides;  // in elements
  std::size_t itemsize = 1;
  const char* data = nullptr;  // host pointer, or device pointer when device >= 0
  int device = -1;             // CUDA ordinal, -1 for host memory
  std::size_t nbytes = 0;
  bool contiguous = true;
  // The device buffer the bytes lie in when several tensors share one (a staged checkpoint's: its index);
  // -1: unknown. Only ranges of one buffer may go as one copy: a copy may not span two allocations, even
  // ones that happen to follow each other in the address space.
  int buffer = -1;
};

using Metadata = std::vector<std::pair<std::string, std::string>>;

struct Layout {
  std::string header;          // bytes [0, data_start): length prefix, JSON, space padding
  std::size_t data_start = 0;  // multiple of 4096
  std::size_t file_size = 0;
  std::vector<std::size_t> order;   // tensor indices in file order
  std::vector<std::size_t> offset;  // per tensor index: start in the data section
  std::size_t crc_pos = 0;          // where the checksum hex digits start in `header`
  bool has_crc = false;
  std::size_t block_bytes = 0;  // B: block segments are summed at this grid; 0: not planned
  std::size_t block_pos = 0;    // where the block segments' hex digits start in `header`
};

constexpr const char* kCrcKey = "datastates.crc32c";
constexpr const char* kBlockCrcKey = "datastates.crc32c_blocks";
constexpr std::size_t kBlockBytes = std::size_t{1} << 20;

// The segments [begin, end) of one tensor at `offset` of `nbytes` on the grid of `block` bytes.
inline std::size_t num_segments(std::size_t offset, std::size_t nbytes, std::size_t block) {
  return nbytes ? (offset + nbytes - 1) / block - offset / block + 1 : 0;
}

// Pure function of its inputs; throws ErrorException (Value) on a header over safetensors' 100 MB limit.
// `block_bytes` (a power of two, 4096 or more; 0 for none) plans the block segments' checksums as well.
Layout plan_layout(const std::vector<TensorSrc>& tensors, const Metadata& metadata, bool checksums,
                   std::size_t block_bytes = 0);

// Pads the header with spaces so that the data starts at `data_start` (a multiple of 4096, not below the
// layout's): a mirror file kept mapped takes a later save whose header came out shorter (its metadata's plain
// values changed), its pinned blocks still lying where the pieces go.
void pad_header(Layout& layout, std::size_t data_start);

// JSON string body escaping (no quotes added).
void json_escape(std::string& out, const std::string& s);

// Writes the checksums, in file order, into the header's placeholder; `blocks`: every tensor's segments, in
// file order (ignored where the layout plans none).
void patch_checksums(Layout& layout, const std::vector<std::uint32_t>& crc_in_file_order,
                     const std::vector<std::vector<std::uint32_t>>& blocks = {});

}  // namespace ds
