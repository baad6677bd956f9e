#include "reader.hpp"

#include <cerrno>

#include "flush.hpp"

namespace ds {
namespace {

int read_sync(int fd, const std::vector<ReadRange>& ranges) {
  for (const ReadRange& r : ranges) {
    IoOp op;
    op.kind = IoOp::Kind::Read;
    op.fd = fd;
    op.buf = r.dst;
    op.len = r.len;
    op.offset = r.offset;
    const int err = run_op_sync(op);
    if (err && !(err == ENODATA && op.done >= r.need)) return err;
  }
  return 0;
}

}  // namespace

int read_ranges(int fd, const std::vector<ReadRange>& ranges, bool use_uring, unsigned depth) {
  int err = 0;
  if (use_uring && read_ranges_uring(fd, ranges, depth, &err)) return err;
  return read_sync(fd, ranges);
}

}  // namespace ds
