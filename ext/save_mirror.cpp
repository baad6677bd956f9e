// A save's mirror copy (a memory tier on tmpfs), mapped as the save's staging memory (mirror_file.hpp):
// opened at plan, or recycled from an earlier save's file, renamed into place when the job ends well and then
// kept mapped for a later save to recycle. A mirror that cannot be had drops the mirror only: the pieces then
// go through cache chunks. Its file operations go through the engine's storage target (storage.hpp), the
// file opened with Access::Mapped.
#include <algorithm>
#include <cerrno>
#include <new>

#include "save_job.hpp"

namespace ds {

void SaveJob::open_mirror() {
  // The temporary, its folder, and an earlier save's file renamed onto it (reused) where there is one.
  if (int e = storage_->create(mirror_, &mirror_file_, recycle_))
    return mirror_fail(Error::os(e, "creating the folder of the mirror copy", mirror_file_.folder));
  const std::string& tmp = mirror_file_.temp;
  std::shared_ptr<MirrorFile> old = std::move(recycled_);  // still mapped (and pinned) by this process
  if (!mirror_file_.reused) old.reset();                   // gone: a new file
  if (old) {
    // Checked right before the copies write into it: a file that gained a second name, or is not the one
    // mapped, is never written through. Its name here goes (another name keeps its bytes), and a new file
    // takes the save.
    if (Error why = old->reusable(tmp)) {
      old.reset();
      storage_->discard(mirror_file_);
      mirror_file_.reused = false;
      std::lock_guard<std::mutex> lock(mu_);
      stats_.mirror_refused = recycle_ + ": " + why.message;
    }
  }
  // A kept mapping whose header room is larger (this header came out shorter, or the file was made with room
  // to spare: mirror_prepare.cpp): the header is padded to it, so that the mapping is taken as it is.
  if (old && old->origin() > layout_.data_start &&
      old->size() == align_up(old->origin() + data_bytes_, kPage)) {
    pad_header(layout_, old->origin());
    std::lock_guard<std::mutex> lock(mu_);
    stats_.file_bytes = layout_.file_size;
  }
  const std::size_t bytes = align_up(layout_.file_size, kPage);
  // Pinned only for copies from a GPU: a save of host values (a scheduler's state) memcpys into it, and
  // pinning takes the CUDA driver's locks that the training thread's launches need.
  const int pin = on_device_ ? cache_->pin_device() : -1;
  try {
    if (old && old->size() == bytes && old->origin() == layout_.data_start &&
        (pin < 0 || old->pin_device() >= 0)) {
      if (Error e = old->resize(*storage_, bytes, tmp)) throw ErrorException(e);
      map_ = std::move(old);
      std::lock_guard<std::mutex> lock(mu_);
      stats_.mirror_kept = true;
    } else {
      old.reset();  // another layout, or not mapped here: mapped anew
      if (int e = storage_->open(mirror_file_, Access::Mapped))
        throw ErrorException(Error::os(e, "opening the mirror copy", tmp));
      map_ = std::make_shared<MirrorFile>(*storage_, mirror_file_.fd, tmp, bytes, cache_->chunk_bytes(),
                                          layout_.data_start, pin);
      mirror_file_.fd = -1;  // the mapping's now
      if (mirrors_) mirrors_->prepare_in_background(map_);
    }
  } catch (const ErrorException& e) {
    storage_->discard(mirror_file_);
    mirror_fail(e.error);
  } catch (const std::bad_alloc&) {
    storage_->discard(mirror_file_);
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
  if (!mirror_error_.empty()) return;
  mirror_error_ = mirror_ + ": " + e.message;
  mirror_errno_ = e.os_errno;
}

// At the end of the job (every piece written or dropped): cut to its exact size and renamed into place if the
// save succeeded, then kept mapped for a later save; removed otherwise.
void SaveJob::close_mirror(bool commit) {
  if (!map_) return;
  std::shared_ptr<MirrorFile> map = std::move(map_);
  if (commit) {
    Error e = map->resize(*storage_, layout_.file_size, mirror_file_.temp);
    if (!e)
      if (int r = storage_->publish(mirror_file_))
        e = Error::os(r, "renaming the mirror copy into place", mirror_);
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
  storage_->discard(mirror_file_);
}

std::string SaveJob::mirror_error() {
  std::lock_guard<std::mutex> lock(mu_);
  return mirror_error_;
}

}  // namespace ds
