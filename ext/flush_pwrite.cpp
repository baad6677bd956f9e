// The fallback flush worker: a pool of threads doing blocking pwrite/fsync, for machines where io_uring is
// refused. Same contract as the io_uring worker: ops run to completion (short writes resumed, EINTR/EAGAIN
// retried), then their target is called, and a follow-up op runs on the same thread.
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "common.hpp"
#include "fault.hpp"
#include "flush.hpp"

namespace ds {

int run_op_sync(IoOp& op) {
  if (const int injected = fault::check(op)) return injected;  // tests only
  if (op.kind == IoOp::Kind::Fsync) {
    while (fsync(op.fd) != 0)
      if (errno != EINTR) return errno;
    return 0;
  }
  while (op.done < op.len) {
    ssize_t r = op.kind == IoOp::Kind::Write
                    ? pwrite(op.fd, op.buf + op.done, op.len - op.done, op.offset + op.done)
                    : pread(op.fd, op.buf + op.done, op.len - op.done, op.offset + op.done);
    if (r < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return errno;
    }
    if (r == 0) return op.kind == IoOp::Kind::Read ? ENODATA : EIO;
    op.done += static_cast<std::size_t>(r);
  }
  return 0;
}

namespace {

class PwriteWorker final : public FlushWorker {
 public:
  // Returns once every thread is named and runs at its priority.
  PwriteWorker(unsigned threads, int nice) : started_(threads) {
    for (unsigned i = 0; i < threads; ++i) threads_.emplace_back([this, nice] { run(nice); });
    started_.wait();
  }
  ~PwriteWorker() override { stop(); }

  void submit(IoOp* op) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(op);
    }
    cv_.notify_one();
  }

  void stop() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_)
      if (t.joinable()) t.join();
  }

 private:
  void run(int nice) {
    name_this_thread("ds-flush");
    lower_this_thread(nice);
    started_.arrive();
    for (;;) {
      IoOp* op;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping and drained
        op = queue_.front();
        queue_.pop_front();
      }
      while (op) {
        if (!op->prepared) {
          op->prepared = true;
          op->target->on_io_prepare(*op);
        }
        const int err = run_op_sync(*op);
        op = op->target->on_io_complete(*op, err);
      }
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<IoOp*> queue_;
  bool stopping_ = false;
  StartLatch started_;
  std::vector<std::thread> threads_;
};

}  // namespace

std::unique_ptr<FlushWorker> make_pwrite_worker(unsigned threads, int nice) {
  return std::make_unique<PwriteWorker>(threads, nice);
}

}  // namespace ds
