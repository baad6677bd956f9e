// One save of one file, its stages in the order they run (save_job.hpp draws the whole life):
//   1. plan     plan(): layout and header, checksum bookkeeping, the temporary file opened;
//   2. copy     copy_piece(): each piece into a cache chunk (or the mirror's mapping); the last one captured
//               completes the snapshot;
//   3. flush    on_io_prepare() sums a piece as a worker writes it; piece_written() gives its chunk back;
//   4. commit   after the last piece: header_op() (checksums combined into the header), header_written()
//               (exact size), data_synced() (rename into place), directory_synced(), finish().
// The mirror copy is save_mirror.cpp's; the waits and results the bindings read close this file.
#include "save_job.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <numeric>

#include "crc32c.hpp"
#include "save_files.hpp"

namespace ds {
namespace {

bool wait_flag(std::condition_variable& cv, std::unique_lock<std::mutex>& lock, const bool& flag,
               double timeout_s) {
  if (timeout_s < 0) {
    cv.wait(lock, [&] { return flag; });
    return true;
  }
  return cv.wait_for(lock, std::chrono::duration<double>(timeout_s), [&] { return flag; });
}

IoOp fsync_of(int fd, IoTarget* target) {
  IoOp op{};
  op.kind = IoOp::Kind::Fsync;
  op.fd = fd;
  op.target = target;
  return op;
}

}  // namespace

SaveJob::SaveJob(std::string path, std::vector<TensorSrc> tensors, Metadata metadata, SaveOptions opts,
                 bool embed_checksums, std::shared_ptr<const cuda::StreamEvents> events, HostCache* cache,
                 JobObserver* observer, std::string mirror, MirrorFiles* mirrors, std::string recycle)
    : path_(std::move(path)),
      mirror_(std::move(mirror)),
      recycle_(std::move(recycle)),
      mirrors_(mirrors),
      tensors_(std::move(tensors)),
      metadata_(std::move(metadata)),
      opts_(opts),
      embed_checksums_(embed_checksums),
      cache_(cache),
      observer_(observer),
      events_(std::move(events)) {
  stats_.t_submit_ns = now_ns();
  for (const TensorSrc& t : tensors_) on_device_ = on_device_ || t.device >= 0;
}

SaveJob::~SaveJob() {
  std::free(header_buf_);
  if (fd_ >= 0) close(fd_);
  if (dirfd_ >= 0) close(dirfd_);
}

// -- 1. plan ------------------------------------------------------------------------------------------------

SaveJob::Planned SaveJob::plan() {
  Planned out;
  if (!plan_file() || !open_temporary()) {
    finish();
    return out;
  }
  if (!mirror_.empty()) open_mirror();
  piece_ops_.resize(npieces_);
  to_capture_.store(npieces_);
  to_write_.store(npieces_);
  out.pieces = npieces_;
  if (npieces_ == 0) {  // nothing to copy: the snapshot is done, the commit starts with the header
    {
      std::lock_guard<std::mutex> lock(mu_);
      snapshot_ = true;
      stats_.t_snapshot_ns = now_ns();
      cv_.notify_all();
    }
    out.first_op = header_op();
    if (!out.first_op) abort_commit();
  }
  return out;
}

bool SaveJob::plan_file() {
  try {
    // Block segments on a grid that divides the chunk: each is summed whole by the worker of its piece.
    block_ = std::gcd(cache_->chunk_bytes(), kBlockBytes);
    layout_ = plan_layout(tensors_, metadata_, opts_.checksums && embed_checksums_, block_);
  } catch (const ErrorException& e) {
    fail(Error{e.error.kind, e.error.os_errno, e.error.message, path_});
    return false;
  } catch (const std::bad_alloc&) {
    fail(Error::os(ENOMEM, "planning the header", path_));
    return false;
  }
  chunk_ = cache_->chunk_bytes();
  data_bytes_ = layout_.file_size - layout_.data_start;
  npieces_ = (data_bytes_ + chunk_ - 1) / chunk_;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.file_bytes = layout_.file_size;
    stats_.tensor_bytes = data_bytes_;
  }
  // Checksum bookkeeping: the block segments of each tensor.
  crc_parts_.resize(tensors_.size());
  for (std::size_t k = 0; k < layout_.order.size(); ++k) {
    const std::size_t t = layout_.order[k];
    crc_parts_[k].assign(num_segments(layout_.offset[t], tensors_[t].nbytes, block_), 0);
  }
  return true;
}

// The temporary file beside the final path, with its parent folders: created before any byte is queued, so
// nothing truncates later. O_DIRECT where the filesystem has it.
bool SaveJob::open_temporary() {
  tmp_path_ = temporary_path(path_, &dir_);
  if (int e = make_dirs(dir_)) {
    fail(Error::os(e, "creating the directory " + dir_, path_));
    return false;
  }
  const int flags = O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC;
  if (opts_.direct_io) {
    fd_ = open(tmp_path_.c_str(), flags | O_DIRECT, 0666);
    direct_ = fd_ >= 0;
    if (fd_ < 0 && errno != EINVAL) {  // EINVAL: this filesystem has no O_DIRECT (tmpfs); write buffered
      fail(Error::os(errno, "creating the temporary file " + tmp_path_, path_));
      return false;
    }
  }
  if (fd_ < 0) {
    fd_ = open(tmp_path_.c_str(), flags, 0666);
    if (fd_ < 0) {
      fail(Error::os(errno, "creating the temporary file " + tmp_path_, path_));
      return false;
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  stats_.direct_io = direct_;
  return true;
}

// -- 2. copy ------------------------------------------------------------------------------------------------

IoOp* SaveJob::copy_piece(std::size_t i, char* chunk, PieceCopier& copier) {
  const std::size_t lo = i * chunk_, hi = std::min(lo + chunk_, data_bytes_);
  const auto& order = layout_.order;
  Error err;
  for (std::size_t k = first_ending_after(lo); k < order.size() && layout_.offset[order[k]] < hi && !err;
       ++k) {
    const TensorSrc& t = tensors_[order[k]];
    const std::size_t off = layout_.offset[order[k]];
    const std::size_t b = std::max(lo, off) - off, e = std::min(hi, off + t.nbytes) - off;
    err = copier.copy(t, b, e, chunk + (off + b - lo));
  }
  if (Error e = copier.finish(); e && !err) err = e;
  if (err) {
    release(chunk);
    fail(Error{err.kind, err.os_errno, err.message, path_});
    piece_captured();
    if (IoOp* op = piece_finished()) return op;  // never: the job has failed
    return nullptr;
  }
  std::size_t len = hi - lo;
  if (direct_) {  // O_DIRECT writes whole blocks: zero the tail padding, ftruncate removes it at commit
    const std::size_t padded = align_up(len, kPage);
    std::memset(chunk + len, 0, padded - len);
    len = padded;
  }
  IoOp& op = piece_ops_[i];
  op.kind = IoOp::Kind::Write;
  op.fd = fd_;
  op.buf = chunk;
  op.len = len;
  op.offset = layout_.data_start + lo;
  op.target = this;
  op.tag = i;
  piece_captured();
  return &op;
}

std::size_t SaveJob::first_ending_after(std::size_t lo) const {
  const auto& order = layout_.order;
  return std::partition_point(order.begin(), order.end(),
                              [&](std::size_t t) { return layout_.offset[t] + tensors_[t].nbytes <= lo; }) -
         order.begin();
}

void SaveJob::skip_piece(std::size_t i) {
  piece_captured();
  piece_finished();
}

void SaveJob::piece_captured() {
  if (to_capture_.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  std::lock_guard<std::mutex> lock(mu_);
  snapshot_ = true;
  stats_.t_snapshot_ns = now_ns();
  cv_.notify_all();
}

// -- 3. flush -----------------------------------------------------------------------------------------------

void SaveJob::on_io_prepare(IoOp& op) {
  if (&op == &header_op_ || op.kind != IoOp::Kind::Write || !opts_.checksums) return;
  // Sum each block segment of this piece; pieces are summed on different workers and combined at commit.
  const std::size_t i = op.tag;
  const std::size_t lo = i * chunk_, hi = std::min(lo + chunk_, data_bytes_);
  const auto& order = layout_.order;
  for (std::size_t k = first_ending_after(lo); k < order.size() && layout_.offset[order[k]] < hi; ++k) {
    const std::size_t off = layout_.offset[order[k]], n = tensors_[order[k]].nbytes;
    const std::size_t e = std::min(hi, off + n);
    for (std::size_t b = std::max(lo, off), next; b < e; b = next) {
      next = std::min(e, (b / block_ + 1) * block_);
      crc_parts_[k][b / block_ - off / block_] = crc32c(0, op.buf + (b - lo), next - b);
    }
  }
}

// A worker's write or fsync of this job has completed: the step it ends leads to the next.
IoOp* SaveJob::on_io_complete(IoOp& op, int err) {
  if (&op == &header_op_) return header_written(err);
  if (&op == &fsync_op_) return data_synced(err);
  if (&op == &dirsync_op_) return directory_synced(err);
  return piece_written(op, err);
}

// A data piece: its chunk goes back (a piece in the mirror's mapping stays there).
IoOp* SaveJob::piece_written(IoOp& op, int err) {
  release(op.buf);
  if (err)
    fail(Error::os(err,
                   "writing " + std::to_string(op.len) + " bytes at offset " + std::to_string(op.offset) +
                       " of " + tmp_path_,
                   path_));
  return piece_finished();
}

IoOp* SaveJob::piece_finished() {
  if (to_write_.fetch_sub(1, std::memory_order_acq_rel) != 1) return nullptr;
  if (failed()) {
    abort_commit();
    return nullptr;
  }
  IoOp* op = header_op();
  if (!op) abort_commit();
  return op;
}

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

IoOp* SaveJob::header_op() {
  if (opts_.checksums) combine_checksums();
  if (posix_memalign(reinterpret_cast<void**>(&header_buf_), kPage, layout_.data_start) != 0) {
    fail(Error::os(ENOMEM, "allocating the header", path_));
    return nullptr;
  }
  std::memcpy(header_buf_, layout_.header.data(), layout_.data_start);
  if (map_) std::memcpy(map_->data(), header_buf_, layout_.data_start);
  header_op_ = IoOp{};
  header_op_.kind = IoOp::Kind::Write;
  header_op_.fd = fd_;
  header_op_.buf = header_buf_;
  header_op_.len = layout_.data_start;
  header_op_.offset = 0;
  header_op_.target = this;
  return &header_op_;
}

IoOp* SaveJob::header_written(int err) {
  if (err) {
    fail(Error::os(err, "writing the header of " + tmp_path_, path_));
    abort_commit();
    return nullptr;
  }
  // O_DIRECT wrote whole blocks: the file takes its exact size.
  if (ftruncate(fd_, static_cast<off_t>(layout_.file_size)) != 0) {
    fail(Error::os(errno, "truncating " + tmp_path_, path_));
    abort_commit();
    return nullptr;
  }
  if (!opts_.fsync) return rename_into_place();
  fsync_op_ = fsync_of(fd_, this);
  return &fsync_op_;
}

IoOp* SaveJob::data_synced(int err) {
  if (err) {
    fail(Error::os(err, "fsync of " + tmp_path_, path_));
    abort_commit();
    return nullptr;
  }
  return rename_into_place();
}

IoOp* SaveJob::rename_into_place() {
  const int fd = fd_;
  fd_ = -1;
  if (close(fd) != 0) {
    fail(Error::os(errno, "closing " + tmp_path_, path_));
    unlink(tmp_path_.c_str());
    finish();
    return nullptr;
  }
  if (rename(tmp_path_.c_str(), path_.c_str()) != 0) {
    fail(Error::os(errno, "renaming " + tmp_path_ + " into place", path_));
    unlink(tmp_path_.c_str());
    finish();
    return nullptr;
  }
  if (!opts_.fsync) {
    finish();
    return nullptr;
  }
  dirfd_ = open(dir_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dirfd_ < 0) {
    fail(Error::os(errno, "opening directory " + dir_ + " to fsync it", path_));
    unlink(path_.c_str());
    finish();
    return nullptr;
  }
  dirsync_op_ = fsync_of(dirfd_, this);
  return &dirsync_op_;
}

IoOp* SaveJob::directory_synced(int err) {
  close(dirfd_);
  dirfd_ = -1;
  if (err) {
    // Renamed but not known to be durable: do not leave it looking committed.
    fail(Error::os(err, "fsync of directory " + dir_, path_));
    unlink(path_.c_str());
  }
  finish();
  return nullptr;
}

void SaveJob::abort_commit() {
  if (fd_ >= 0) {
    close(fd_);
    fd_ = -1;
  }
  if (!tmp_path_.empty()) unlink(tmp_path_.c_str());
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

// -- waits and results (the bindings' side) -----------------------------------------------------------------

bool SaveJob::wait_snapshot(double timeout_s) {
  std::unique_lock<std::mutex> lock(mu_);
  return wait_flag(cv_, lock, snapshot_, timeout_s);
}

bool SaveJob::wait_persisted(double timeout_s) {
  std::unique_lock<std::mutex> lock(mu_);
  return wait_flag(cv_, lock, persisted_, timeout_s);
}

bool SaveJob::snapshot_done() {
  std::lock_guard<std::mutex> lock(mu_);
  return snapshot_;
}

bool SaveJob::persisted_done() {
  std::lock_guard<std::mutex> lock(mu_);
  return persisted_;
}

Error SaveJob::error() {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

std::vector<std::pair<std::string, std::uint32_t>> SaveJob::checksums() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::pair<std::string, std::uint32_t>> out;
  if (!persisted_ || error_ || crcs_.size() != layout_.order.size()) return out;
  out.reserve(crcs_.size());
  for (std::size_t k = 0; k < crcs_.size(); ++k) out.emplace_back(tensors_[layout_.order[k]].name, crcs_[k]);
  return out;
}

std::pair<std::size_t, std::vector<std::pair<std::string, std::vector<std::uint32_t>>>>
SaveJob::block_checksums() {
  std::lock_guard<std::mutex> lock(mu_);
  std::pair<std::size_t, std::vector<std::pair<std::string, std::vector<std::uint32_t>>>> out{0, {}};
  if (!persisted_ || error_ || crcs_.size() != layout_.order.size()) return out;
  out.first = block_;
  out.second.reserve(crcs_.size());
  for (std::size_t k = 0; k < crcs_.size(); ++k)
    out.second.emplace_back(tensors_[layout_.order[k]].name, crc_parts_[k]);
  return out;
}

JobStats SaveJob::stats() {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

bool wait_jobs(const std::vector<SaveJob*>& jobs, bool persisted, double timeout_s) {
  using clock = std::chrono::steady_clock;
  const auto deadline = clock::now() + std::chrono::duration_cast<clock::duration>(
                                           std::chrono::duration<double>(std::max(timeout_s, 0.0)));
  for (SaveJob* job : jobs) {
    double left = -1.0;
    if (timeout_s >= 0) left = std::max(0.0, std::chrono::duration<double>(deadline - clock::now()).count());
    if (!(persisted ? job->wait_persisted(left) : job->wait_snapshot(left))) return false;
  }
  return true;
}

}  // namespace ds
