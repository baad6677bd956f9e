// One save of one file, from plan to commit. The engine drives it:
//
//   1. plan()        copy thread: layout and header; the storage target names the temporary file, makes its
//                    folders and opens it (O_DIRECT when it can), so no byte is queued before the file exists
//                    and nothing truncates later;
//   2. copy_piece()  copy threads: piece i (a chunk-sized, 4096-aligned slice of the data section) copied
//                    into a cache chunk, or into the mirror file's mapping; when every piece is copied or
//                    dropped the snapshot is done (a file kept in memory only: each piece then summed by a
//                    checksum thread, sum_in_memory());
//   3. flush         flush workers: on_io_prepare() sums the piece (CRC-32C per tensor range), the worker
//                    writes it on the target's descriptor; its chunk goes back to the cache when the write
//                    completes;
//   4. commit        after the last piece: header (with checksums) written, truncate to the exact size
//                    (O_DIRECT pads the tail), fsync, publish (rename onto the final path), fsync of the
//                    folder; persisted.
//
// Every file operation goes through the engine's Storage (storage.hpp): create, open, truncate, close,
// publish, open_folder, discard; the fsyncs and writes are IoOps on the descriptors it hands out. With a
// mirror path (a memory tier on tmpfs), the mirror file is the save's staging memory (mirror_file.hpp),
// created through the same target (Access::Mapped, an earlier save's file reused): mapped at plan, each piece
// copied into it and written to storage from it, the header copied in at commit; it is published just before
// the job counts as persisted. A mirror that cannot be had (no room) only drops the mirror: the save goes
// through cache chunks, and mirrored() says so.
//
// A mirror equal to the path keeps the file in memory only (a memory checkpoint): no storage file, each piece
// summed by a checksum thread once copied (the copy thread goes on copying), the header copied in after the
// last; the job is persisted once the mirror is renamed into place. Without the mirror there is no save: it
// fails, naming why.
//
// An error at any step is stored (the first one wins), later pieces are dropped, the temporary file is
// discarded, and both waits resolve: nothing is ever left at the final path, and earlier files are untouched.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common.hpp"
#include "copy.hpp"
#include "cuda.hpp"
#include "flush.hpp"
#include "host_cache.hpp"
#include "mirror_file.hpp"
#include "plan.hpp"
#include "storage.hpp"

namespace ds {

struct SaveOptions {
  bool direct_io = true;
  bool fsync = true;
  bool checksums = true;
  bool memory_checksums = false;  // also sum a file kept in memory only (its mirror is its path)

  // Whether a file kept in memory only is summed (on the engine's checksum threads, which run only then).
  bool sums_memory_only() const { return checksums && memory_checksums; }
};

struct JobStats {
  std::uint64_t file_bytes = 0;
  std::uint64_t tensor_bytes = 0;
  std::uint64_t t_submit_ns = 0;
  std::uint64_t t_snapshot_ns = 0;   // 0 until done
  std::uint64_t t_persisted_ns = 0;  // 0 until done
  bool direct_io = false;            // whether O_DIRECT was used for this file
  bool mirrored = false;             // whether the mirror copy was written and renamed into place
  bool mirror_kept = false;          // whether it took over a mapping kept: nothing mapped or pinned anew
  std::string mirror_refused;        // why the kept mapping of the file recycled was not taken over (empty:
                                     // none refused): its file went, a new one took the bytes
};

// Told when a job has finished (persisted or failed).
class JobObserver {
 public:
  virtual ~JobObserver() = default;
  virtual void job_finished() = 0;
};

class SaveJob final : public IoTarget, public std::enable_shared_from_this<SaveJob> {
 public:
  // `embed_checksums` false: the CRCs are computed (see checksums()) but the header holds `metadata` only,
  // for readers that reject unknown metadata keys.
  // `events`: recorded on the caller's streams at save() (its device copies wait for them), never null.
  // `storage`: the target every file operation of the save goes through (the engine's).
  SaveJob(std::shared_ptr<Storage> storage, std::string path, std::vector<TensorSrc> tensors,
          Metadata metadata, SaveOptions opts, bool embed_checksums,
          std::shared_ptr<const cuda::StreamEvents> events, HostCache* cache, JobObserver* observer,
          std::string mirror = {}, MirrorFiles* mirrors = nullptr, std::string recycle = {});
  ~SaveJob() override;

  struct Planned {
    std::size_t pieces = 0;
    IoOp* first_op = nullptr;  // the header write, when there is no data to copy
  };
  // Call once, after construction through make_shared: the job keeps itself alive until it has finished.
  void start() { self_ = shared_from_this(); }
  Planned plan();

  bool failed() const { return failed_.load(std::memory_order_acquire); }
  // Whether any tensor lies in GPU memory (its copies are the copy engine's, not the calling thread's).
  bool on_device() const { return on_device_; }
  // Where piece i is to be copied when the mirror file is the staging memory (faulted in and pinned); null:
  // into a cache chunk.
  char* mirror_piece(std::size_t i);
  // Copies piece i into `chunk` (a cache chunk, or mirror_piece(i)); returns its write op, or nullptr: after
  // a failure (a cache chunk released, counted), or for a file kept in memory only, whose piece is captured
  // then and, where `*to_sum` says so, summed by sum_in_memory(i, chunk) on another thread.
  IoOp* copy_piece(std::size_t i, char* chunk, PieceCopier& copier, bool* to_sum);
  // Sums piece i of a file kept in memory only, copied into `chunk` (its place in the mapping): the piece is
  // then done.
  void sum_in_memory(std::size_t i, const char* chunk);
  // A piece not copied because the job had failed already.
  void skip_piece(std::size_t i);

  const std::unordered_map<int, cuda::CUevent>* events() const { return &events_->events(); }

  void on_io_prepare(IoOp& op) override;
  // Whether the file is kept in its mirror only (the mirror path is the path).
  bool memory_only() const { return memory_only_; }
  bool summed() const { return opts_.checksums; }  // whether its tensors are summed (once persisted)
  IoOp* on_io_complete(IoOp& op, int err) override;

  // Waits: false on timeout (< 0: no timeout). Call without the GIL.
  bool wait_snapshot(double timeout_s);
  bool wait_persisted(double timeout_s);
  bool snapshot_done();
  bool persisted_done();
  Error error();
  JobStats stats();
  // Tensor name and CRC-32C, in file order, once persisted (empty before, or without checksums).
  std::vector<std::pair<std::string, std::uint32_t>> checksums();
  // The block size and, per tensor in file order, its name and its block segments' CRC-32C, once persisted
  // (block size 0 before, or without checksums): what a file without them in its header is read by in part.
  std::pair<std::size_t, std::vector<std::pair<std::string, std::vector<std::uint32_t>>>> block_checksums();
  const std::string& path() const { return path_; }
  // Why the mirror copy was dropped (empty: written, or none asked for).
  std::string mirror_error();

 private:
  // 1. plan
  bool plan_file();
  bool open_temporary();
  // 2. copy
  // File-order position of the first tensor that ends after data offset `lo` (the first in a piece).
  std::size_t first_ending_after(std::size_t lo) const;
  void piece_captured();
  // 3. flush
  IoOp* piece_written(IoOp& op, int err);
  IoOp* piece_finished();
  // 4. commit
  void sum_piece(std::size_t i, const char* buf);
  void combine_checksums();
  bool prepare_header();
  IoOp* header_op();
  IoOp* commit_in_memory();
  IoOp* header_written(int err);
  IoOp* data_synced(int err);
  IoOp* rename_into_place();
  IoOp* directory_synced(int err);
  void abort_commit();
  void finish();
  void fail(Error e);
  // the mirror copy (save_mirror.cpp)
  void open_mirror();
  void mirror_fail(const Error& e);
  void close_mirror(bool commit);
  void release(char* buf);  // a cache chunk back; nothing for the mirror's mapping

  const std::shared_ptr<Storage> storage_;
  const std::string path_;
  const std::string mirror_;
  const std::string recycle_;  // a mirror file of an earlier save to take the new bytes, or empty
  const bool memory_only_;     // the mirror is the file: nothing goes to storage
  MirrorFiles* const mirrors_;
  StorageFile mirror_file_;          // its descriptor handed on to map_ once mapped
  std::shared_ptr<MirrorFile> map_;  // set at plan when the mirror is the staging memory, then fixed
  // The kept mapping of `recycle_`, taken when the job is made (on the caller's thread): a later
  // keep_only() on another thread, which no longer lists the file once it is renamed, cannot drop it.
  std::shared_ptr<MirrorFile> recycled_;
  std::string mirror_error_;  // guarded by mu_
  int mirror_errno_ = 0;      // its OS error, if any; guarded by mu_
  StorageFile file_;          // the storage file: its temporary, folder and descriptors
  std::vector<TensorSrc> tensors_;
  bool on_device_ = false;
  Metadata metadata_;
  const SaveOptions opts_;
  const bool embed_checksums_;
  HostCache* const cache_;
  JobObserver* const observer_;

  Layout layout_;
  std::size_t chunk_ = 0;
  std::size_t block_ = 0;  // the block segments' grid (divides chunk_)
  std::size_t data_bytes_ = 0;
  std::size_t npieces_ = 0;
  const std::shared_ptr<const cuda::StreamEvents> events_;

  std::vector<IoOp> piece_ops_;
  IoOp header_op_, fsync_op_, dirsync_op_;
  char* header_buf_ = nullptr;
  // Per tensor, in file order: CRC of each of its block segments (filled by flush workers).
  std::vector<std::vector<std::uint32_t>> crc_parts_;

  std::atomic<std::size_t> to_capture_{0};
  std::atomic<std::size_t> to_write_{0};
  std::atomic<bool> failed_{false};

  std::mutex mu_;
  std::condition_variable cv_;
  Error error_;
  bool snapshot_ = false;
  bool persisted_ = false;
  JobStats stats_;
  std::vector<std::uint32_t> crcs_;  // file order, set with the header
  std::shared_ptr<SaveJob> self_;    // dropped as the last act of finish()
};

// Waits for every job's snapshot (or persistence): false once `timeout_s` (< 0: none) has passed for all of
// them together. One call for many jobs, so that a Python caller gives up and takes the GIL back once.
bool wait_jobs(const std::vector<SaveJob*>& jobs, bool persisted, double timeout_s);

}  // namespace ds
