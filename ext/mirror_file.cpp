#include "mirror_file.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <unordered_set>

#include "cuda.hpp"
#include "host_cache.hpp"

namespace ds {

MirrorFile::MirrorFile(Storage& storage, int fd, const std::string& path, std::size_t bytes,
                       std::size_t block, std::size_t origin, int pin_device)
    : fd_(fd), bytes_(bytes), block_(block), origin_(std::min(origin, bytes)), pin_device_(pin_device) {
  // Allocated first: nothing to undo if they cannot be had.
  blocks_ = 1 + (bytes_ - origin_ + block_ - 1) / block_;
  once_ = std::make_unique<std::once_flag[]>(blocks_);
  pinned_ = std::make_unique<std::atomic<bool>[]>(blocks_);
  for (std::size_t i = 0; i < blocks_; ++i) pinned_[i].store(false);
  struct stat st {};
  auto fail = [&](Error e) {
    if (base_) munmap(base_, bytes_);
    fd_ = -1;  // the caller's still: it closes the file and removes it
    throw ErrorException(std::move(e));
  };
  if (fstat(fd_, &st) != 0) fail(Error::os(errno, "checking the mirror copy", path));
  if (!S_ISREG(st.st_mode) || st.st_uid != geteuid() || st.st_nlink != 1)  // a second name: not ours alone
    fail(Error::value("the mirror copy is not a regular file of this user's with one name", path));
  dev_ = st.st_dev;
  ino_ = st.st_ino;
  if (Error e = resize(storage, bytes, path)) fail(e);
  // Reserved now: a tmpfs out of room then fails here, not with a SIGBUS in the middle of a copy.
  if (int e = posix_fallocate(fd_, 0, static_cast<off_t>(bytes)); e != 0 && e != EOPNOTSUPP)
    fail(Error::os(e, "reserving the memory of the mirror copy", path));
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
  if (p == MAP_FAILED) fail(Error::os(errno, "mapping the mirror copy", path));
  base_ = static_cast<char*>(p);
  madvise(base_, bytes_, MADV_DONTFORK);  // data loader workers must not share it
}

MirrorFile::~MirrorFile() {
  const cuda::Api* api = pin_device_ >= 0 ? cuda::api() : nullptr;
  for (std::size_t i = 0; api && i < blocks_; ++i)
    if (pinned_[i].load()) api->cuMemHostUnregister(base_ + block_start(i));
  if (base_) munmap(base_, bytes_);
  if (fd_ >= 0) close(fd_);
}

Error MirrorFile::resize(Storage& storage, std::size_t file_bytes, const std::string& path) {
  struct stat st {};
  if (fstat(fd_, &st) != 0) return Error::os(errno, "checking the mirror copy", path);
  if (static_cast<std::size_t>(st.st_size) == file_bytes) return {};
  if (int e = storage.truncate(fd_, file_bytes)) return Error::os(e, "sizing the mirror copy", path);
  return {};
}

bool MirrorFile::named(const std::string& path) const {
  struct stat st {};
  return lstat(path.c_str(), &st) == 0 && st.st_dev == dev_ && st.st_ino == ino_;
}

Error MirrorFile::reusable(const std::string& path) const {
  struct stat st {};
  if (fstat(fd_, &st) != 0) return Error::os(errno, "checking the kept mirror copy", path);
  if (!S_ISREG(st.st_mode) || st.st_uid != geteuid())
    return Error::value("the kept mirror copy is no longer a regular file of this user's", path);
  if (st.st_nlink != 1)
    return Error::value("the kept mirror copy has a second name (a hard link) since it was mapped", path);
  if (!named(path)) return Error::value("the file renamed for reuse is not the kept mirror copy", path);
  return {};
}

void MirrorFile::prepare(std::size_t offset, std::size_t len) {
  if (len == 0) return;
  const std::size_t last = block_of(std::min(offset + len, bytes_) - 1);
  for (std::size_t i = block_of(offset); i <= last; ++i) prepare_block_once(i);
}

void MirrorFile::prepare_block_once(std::size_t i) {
  std::call_once(once_[i], [this, i] { prepare_block(i); });
}

std::size_t MirrorFile::block_of(std::size_t offset) const {
  return offset < origin_ ? 0 : 1 + (offset - origin_) / block_;
}

std::size_t MirrorFile::block_start(std::size_t i) const {
  return i == 0 ? 0 : origin_ + (i - 1) * block_;
}

void MirrorFile::prepare_block(std::size_t i) {
  const std::size_t lo = block_start(i), hi = i == 0 ? origin_ : std::min(bytes_, lo + block_);
  if (hi <= lo) return;
  if (fault_in(base_ + lo, hi - lo) && pin_device_ >= 0)
    pinned_[i].store(pin(base_ + lo, hi - lo, pin_device_).kind == Error::Kind::None);
}

void MirrorFiles::prepare_in_background(const std::shared_ptr<MirrorFile>& file) {
  if (!pool_) return;
  for (std::size_t i = 0; i < file->blocks(); ++i) pool_->submit([file, i] { file->prepare_block_once(i); });
}

std::shared_ptr<MirrorFile> MirrorFiles::take(const std::string& path) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = files_.find(path);
  if (it == files_.end()) return nullptr;
  std::shared_ptr<MirrorFile> f = std::move(it->second);
  files_.erase(it);
  return f;
}

void MirrorFiles::put(const std::string& path, std::shared_ptr<MirrorFile> file) {
  std::lock_guard<std::mutex> lock(mu_);
  files_[path] = std::move(file);
}

std::size_t MirrorFiles::keep_only(const std::vector<std::string>& keep) {
  const std::unordered_set<std::string> kept(keep.begin(), keep.end());
  return keep_if([&](const std::string& path, const MirrorFile&) { return kept.count(path) > 0; });
}

std::size_t MirrorFiles::keep_named() {
  return keep_if([](const std::string& path, const MirrorFile& file) { return file.named(path); });
}

std::size_t MirrorFiles::keep_if(const std::function<bool(const std::string&, const MirrorFile&)>& keep) {
  std::vector<std::shared_ptr<MirrorFile>> dropped;  // unmapped outside the lock
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = files_.begin(); it != files_.end();) {
    if (keep(it->first, *it->second)) {
      ++it;
    } else {
      dropped.push_back(std::move(it->second));
      it = files_.erase(it);
    }
  }
  return files_.size();
}

void MirrorFiles::clear() {
  std::unordered_map<std::string, std::shared_ptr<MirrorFile>> dropped;
  std::lock_guard<std::mutex> lock(mu_);
  dropped.swap(files_);
}

}  // namespace ds
