// Stage 4 of a save (save_job.hpp draws the whole life): after the last piece, the header with the
// combined checksums, the exact size, fsync, the rename onto the final path and the folder's fsync; on an
// error, the temporary file removed. Every step of a commit is here, each file operation through the
// engine's storage target (storage.hpp), the fsyncs as IoOps on its descriptors.
#include <algorithm>
#include <cerrno>
#include <cstring>

#include "crc32c.hpp"
#include "save_job.hpp"

namespace ds {
namespace {

IoOp fsync_of(int fd, IoTarget* target) {
  IoOp op{};
  op.kind = IoOp::Kind::Fsync;
  op.fd = fd;
  op.target = target;
  return op;
}

}  // namespace

// -- 4. commit ----------------------------------------------------------------------------------------------

// Each tensor's CRC-32C from its block segments' (summed by the flush workers), into the header.
void SaveJob::combine_checksums() {
  std::vector<std::uint32_t> crcs(layout_.order.size(), 0);
  for (std::size_t k = 0; k < layout_.order.size(); ++k) {
    const std::size_t n = tensors_[layout_.order[k]].nbytes;
    if (n == 0) continue;
    const std::size_t off = layout_.offset[layout_.order[k]];
    const std::size_t first = off / block_;
    std::uint32_t c = crc_parts_[k][0];
    for (std::size_t j = 1; j < crc_parts_[k].size(); ++j) {
      const std::size_t seg_lo = (first + j) * block_;
      const std::size_t len = std::min(seg_lo + block_, off + n) - seg_lo;
      c = crc32c_combine(c, crc_parts_[k][j], len);
    }
    crcs[k] = c;
  }
  patch_checksums(layout_, crcs, crc_parts_);  // a no-op where they are not embedded
  std::lock_guard<std::mutex> lock(mu_);
  crcs_ = std::move(crcs);
}

// The header with the combined checksums, in its page-aligned buffer and in the mirror's mapping.
bool SaveJob::prepare_header() {
  if (opts_.checksums) combine_checksums();
  if (posix_memalign(reinterpret_cast<void**>(&header_buf_), kPage, layout_.data_start) != 0) {
    fail(Error::os(ENOMEM, "allocating the header", path_));
    return false;
  }
  std::memcpy(header_buf_, layout_.header.data(), layout_.data_start);
  if (map_) std::memcpy(map_->data(), header_buf_, layout_.data_start);
  return true;
}

// A file kept in memory only: the header into the mapping, then the mirror renamed into place (finish).
IoOp* SaveJob::commit_in_memory() {
  prepare_header();
  finish();
  return nullptr;
}

IoOp* SaveJob::header_op() {
  if (!prepare_header()) return nullptr;
  header_op_ = IoOp{};
  header_op_.kind = IoOp::Kind::Write;
  header_op_.fd = file_.fd;
  header_op_.buf = header_buf_;
  header_op_.len = layout_.data_start;
  header_op_.offset = 0;
  header_op_.target = this;
  return &header_op_;
}

IoOp* SaveJob::header_written(int err) {
  if (err) {
    fail(Error::os(err, "writing the header of " + file_.temp, path_));
    abort_commit();
    return nullptr;
  }
  // O_DIRECT wrote whole blocks: the file takes its exact size.
  if (int e = storage_->truncate(file_.fd, layout_.file_size)) {
    fail(Error::os(e, "truncating " + file_.temp, path_));
    abort_commit();
    return nullptr;
  }
  if (!opts_.fsync) return rename_into_place();
  fsync_op_ = fsync_of(file_.fd, this);
  return &fsync_op_;
}

IoOp* SaveJob::data_synced(int err) {
  if (err) {
    fail(Error::os(err, "fsync of " + file_.temp, path_));
    abort_commit();
    return nullptr;
  }
  return rename_into_place();
}

// Each failure discards the file: the temporary before the rename, the final path after it.
IoOp* SaveJob::rename_into_place() {
  Error e;
  if (int c = storage_->close(file_)) {
    e = Error::os(c, "closing " + file_.temp, path_);
  } else if (int r = storage_->publish(file_)) {
    e = Error::os(r, "renaming " + file_.temp + " into place", path_);
  } else if (!opts_.fsync) {
    finish();
    return nullptr;
  } else if (int o = storage_->open_folder(file_)) {
    e = Error::os(o, "opening directory " + file_.folder + " to fsync it", path_);
  } else {
    dirsync_op_ = fsync_of(file_.folder_fd, this);
    return &dirsync_op_;
  }
  fail(std::move(e));
  storage_->discard(file_);
  finish();
  return nullptr;
}

IoOp* SaveJob::directory_synced(int err) {
  storage_->close(file_);
  if (err) {
    // Renamed but not known to be durable: do not leave it looking committed.
    fail(Error::os(err, "fsync of directory " + file_.folder, path_));
    storage_->discard(file_);
  }
  finish();
  return nullptr;
}

void SaveJob::abort_commit() {
  storage_->discard(file_);
  finish();
}

void SaveJob::finish() {
  std::shared_ptr<SaveJob> keep = std::move(self_);  // this may be the last reference: it dies on return
  close_mirror(!failed());
  {
    std::lock_guard<std::mutex> lock(mu_);
    const std::uint64_t t = now_ns();
    if (!snapshot_) {
      snapshot_ = true;
      stats_.t_snapshot_ns = t;
    }
    persisted_ = true;
    stats_.t_persisted_ns = t;
    cv_.notify_all();
  }
  if (observer_) observer_->job_finished();
}

void SaveJob::fail(Error e) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!error_) error_ = std::move(e);
  failed_.store(true, std::memory_order_release);
}

}  // namespace ds
