// The engine: owns the host cache, the storage target (storage.hpp: every file a save writes or a restore
// reads goes through it), the copy threads (save), the parser threads (restore) and the flush workers, and
// drives each SaveJob through plan -> copy -> flush -> commit. Restore runs read -> verify -> scatter on the
// parser threads.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "flush.hpp"
#include "host_cache.hpp"
#include "mirror_file.hpp"
#include "restore.hpp"
#include "save_job.hpp"
#include "storage.hpp"
#include "task_pool.hpp"

namespace ds {

// The values below serve the C++ tests (tests/cpp) only: the binding takes every field from Python, where
// DataStatesConfig holds the defaults (core_setup.start_core), so the two can never disagree at run time.
struct EngineOptions {
  std::size_t cache_bytes = std::size_t{1} << 30;
  std::size_t chunk_bytes = std::size_t{64} << 20;
  std::size_t device_copy_bytes = std::size_t{4} << 20;  // largest copy from a GPU (0: a chunk's run in one)
  double device_copy_bytes_per_s = 16e9;  // the pace of copies from staged GPU buffers (0: the link's)
  int pin_device = -1;                    // CUDA ordinal whose context pins the cache; -1: do not pin
  bool huge_pages = true;          // back the cache with transparent huge pages where the kernel allows
  unsigned parser_threads = 2;     // restores
  unsigned copy_threads = 1;       // saves of GPU tensors: plan and issue the copies into the cache
  unsigned host_copy_threads = 1;  // saves of host tensors: plan and memcpy into the cache
  unsigned checksum_threads = 1;   // sum the pieces of files kept in memory only, once copied
  unsigned flush_threads = 1;
  int flush_nice = 0;         // the flush workers' threads run this many nice steps below the caller's
  unsigned flush_depth = 4;   // writes in flight per flush worker
  unsigned queue_depth = 16;  // reads in flight per parser thread on restore
  std::size_t read_bytes = std::size_t{16} << 20;
  bool map_memory_files = true;     // restores to a GPU from tmpfs go through a mapping
  bool read_direct_io = true;       // restores to a GPU read with O_DIRECT (save.direct_io: the writes)
  std::string io_backend = "auto";  // auto | io_uring | pwrite
  SaveOptions save;
};

// One file to save: where, its tensors and its metadata (`embed_checksums`: as for SaveJob).
struct SaveRequest {
  std::string path;
  std::vector<TensorSrc> tensors;
  Metadata metadata;
  bool embed_checksums = true;
  std::string mirror;   // a second copy's path (e.g. on tmpfs), the save's staging memory; empty: none
  std::string recycle;  // an earlier save's mirror file to take this one's bytes (renamed), or empty
};

class Engine final : public JobObserver {
 public:
  explicit Engine(const EngineOptions& opts);
  ~Engine() override;
  const EngineOptions& options() const { return opts_; }

  // Queues files, each job run on the engine's threads, their device copies after one event recorded now
  // on each of the callers' `streams` (once for all the files). Returns at once; queues none of them if one
  // cannot start. Throws ErrorException (Value) once closed.
  std::vector<std::shared_ptr<SaveJob>> save_many(std::vector<SaveRequest> requests,
                                                  const std::vector<std::pair<int, std::uintptr_t>>& streams);
  // save_many() of one file.
  std::shared_ptr<SaveJob> save(std::string path, std::vector<TensorSrc> tensors, Metadata metadata,
                                const std::vector<std::pair<int, std::uintptr_t>>& streams,
                                bool embed_checksums = true);

  // `fd` >= 0: the caller's open descriptor of `path` (which names it in errors), read instead of the path.
  // `page_cache`: read through the page cache even where the engine reads with O_DIRECT (a file other
  // processes of the node read too: the disk then reads it once).
  RestoreResult restore(const std::string& path, std::uint64_t data_start, std::uint64_t data_len,
                        const std::vector<RestoreSpan>& spans, bool to_device, bool verify, int fd = -1,
                        bool page_cache = false);

  // Faults in and pins the first `chunks` chunks of the cache (those handed out first) not prepared yet:
  // before returning (`wait`), or on a background thread. Otherwise a chunk is prepared when first used.
  void prepare_cache(bool wait, std::size_t chunks);

  // Creates a mirror file at each request's `path` (its tensors' data is not read: their names, dtypes and
  // shapes lay it out as a save of them would), maps, faults in and pins it before returning, and keeps it
  // mapped for a save to recycle. Throws ErrorException naming the file that cannot be made; those made
  // before it stay. Returns how many were made.
  std::size_t prepare_mirrors(const std::vector<SaveRequest>& files);

  // Keeps the mirror files of these paths mapped for later saves to recycle; unmaps the others. Returns how
  // many stay mapped.
  std::size_t keep_mirrors(const std::vector<std::string>& paths) { return mirrors_.keep_only(paths); }
  std::size_t keep_named_mirrors() { return mirrors_.keep_named(); }

  // Waits until no save or restore is in flight; false on timeout (< 0: none).
  bool wait_idle(double timeout_s);
  // Drains every save, then stops the threads. Idempotent.
  void close();

  const std::string& backend() const { return backend_; }
  const std::string& fallback_reason() const { return fallback_reason_; }
  bool pinned() const { return pinned_; }
  const std::string& pin_error() const { return pin_error_; }
  // Null once closed: close() gives the cache's memory back.
  HostCache* cache() { return cache_.get(); }
  std::size_t in_flight();

  void job_finished() override;

 private:
  // Counts a restore or cache preparation as in flight for its lifetime; throws once the engine is closing.
  struct Work {
    explicit Work(Engine* e);
    ~Work();
    Work(const Work&) = delete;
    Work& operator=(const Work&) = delete;
    Engine* engine;
  };

  void run_plan(const std::shared_ptr<SaveJob>& job);
  void run_piece(const std::shared_ptr<SaveJob>& job, std::size_t i);
  FlushWorker* next_flusher();
  TaskPool& copiers_for(const SaveJob& job);

  EngineOptions opts_;
  // The target of every file operation (engine.cpp picks it); shared with each SaveJob, which may outlive
  // the engine (a Python handle holds it).
  const std::shared_ptr<Storage> storage_;
  CopyPacer pacer_;
  std::unique_ptr<HostCache> cache_;
  MirrorFiles mirrors_;  // mirror files kept mapped after their saves
  std::string backend_;
  std::string fallback_reason_;
  bool pinned_ = false;
  std::string pin_error_;
  std::vector<std::unique_ptr<FlushWorker>> flushers_;
  std::atomic<std::size_t> rr_{0};
  TaskPool parsers_;
  TaskPool copiers_;       // saves with any GPU tensor: the copy engine moves the bytes
  TaskPool host_copiers_;  // saves of host tensors only: the threads move the bytes
  TaskPool summers_;       // the pieces of files kept in memory only, summed once copied
  TaskPool pinners_;       // fault in and pin new mirror files ahead of the copies

  std::mutex close_mu_;  // serializes close()
  std::mutex mu_;
  std::condition_variable idle_cv_;
  std::size_t in_flight_ = 0;
  bool closing_ = false;
  bool closed_ = false;
};

}  // namespace ds
