// Shared vocabulary of the core: alignment helpers, the Error value carried to Python, monotonic time.
#pragma once

#include <pthread.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>

namespace ds {

// O_DIRECT needs buffers, offsets and lengths aligned to the logical block size; 4096 covers every device.
constexpr std::size_t kPage = 4096;

inline std::size_t align_up(std::size_t x, std::size_t a) {
  return (x + a - 1) / a * a;
}
inline std::size_t align_down(std::size_t x, std::size_t a) {
  return x / a * a;
}

// Names the calling thread (at most 15 characters) as top, ps and /proc show it: "ds-<role>" for the
// engine's threads, whose CPU time nanotron_datastates.cpu_use adds up by role.
inline void name_this_thread(const char* name) {
  pthread_setname_np(pthread_self(), name);
}

// Lowers the calling thread's scheduling priority by `nice` steps (Linux gives each thread its own nice
// value; threads it starts inherit it): background work then yields a core to the threads that feed the
// GPU whenever they compete for it. Raising nice needs no privilege; where it still fails, the thread runs
// at its creator's priority, which is only slower for training, never wrong.
inline void lower_this_thread(int nice) {
  if (nice <= 0) return;
  const auto tid = static_cast<id_t>(syscall(SYS_gettid));
  errno = 0;
  const int now = getpriority(PRIO_PROCESS, tid);
  if (now == -1 && errno != 0) return;
  setpriority(PRIO_PROCESS, tid, now + nice > 19 ? 19 : now + nice);
}

// Counts a group of threads in as each is set up (named, its priority set); their creator waits for all, so
// that once a constructor returns its threads are what top and /proc show, with their names and priorities.
// A member of the threads' owner: it outlives every thread's arrive().
class StartLatch {
 public:
  explicit StartLatch(unsigned n) : left_(n) {}
  void arrive() {
    std::lock_guard<std::mutex> lock(mu_);
    if (left_ > 0 && --left_ == 0) cv_.notify_all();
  }
  void wait() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return left_ == 0; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  unsigned left_;
};

inline std::uint64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// An error as it reaches Python. Os: OSError(errno, message, path); Cuda/Internal: RuntimeError;
// Value: ValueError. Errors are values inside the core; they are thrown only as ErrorException, and the
// binding translates that exception, so nothing escapes into Python as a C++ exception.
struct Error {
  enum class Kind { None, Os, Cuda, Value, Internal };
  Kind kind = Kind::None;
  int os_errno = 0;
  std::string message;
  std::string path;

  explicit operator bool() const { return kind != Kind::None; }

  // message reads "No space left on device (writing data)"; Python's OSError adds errno and path.
  static Error os(int err, const std::string& what, const std::string& path) {
    return {Kind::Os, err, std::string(std::strerror(err)) + " (" + what + ")", path};
  }
  static Error cuda(const std::string& message) { return {Kind::Cuda, 0, message, {}}; }
  static Error value(const std::string& message, const std::string& path = {}) {
    return {Kind::Value, 0, message, path};
  }
  static Error internal(const std::string& message) { return {Kind::Internal, 0, message, {}}; }
};

struct ErrorException : std::exception {
  Error error;
  explicit ErrorException(Error e) : error(std::move(e)) {}
  const char* what() const noexcept override { return error.message.c_str(); }
};

}  // namespace ds
