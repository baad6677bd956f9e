// The io_uring flush worker: one thread owns one ring (single issuer). Its loop, as in liburing's examples:
// take new ops from the inbox, fill SQEs up to the queue depth, submit and wait for at least one completion,
// handle every CQE (resume short writes, retry EAGAIN/EINTR, hand finished ops to their target). A read on an
// eventfd stays armed in the ring so that a new op wakes the thread as promptly as a completion does.
#include <liburing.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <deque>
#include <future>
#include <mutex>
#include <thread>

#include "common.hpp"
#include "fault.hpp"
#include "flush.hpp"

namespace ds {
namespace {

class UringWorker final : public FlushWorker {
 public:
  UringWorker(unsigned depth, int nice) : depth_(depth), nice_(nice) {}
  ~UringWorker() override { stop(); }

  // Starts the thread, which creates the ring itself (single issuer); false with `why` if refused.
  bool start(std::string* why) {
    efd_ = eventfd(0, EFD_CLOEXEC);
    if (efd_ < 0) {
      *why = std::string("eventfd: ") + std::strerror(errno);
      return false;
    }
    std::promise<int> ready;
    auto result = ready.get_future();
    thread_ = std::thread([this, &ready] { run(ready); });
    int r = result.get();
    if (r < 0) {
      thread_.join();
      close(efd_);
      efd_ = -1;
      *why = std::string("io_uring_queue_init: ") + std::strerror(-r);
      return false;
    }
    return true;
  }

  void submit(IoOp* op) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      inbox_.push_back(op);
    }
    wake();
  }

  void stop() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    if (thread_.joinable()) {
      wake();
      thread_.join();
    }
    if (efd_ >= 0) {
      close(efd_);
      efd_ = -1;
    }
  }

 private:
  void wake() {
    std::uint64_t one = 1;
    ssize_t r;
    do r = write(efd_, &one, sizeof one);
    while (r < 0 && errno == EINTR);
  }

  int init_ring() {
    io_uring_params p{};
    p.flags = IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_COOP_TASKRUN;
    int r = io_uring_queue_init_params(depth_ + 2, &ring_, &p);
    if (r == -EINVAL) {  // older kernel: no such flags
      p = io_uring_params{};
      r = io_uring_queue_init_params(depth_ + 2, &ring_, &p);
    }
    return r;
  }

  void arm_wake() {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    if (!sqe) return;  // retried after the next completion batch
    io_uring_prep_read(sqe, efd_, &efd_buf_, sizeof efd_buf_, 0);
    io_uring_sqe_set_data(sqe, &efd_buf_);
    wake_armed_ = true;
  }

  bool prep(IoOp* op) {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    if (!sqe) return false;
    switch (op->kind) {
      case IoOp::Kind::Write:
        io_uring_prep_write(sqe, op->fd, op->buf + op->done, op->len - op->done, op->offset + op->done);
        break;
      case IoOp::Kind::Read:
        io_uring_prep_read(sqe, op->fd, op->buf + op->done, op->len - op->done, op->offset + op->done);
        break;
      case IoOp::Kind::Fsync:
        io_uring_prep_fsync(sqe, op->fd, 0);
        break;
    }
    io_uring_sqe_set_data(sqe, op);
    return true;
  }

  void finish(IoOp* op, int err) {
    if (IoOp* next = op->target->on_io_complete(*op, err)) pending_.push_back(next);
  }

  void handle(IoOp* op, int res) {
    --inflight_;
    if (res == -EAGAIN || res == -EINTR) {
      pending_.push_front(op);
    } else if (res < 0) {
      finish(op, -res);
    } else if (op->kind == IoOp::Kind::Fsync) {
      finish(op, 0);
    } else if (res == 0 && op->done < op->len) {
      finish(op, op->kind == IoOp::Kind::Read ? ENODATA : EIO);  // no progress: end of file / device
    } else {
      op->done += static_cast<std::size_t>(res);
      if (op->done < op->len)
        pending_.push_front(op);  // short transfer: resume where it stopped
      else
        finish(op, 0);
    }
  }

  void run(std::promise<int>& ready) {
    name_this_thread("ds-flush");
    lower_this_thread(nice_);
    int r = init_ring();
    ready.set_value(r);
    if (r < 0) return;
    arm_wake();
    for (;;) {
      bool stopping;
      {
        std::lock_guard<std::mutex> lock(mu_);
        while (!inbox_.empty()) {
          pending_.push_back(inbox_.front());
          inbox_.pop_front();
        }
        stopping = stopping_;
      }
      while (!pending_.empty() && inflight_ < depth_) {
        IoOp* op = pending_.front();
        if (!op->prepared) {
          op->prepared = true;
          op->target->on_io_prepare(*op);
        }
        if (const int injected = fault::check(*op)) {  // tests only: fail it instead of doing it
          pending_.pop_front();
          finish(op, injected);
          continue;
        }
        if (!prep(op)) break;
        pending_.pop_front();
        ++inflight_;
      }
      if (stopping && inflight_ == 0 && pending_.empty()) break;
      if (!wake_armed_) arm_wake();
      int w = io_uring_submit_and_wait(&ring_, 1);
      if (w < 0 && w != -EINTR && w != -EAGAIN && w != -EBUSY) {
        std::fprintf(stderr, "nanotron_datastates: io_uring_submit_and_wait: %s\n", std::strerror(-w));
      }
      unsigned head, seen = 0;
      io_uring_cqe* cqe;
      io_uring_for_each_cqe(&ring_, head, cqe) {
        ++seen;
        void* d = io_uring_cqe_get_data(cqe);
        if (d == &efd_buf_) {
          wake_armed_ = false;
        } else {
          handle(static_cast<IoOp*>(d), cqe->res);
        }
      }
      io_uring_cq_advance(&ring_, seen);
    }
    io_uring_queue_exit(&ring_);  // cancels the armed eventfd read
  }

  const unsigned depth_;
  const int nice_;
  io_uring ring_{};
  int efd_ = -1;
  std::uint64_t efd_buf_ = 0;
  bool wake_armed_ = false;
  unsigned inflight_ = 0;
  std::deque<IoOp*> pending_;  // worker thread only

  std::mutex mu_;
  std::deque<IoOp*> inbox_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace

std::unique_ptr<FlushWorker> make_uring_worker(unsigned flush_depth, int nice, std::string* why) {
  auto w = std::make_unique<UringWorker>(flush_depth, nice);
  if (!w->start(why)) return nullptr;
  return w;
}

const char* io_uring_absent_why() {
  return "";
}

bool built_with_io_uring() {
  return true;
}

}  // namespace ds
