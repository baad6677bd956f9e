// A save's mirror copy (a memory tier on tmpfs): written by the flush workers from the same cache chunks as
// the file itself, after each piece's own write, and renamed into place when the job ends well. A mirror
// that fails only drops the mirror, never the save.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "save_files.hpp"
#include "save_job.hpp"

namespace ds {

void SaveJob::open_mirror() {
  std::string dir;
  mirror_tmp_ = temporary_path(mirror_, &dir);
  if (int e = make_dirs(dir)) return mirror_fail(e, "creating its directory for");
  mirror_fd_ = open(mirror_tmp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
  if (mirror_fd_ < 0) return mirror_fail(errno, "creating");
  mirror_ok_.store(true, std::memory_order_release);
}

void SaveJob::write_mirror(const char* buf, std::size_t len, std::uint64_t offset) {
  if (!mirror_ok_.load(std::memory_order_acquire)) return;
  while (len > 0) {  // tmpfs writes whole buffers; a short write (ENOSPC midway) is resumed or reported
    const ssize_t n = pwrite(mirror_fd_, buf, len, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return mirror_fail(n < 0 ? errno : ENOSPC, "writing");
    buf += n;
    len -= static_cast<std::size_t>(n);
    offset += static_cast<std::uint64_t>(n);
  }
}

void SaveJob::truncate_mirror() {
  if (mirror_ok_.load(std::memory_order_acquire) &&
      ftruncate(mirror_fd_, static_cast<off_t>(layout_.file_size)) != 0)
    mirror_fail(errno, "truncating");
}

void SaveJob::mirror_fail(int err, const std::string& what) {
  mirror_ok_.store(false, std::memory_order_release);
  std::lock_guard<std::mutex> lock(mu_);
  if (mirror_error_.empty())
    mirror_error_ = mirror_ + ": " + std::strerror(err) + " (" + what + " the mirror copy)";
}

// At the end of the job (every piece written or dropped): renamed into place if the save and the mirror both
// succeeded, removed otherwise.
void SaveJob::close_mirror(bool commit) {
  if (mirror_fd_ < 0) return;
  close(mirror_fd_);
  mirror_fd_ = -1;
  if (commit && mirror_ok_.load(std::memory_order_acquire)) {
    if (rename(mirror_tmp_.c_str(), mirror_.c_str()) == 0) {
      std::lock_guard<std::mutex> lock(mu_);
      stats_.mirrored = true;
      return;
    }
    mirror_fail(errno, "renaming into place");
  }
  unlink(mirror_tmp_.c_str());
}

std::string SaveJob::mirror_error() {
  std::lock_guard<std::mutex> lock(mu_);
  return mirror_error_;
}

}  // namespace ds
