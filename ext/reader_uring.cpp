// Restore's reads through io_uring: a ring per calling thread, created on first use, a sliding window of
// `depth` reads in flight (short reads resumed, EAGAIN/EINTR retried).
#include <liburing.h>

#include <cerrno>
#include <deque>

#include "reader.hpp"

namespace ds {
namespace {

struct ThreadRing {
  io_uring ring{};
  bool ok = false;
  unsigned depth = 0;
  ~ThreadRing() {
    if (ok) io_uring_queue_exit(&ring);
  }
};

ThreadRing* thread_ring(unsigned depth) {
  thread_local ThreadRing tr;
  if (!tr.ok) {
    if (io_uring_queue_init(depth, &tr.ring, 0) < 0) return nullptr;
    tr.ok = true;
    tr.depth = depth;
  }
  return &tr;
}

}  // namespace

bool read_ranges_uring(int fd, const std::vector<ReadRange>& ranges, unsigned depth, int* err) {
  ThreadRing* tr = thread_ring(depth);
  if (!tr) return false;
  struct Req {
    const ReadRange* r;
    std::size_t done;
  };
  std::vector<Req> reqs;
  reqs.reserve(ranges.size());
  for (const ReadRange& r : ranges)
    if (r.len) reqs.push_back({&r, 0});
  std::deque<Req*> todo;
  for (Req& q : reqs) todo.push_back(&q);
  unsigned inflight = 0;
  int first_err = 0;
  while (inflight > 0 || (!todo.empty() && !first_err)) {
    while (!todo.empty() && !first_err && inflight < tr->depth) {
      io_uring_sqe* sqe = io_uring_get_sqe(&tr->ring);
      if (!sqe) break;
      Req* q = todo.front();
      todo.pop_front();
      io_uring_prep_read(sqe, fd, q->r->dst + q->done, q->r->len - q->done, q->r->offset + q->done);
      io_uring_sqe_set_data(sqe, q);
      ++inflight;
    }
    io_uring_submit_and_wait(&tr->ring, 1);
    unsigned head, seen = 0;
    io_uring_cqe* cqe;
    io_uring_for_each_cqe(&tr->ring, head, cqe) {
      ++seen;
      --inflight;
      Req* q = static_cast<Req*>(io_uring_cqe_get_data(cqe));
      const int res = cqe->res;
      if (res == -EAGAIN || res == -EINTR) {
        todo.push_front(q);
      } else if (res < 0) {
        if (!first_err) first_err = -res;
      } else if (res == 0) {
        if (q->done < q->r->need && !first_err) first_err = ENODATA;  // else: the file ended where it may
      } else {
        q->done += static_cast<std::size_t>(res);
        if (q->done < q->r->len) todo.push_front(q);  // short read: resume
      }
    }
    io_uring_cq_advance(&tr->ring, seen);
  }
  *err = first_err;
  return true;
}

}  // namespace ds
