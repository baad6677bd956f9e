// One save of one file, its stages in the order they run (save_job.hpp draws the whole life):
//   1. plan     plan(): layout and header, checksum bookkeeping, the temporary file opened (storage.hpp);
//   2. copy     copy_piece(): each piece into a cache chunk (or the mirror's mapping); the last one captured
//               completes the snapshot;
//   3. flush    on_io_prepare() sums a piece as a worker writes it; piece_written() gives its chunk back;
//   4. commit   after the last piece: header_op() (checksums combined into the header), header_written()
//               (exact size), data_synced() (rename into place), directory_synced(), finish().
// The commit's file operations are save_commit.cpp's, the mirror copy save_mirror.cpp's, the waits and
// results the bindings read save_results.cpp's.
#include "save_job.hpp"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <numeric>

#include "crc32c.hpp"

namespace ds {

namespace {

// A file kept in memory only is summed where asked: the sums read every byte back from host memory beside
// training, and the copy lives where the live state it copies does (the node's memory, a private file).
SaveOptions in_memory_only(SaveOptions opts) {
  opts.checksums = opts.sums_memory_only();
  return opts;
}

}  // namespace

SaveJob::SaveJob(std::shared_ptr<Storage> storage, std::string path, std::vector<TensorSrc> tensors,
                 Metadata metadata, SaveOptions opts, bool embed_checksums,
                 std::shared_ptr<const cuda::StreamEvents> events, HostCache* cache, JobObserver* observer,
                 std::string mirror, MirrorFiles* mirrors, std::string recycle)
    : storage_(std::move(storage)),
      path_(std::move(path)),
      mirror_(std::move(mirror)),
      recycle_(std::move(recycle)),
      memory_only_(!mirror_.empty() && mirror_ == path_),
      mirrors_(mirrors),
      tensors_(std::move(tensors)),
      metadata_(std::move(metadata)),
      opts_(memory_only_ ? in_memory_only(opts) : opts),
      embed_checksums_(embed_checksums),
      cache_(cache),
      observer_(observer),
      events_(std::move(events)) {
  stats_.t_submit_ns = now_ns();
  if (mirrors_ && !mirror_.empty() && !recycle_.empty()) recycled_ = mirrors_->take(recycle_);
  for (const TensorSrc& t : tensors_) on_device_ = on_device_ || t.device >= 0;
}

SaveJob::~SaveJob() {
  std::free(header_buf_);
  storage_->close(file_);
  storage_->close(mirror_file_);
}

// -- 1. plan ------------------------------------------------------------------------------------------------

SaveJob::Planned SaveJob::plan() {
  Planned out;
  if (!plan_file() || (!memory_only_ && !open_temporary())) {
    if (recycled_) mirrors_->put(recycle_, std::move(recycled_));  // its file untouched: kept as it was
    finish();
    return out;
  }
  if (!mirror_.empty()) open_mirror();
  if (memory_only_ && !map_) {  // no memory, no file: the save fails
    int err = 0;
    std::string why;
    {
      std::lock_guard<std::mutex> lock(mu_);
      err = mirror_errno_ ? mirror_errno_ : ENOMEM;
      why = mirror_error_;
    }
    fail(Error::os(err, "kept in memory only, and its memory could not be had: " + why, path_));
    finish();
    return out;
  }
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
    out.first_op = memory_only_ ? commit_in_memory() : header_op();
    if (!out.first_op && !memory_only_) abort_commit();
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
  if (int e = storage_->create(path_, &file_)) {
    fail(Error::os(e, "creating the directory " + file_.folder, path_));
    return false;
  }
  if (int e = storage_->open(file_, opts_.direct_io ? Access::Direct : Access::Buffered)) {
    fail(Error::os(e, "creating the temporary file " + file_.temp, path_));
    return false;
  }
  std::lock_guard<std::mutex> lock(mu_);
  stats_.direct_io = file_.direct;
  return true;
}

// -- 2. copy ------------------------------------------------------------------------------------------------

IoOp* SaveJob::copy_piece(std::size_t i, char* chunk, PieceCopier& copier, bool* to_sum) {
  *to_sum = false;
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
  if (memory_only_) {  // nothing to write: captured now, summed in the mapping by a checksum thread
    piece_captured();
    *to_sum = opts_.checksums;
    return *to_sum ? nullptr : piece_finished();
  }
  std::size_t len = hi - lo;
  if (file_.direct) {  // O_DIRECT writes whole blocks: zero the tail padding, ftruncate removes it at commit
    const std::size_t padded = align_up(len, kPage);
    std::memset(chunk + len, 0, padded - len);
    len = padded;
  }
  IoOp& op = piece_ops_[i];
  op.kind = IoOp::Kind::Write;
  op.fd = file_.fd;
  op.buf = chunk;
  op.len = len;
  op.offset = layout_.data_start + lo;
  op.target = this;
  op.tag = i;
  piece_captured();
  return &op;
}

void SaveJob::sum_in_memory(std::size_t i, const char* chunk) {
  if (!failed()) sum_piece(i, chunk);
  piece_finished();
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
  if (&op == &header_op_ || op.kind != IoOp::Kind::Write) return;
  sum_piece(op.tag, op.buf);
}

// Sums each block segment of piece i (at `buf`); pieces are summed on different threads, combined at commit.
void SaveJob::sum_piece(std::size_t i, const char* buf) {
  if (!opts_.checksums) return;
  const std::size_t lo = i * chunk_, hi = std::min(lo + chunk_, data_bytes_);
  const auto& order = layout_.order;
  for (std::size_t k = first_ending_after(lo); k < order.size() && layout_.offset[order[k]] < hi; ++k) {
    const std::size_t off = layout_.offset[order[k]], n = tensors_[order[k]].nbytes;
    const std::size_t e = std::min(hi, off + n);
    for (std::size_t b = std::max(lo, off), next; b < e; b = next) {
      next = std::min(e, (b / block_ + 1) * block_);
      crc_parts_[k][b / block_ - off / block_] = crc32c(0, buf + (b - lo), next - b);
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
                       " of " + file_.temp,
                   path_));
  return piece_finished();
}

IoOp* SaveJob::piece_finished() {
  if (to_write_.fetch_sub(1, std::memory_order_acq_rel) != 1) return nullptr;
  if (failed()) {
    abort_commit();
    return nullptr;
  }
  if (memory_only_) return commit_in_memory();
  IoOp* op = header_op();
  if (!op) abort_commit();
  return op;
}

}  // namespace ds
