// A build without io_uring (liburing's headers missing, or DATASTATES_IO_URING=OFF): no io_uring worker or
// reader; every write and read goes through the pwrite/pread pool, and asking for io_uring says why.
#include "flush.hpp"
#include "reader.hpp"

#ifndef DS_URING_ABSENT  // set by CMakeLists.txt: missing headers, or DATASTATES_IO_URING=OFF
#define DS_URING_ABSENT "liburing headers were missing when it was built"
#endif

namespace ds {

std::unique_ptr<FlushWorker> make_uring_worker(unsigned, int, std::string* why) {
  *why = std::string("this build of nanotron-datastates has no io_uring backend (") + io_uring_absent_why() + ")";
  return nullptr;
}

const char* io_uring_absent_why() {
  return DS_URING_ABSENT;
}

bool read_ranges_uring(int, const std::vector<ReadRange>&, unsigned, int*) {
  return false;
}

bool built_with_io_uring() {
  return false;
}

}  // namespace ds
