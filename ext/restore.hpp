// Restore: read -> verify -> scatter, the mirror of a save. The file's data section is cut into 4096-aligned
// pieces; those that the spans reach into are grouped into contiguous runs (one per parser thread, so each
// thread reads sequentially), and of each only the pages the spans cover are read:
//   - to host: the file is mapped privately (copy on write) and each thread populates its run with
//     MADV_POPULATE_READ, so the kernel reads ahead in large requests, several threads at once, into
//     page-cache pages that become the tensors' memory with no further copy. Reading into fresh anonymous
//     memory instead (O_DIRECT) makes the kernel zero every page first, which measured slower and erratic
//     (benchmarks/NOTES.md);
//   - to a GPU: O_DIRECT reads (io_uring, several in flight) into pinned cache chunks, then host-to-device
//   copies;
//   - to a GPU from a file in memory (tmpfs: the memory tier): the file is mapped shared and read-only, each
//     piece copied into half a pinned chunk, summed there and uploaded while the next piece fills the other
//     half. read(2) would make the kernel copy each byte and the sum read it again.
// Each piece is summed (CRC-32C per tensor range) where it lands; the sums are combined per tensor at the
// end.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "host_cache.hpp"
#include "storage.hpp"
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
  unsigned depth = 16;
  std::size_t read_bytes = 16 << 20;
  bool map_memory_files = true;  // to a device from tmpfs: through a mapping, not read(2) into chunks
};

// A mapping of a whole file, private and writable (copy on write) or shared and read-only; with `fd` < 0,
// anonymous memory of `bytes` that a file's bytes are read into. Unmapped on destruction.
class FileMapping {
 public:
  FileMapping(int fd, std::size_t bytes, const std::string& path, bool read_only = false);
  ~FileMapping();
  FileMapping(const FileMapping&) = delete;
  FileMapping& operator=(const FileMapping&) = delete;
  char* data() const { return data_; }
  std::size_t size() const { return size_; }

 private:
  char* data_ = nullptr;
  std::size_t size_ = 0;
};

struct RestoreResult {
  std::unique_ptr<FileMapping> mapping;  // host mode: file offset x is at data() + x
  std::vector<std::uint32_t> crcs;       // per span, when verifying
};

// Blocks until everything is in place. `to_device`: every span has a destination, read through the cache's
// chunks (with O_DIRECT where allowed): a CUDA pointer, or host memory where `device` < 0. The file is
// opened through `storage` (Storage::open_read). `fd` >= 0: an open descriptor of the file (the caller's,
// left open), read instead of opening `path` again, so that the bytes come from the file whose header the
// caller read even if another is renamed over the path meanwhile. Throws ErrorException naming `path` on an
// I/O error.
RestoreResult restore_file(const std::string& path, std::uint64_t data_start, std::uint64_t data_len,
                           const std::vector<RestoreSpan>& spans, bool to_device, const RestoreOptions& opts,
                           TaskPool& pool, HostCache& cache, Storage& storage, int fd = -1);

}  // namespace ds
