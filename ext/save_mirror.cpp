// A save's mirror copy (a memory tier on tmpfs), mapped as the save's staging memory (mirror_file.hpp):
// opened at plan, or recycled from an earlier save's file, renamed into place when the job ends well and then
// kept mapped for a later save to recycle. A mirror that cannot be had drops the mirror only: the pieces then
// go through cache chunks.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <new>

#include "save_files.hpp"
#include "save_job.hpp"

namespace ds {

void SaveJob::open_mirror() {
  std::string dir;
  mirror_tmp_ = temporary_path(mirror_, &dir);
  if (int e = make_dirs(dir)) return mirror_fail(Error::os(e, "creating the folder of the mirror copy", dir));
  const std::size_t bytes = align_up(layout_.file_size, kPage);
  std::shared_ptr<MirrorFile> old;
  bool existing = false;
  if (!recycle_.empty()) {
    old = mirrors_ ? mirrors_->take(recycle_) : nullptr;  // still mapped (and pinned) by this process
    existing = rename(recycle_.c_str(), mirror_tmp_.c_str()) == 0;
    if (!existing) old.reset();  // gone: a new file
  }
  try {
    if (old && old->size() == bytes && old->origin() == layout_.data_start) {
      if (Error e = old->resize(bytes, mirror_tmp_)) throw ErrorException(e);
      map_ = std::move(old);
    } else {
      old.reset();  // another layout, or not mapped here: mapped anew
      map_ = std::make_shared<MirrorFile>(mirror_tmp_, bytes, existing, cache_->chunk_bytes(),
                                          layout_.data_start, cache_->pin_device());
      if (mirrors_) mirrors_->prepare_in_background(map_);
    }
  } catch (const ErrorException& e) {
    unlink(mirror_tmp_.c_str());
    mirror_fail(e.error);
  } catch (const std::bad_alloc&) {
    unlink(mirror_tmp_.c_str());
    mirror_fail(Error::os(ENOMEM, "mapping the mirror copy", mirror_));
  }
}

char* SaveJob::mirror_piece(std::size_t i) {
  if (!map_) return nullptr;
  const std::size_t lo = i * chunk_;
  const std::size_t len = align_up(std::min(chunk_, data_bytes_ - lo), kPage);
  map_->prepare(layout_.data_start + lo, len);
  return map_->data() + layout_.data_start + lo;
}

void SaveJob::release(char* buf) {
  if (!map_) cache_->release(buf);
}

void SaveJob::mirror_fail(const Error& e) {
  std::lock_guard<std::mutex> lock(mu_);
  if (mirror_error_.empty()) mirror_error_ = mirror_ + ": " + e.message;
}

// At the end of the job (every piece written or dropped): cut to its exact size and renamed into place if the
// save succeeded, then kept mapped for a later save; removed otherwise.
void SaveJob::close_mirror(bool commit) {
  if (!map_) return;
  std::shared_ptr<MirrorFile> map = std::move(map_);
  if (commit) {
    Error e = map->resize(layout_.file_size, mirror_tmp_);
    if (!e && rename(mirror_tmp_.c_str(), mirror_.c_str()) != 0)
      e = Error::os(errno, "renaming the mirror copy into place", mirror_);
    if (!e) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        stats_.mirrored = true;
      }
      if (mirrors_) mirrors_->put(mirror_, std::move(map));
      return;
    }
    mirror_fail(e);
  }
  unlink(mirror_tmp_.c_str());
}

std::string SaveJob::mirror_error() {
  std::lock_guard<std::mutex> lock(mu_);
  return mirror_error_;
}

}  // namespace ds
