// Restore: read -> verify -> scatter. The tensors of one file are cut into read-sized slices, grouped into
// contiguous runs (one per parser thread, so each thread reads sequentially), and read with several requests
// in flight straight into host destinations; slices for CUDA destinations go through a pinned cache chunk and
// a host-to-device copy. Each slice is summed where it lands; the sums are combined per tensor at the end.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "host_cache.hpp"
#include "task_pool.hpp"

namespace ds {

struct RestoreTensor {
  std::uint64_t offset = 0;  // absolute position in the file
  std::size_t nbytes = 0;
  char* dst = nullptr;  // host pointer, or device pointer when device >= 0
  int device = -1;
};

struct RestoreOptions {
  bool use_uring = true;
  unsigned depth = 8;
  std::size_t read_bytes = 16 << 20;
  bool verify = true;
};

// Blocks until every tensor is in place. Returns each tensor's CRC-32C when `verify` (else zeros). Throws
// ErrorException naming `path` on an I/O error.
std::vector<std::uint32_t> restore_file(const std::string& path, const std::vector<RestoreTensor>& tensors,
                                        const RestoreOptions& opts, TaskPool& pool, HostCache& cache);

}  // namespace ds
