// Stage 3 of a save: flush. A FlushWorker executes IoOps (writes and fsyncs) in the background. Two
// implementations sit behind this interface: io_uring (one ring per worker thread, several ops in flight) and
// a pwrite/fsync thread pool for machines where io_uring is refused. Both resume short writes and retry
// EAGAIN/EINTR; both call the op's target when an op is finished, on the worker's thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace ds {

struct IoOp;

// Whoever owns an op. Called on the worker thread; may return a follow-up op to run on the same worker.
class IoTarget {
 public:
  virtual ~IoTarget() = default;
  // Just before the op is first submitted (e.g. checksum the chunk off the copy path).
  virtual void on_io_prepare(IoOp& op) {}
  // `err` is 0 or a positive errno.
  virtual IoOp* on_io_complete(IoOp& op, int err) = 0;
};

struct IoOp {
  enum class Kind { Write, Fsync, Read };
  Kind kind = Kind::Write;
  int fd = -1;
  char* buf = nullptr;
  std::size_t len = 0;
  std::uint64_t offset = 0;
  std::size_t done = 0;  // progress, for short writes
  bool prepared = false;
  IoTarget* target = nullptr;
  std::size_t tag = 0;  // the target's own index (piece number, ...)
};

class FlushWorker {
 public:
  virtual ~FlushWorker() = default;
  // Thread-safe; never blocks on I/O.
  virtual void submit(IoOp* op) = 0;
  // Finishes every op submitted so far (and their follow-ups), then joins the threads. Idempotent.
  virtual void stop() = 0;
};

// Null (and `why` set) when io_uring is refused here (seccomp, old kernel, limits). The workers' threads
// run `nice` steps below their creator's priority (lower_this_thread): writing and summing are background.
// `flush_depth`: writes in flight on its ring.
std::unique_ptr<FlushWorker> make_uring_worker(unsigned flush_depth, int nice, std::string* why);
std::unique_ptr<FlushWorker> make_pwrite_worker(unsigned threads, int nice);

// Whether this build has the io_uring backend (liburing's headers were found when it was built).
bool built_with_io_uring();
// Why this build has no io_uring backend ("" where it has one).
const char* io_uring_absent_why();

// Runs one op to completion with plain syscalls; returns 0 or a positive errno. Shared by the pwrite pool and
// by the synchronous reader fallback.
int run_op_sync(IoOp& op);

}  // namespace ds
