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
  std::size_t len;
};

// Returns 0 or the first positive errno (ENODATA: the file ended early). Blocks until every read is done.
int read_ranges(int fd, const std::vector<ReadRange>& ranges, bool use_uring, unsigned depth);

}  // namespace ds
