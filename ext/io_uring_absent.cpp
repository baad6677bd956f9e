// A build without liburing's headers: no io_uring worker or reader; every write and read goes through the
// pwrite/pread pool, and asking for io_uring says why.
#include "flush.hpp"
#include "reader.hpp"

namespace ds {

std::unique_ptr<FlushWorker> make_uring_worker(unsigned, int, std::string* why) {
  *why =
      "this build of nanotron-datastates has no io_uring backend (liburing's headers were missing when it "
      "was built: install liburing-dev and reinstall the package)";
  return nullptr;
}

bool read_ranges_uring(int, const std::vector<ReadRange>&, unsigned, int*) {
  return false;
}

bool built_with_io_uring() {
  return false;
}

}  // namespace ds
