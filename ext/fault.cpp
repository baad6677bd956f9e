#include "fault.hpp"

#include <unistd.h>

#include <atomic>
#include <climits>
#include <mutex>

namespace ds::fault {
namespace {

struct Spec {
  std::string kind;
  int err = 0;
  std::string path_contains;
  int skip = 0;
  int count = 0;
  int hits = 0;
};

std::atomic<bool> g_armed{false};
std::mutex g_mu;
Spec g_spec;

const char* kind_name(IoOp::Kind k) {
  switch (k) {
    case IoOp::Kind::Write:
      return "write";
    case IoOp::Kind::Fsync:
      return "fsync";
    case IoOp::Kind::Read:
      return "read";
  }
  return "";
}

std::string fd_path(int fd) {
  char buf[PATH_MAX];
  const std::string link = "/proc/self/fd/" + std::to_string(fd);
  const ssize_t n = readlink(link.c_str(), buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, static_cast<std::size_t>(n)) : std::string();
}

}  // namespace

void arm(const std::string& kind, int err, const std::string& path_contains, int skip, int count) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_spec = Spec{kind, err, path_contains, skip, count, 0};
  g_armed.store(count > 0);
}

void disarm() {
  std::lock_guard<std::mutex> lock(g_mu);
  g_armed.store(false);
}

int hits() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_spec.hits;
}

int check(const IoOp& op) {
  if (!g_armed.load(std::memory_order_relaxed)) return 0;
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_armed.load() || (g_spec.kind != "any" && g_spec.kind != kind_name(op.kind))) return 0;
  if (fd_path(op.fd).find(g_spec.path_contains) == std::string::npos) return 0;
  if (g_spec.skip > 0) {
    --g_spec.skip;
    return 0;
  }
  ++g_spec.hits;
  if (--g_spec.count == 0) g_armed.store(false);
  return g_spec.err;
}

}  // namespace ds::fault
