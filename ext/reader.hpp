// The I/O loop of a restore: reads a batch of ranges to completion, several in flight. io_uring (a ring per
// calling thread, created on first use) or plain pread where io_uring is refused.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace ds {

struct ReadRange {
  char* dst;
  std::uint64_t offset;
  std::size_t len;   // requested (block-aligned for O_DIRECT, so it may run past the end of the file)
  std::size_t need;  // bytes that must arrive; the file may end after them
};

// Reads every range, keeping up to `depth` requests in flight (a sliding window). Returns 0 or the first
// positive errno (ENODATA: the file ended before `need`); after an error no further range is started. Blocks
// until everything started has finished.
int read_ranges(int fd, const std::vector<ReadRange>& ranges, bool use_uring, unsigned depth);

// The same through this thread's io_uring: false where there is none (refused here, or a build without
// liburing), else true with `*err` as read_ranges returns it.
bool read_ranges_uring(int fd, const std::vector<ReadRange>& ranges, unsigned depth, int* err);

}  // namespace ds
