// Restore: read -> verify -> scatter, the mirror of a save. The file's data section is cut into 4096-aligned
// pieces, grouped into contiguous runs (one per parser thread, so each thread reads sequentially), and read
// with O_DIRECT and several requests in flight:
//   - to host: straight into one page-aligned, huge-page-backed buffer, whose slices become the tensors (no
//     copy after the read, as safetensors' own memory map);
//   - to a GPU: into pinned cache chunks, then host-to-device copies into the destination tensors.
// Each piece is summed (CRC-32C per tensor range) where it lands; the sums are combined per tensor at the
// end.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "host_cache.hpp"
#include "task_pool.hpp"

namespace ds {

struct RestoreSpan {
  std::uint64_t begin = 0, end = 0;  // in the data section
  char* dst = nullptr;               // device destination (device mode only)
  int device = -1;
};

struct RestoreOptions {
  bool use_uring = true;
  bool direct_io = true;
  bool verify = true;
  unsigned depth = 8;
  std::size_t read_bytes = 16 << 20;
};

// An anonymous, page-aligned mapping advised to use huge pages (fewer page faults as reads land in it).
class HostBuffer {
 public:
  explicit HostBuffer(std::size_t bytes);
  ~HostBuffer();
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  char* data() const { return data_; }
  std::size_t size() const { return size_; }

 private:
  char* data_ = nullptr;
  std::size_t size_ = 0;
};

struct RestoreResult {
  std::unique_ptr<HostBuffer> buffer;  // host mode: the data section starts at data() + data_offset
  std::size_t data_offset = 0;
  std::vector<std::uint32_t> crcs;  // per span, when verifying
};

// Blocks until everything is in place. `to_device`: every span has a CUDA destination. Throws ErrorException
// naming `path` on an I/O error.
RestoreResult restore_file(const std::string& path, std::uint64_t data_start, std::uint64_t data_len,
                           const std::vector<RestoreSpan>& spans, bool to_device, const RestoreOptions& opts,
                           TaskPool& pool, HostCache& cache);

}  // namespace ds
