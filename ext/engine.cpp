#include "engine.hpp"

#include <algorithm>
#include <thread>

namespace ds {

namespace {

// Only a file kept in memory only is summed on these threads, and only where asked (`memory_checksums`):
// otherwise none is started. The same rule decides whether such a file's pieces come to them.
unsigned summer_count(const EngineOptions& opts) {
  return opts.save.sums_memory_only() ? std::max(1u, opts.checksum_threads) : 0;
}

}  // namespace

Engine::Engine(const EngineOptions& opts)
    : opts_(opts),
      storage_(posix_storage()),
      pacer_(opts.device_copy_bytes_per_s),
      cache_(
          std::make_unique<HostCache>(opts.cache_bytes, opts.chunk_bytes, opts.pin_device, opts.huge_pages)),
      parsers_(opts.parser_threads, "ds-parse"),
      copiers_(opts.copy_threads, "ds-copy"),
      host_copiers_(opts.host_copy_threads, "ds-copy-host"),
      summers_(summer_count(opts), "ds-sum", opts.flush_nice),
      pinners_(std::max(1u, std::min(4u, std::thread::hardware_concurrency() / 2)), "ds-pin") {
  mirrors_.set_pool(&pinners_);
  pinned_ = cache_->pinned();
  pin_error_ = cache_->pin_error();
  if (opts_.io_backend != "pwrite") {
    for (unsigned i = 0; i < opts_.flush_threads; ++i) {
      std::string why;
      auto w = make_uring_worker(opts_.flush_depth, opts_.flush_nice, &why);
      if (!w) {
        flushers_.clear();
        if (opts_.io_backend == "io_uring") {
          parsers_.stop();
          copiers_.stop();
          host_copiers_.stop();
          summers_.stop();
          pinners_.stop();
          throw ErrorException(Error::value("io_backend='io_uring' but io_uring is refused here: " + why));
        }
        fallback_reason_ = why;
        break;
      }
      flushers_.push_back(std::move(w));
    }
  }
  if (flushers_.empty()) {
    // One pool, as many threads as the io_uring workers would keep writes in flight (bounded).
    flushers_.push_back(make_pwrite_worker(
        std::min(16u, opts_.flush_threads * std::max(1u, opts_.flush_depth / 2)), opts_.flush_nice));
    backend_ = "pwrite";
  } else {
    backend_ = "io_uring";
  }
}

Engine::~Engine() {
  close();
}

std::vector<std::shared_ptr<SaveJob>> Engine::save_many(
    std::vector<SaveRequest> requests, const std::vector<std::pair<int, std::uintptr_t>>& streams) {
  {
    // Counted in flight before touching the cache: a concurrent close() waits instead of freeing it.
    std::lock_guard<std::mutex> lock(mu_);
    if (closing_) throw ErrorException(Error::value("the engine is closed; create a new DataStatesEngine"));
    in_flight_ += requests.size();
  }
  std::vector<std::shared_ptr<SaveJob>> jobs;
  Error e;
  try {
    auto events = std::make_shared<cuda::StreamEvents>();
    e = events->record(streams);
    jobs.reserve(requests.size());
    for (std::size_t i = 0; i < requests.size() && !e; ++i) {
      SaveRequest& r = requests[i];
      jobs.push_back(std::make_shared<SaveJob>(storage_, std::move(r.path), std::move(r.tensors),
                                               std::move(r.metadata), opts_.save, r.embed_checksums, events,
                                               cache_.get(), this, std::move(r.mirror), &mirrors_,
                                               std::move(r.recycle)));
    }
  } catch (const std::bad_alloc&) {
    e = Error::internal("out of memory queuing a save");
  }
  if (e) {
    for (std::size_t i = 0; i < requests.size(); ++i) job_finished();  // none started: nothing else will
    throw ErrorException(e);
  }
  for (const auto& job : jobs) {
    job->start();
    copiers_for(*job).submit([this, job] { run_plan(job); });
  }
  return jobs;
}

std::shared_ptr<SaveJob> Engine::save(std::string path, std::vector<TensorSrc> tensors, Metadata metadata,
                                      const std::vector<std::pair<int, std::uintptr_t>>& streams,
                                      bool embed_checksums) {
  std::vector<SaveRequest> one;
  one.push_back({std::move(path), std::move(tensors), std::move(metadata), embed_checksums, {}, {}});
  return save_many(std::move(one), streams).front();
}

void Engine::run_plan(const std::shared_ptr<SaveJob>& job) {
  const SaveJob::Planned p = job->plan();
  if (p.first_op) next_flusher()->submit(p.first_op);
  TaskPool& pool = copiers_for(*job);
  for (std::size_t i = 0; i < p.pieces; ++i) pool.submit([this, job, i] { run_piece(job, i); });
}

TaskPool& Engine::copiers_for(const SaveJob& job) {
  return job.on_device() ? copiers_ : host_copiers_;
}

void Engine::run_piece(const std::shared_ptr<SaveJob>& job, std::size_t i) {
  if (job->failed()) {
    job->skip_piece(i);
    return;
  }
  char* chunk = job->mirror_piece(i);     // the mirror file is the staging memory, or
  if (!chunk) chunk = cache_->acquire();  // a cache chunk: backpressure, waits for a flush to give one back
  // Paced: a checkpoint to storage, whose flush is slower than the link anyway. A file kept in memory only
  // is copied at the link's speed: how often such checkpoints can be taken depends on it.
  PieceCopier copier(job->events(), opts_.device_copy_bytes, job->memory_only() ? nullptr : &pacer_);
  bool to_sum = false;
  if (IoOp* op = job->copy_piece(i, chunk, copier, &to_sum)) {
    next_flusher()->submit(op);
  } else if (to_sum) {  // summed on other threads: this one goes on to the next piece's copies
    summers_.submit([job, i, chunk] { job->sum_in_memory(i, chunk); });
  }
}

FlushWorker* Engine::next_flusher() {
  return flushers_[rr_.fetch_add(1, std::memory_order_relaxed) % flushers_.size()].get();
}

RestoreResult Engine::restore(const std::string& path, std::uint64_t data_start, std::uint64_t data_len,
                              const std::vector<RestoreSpan>& spans, bool to_device, bool verify, int fd,
                              bool page_cache) {
  const Work work(this);  // close() waits for restores too
  RestoreOptions ro;
  ro.use_uring = backend_ == "io_uring";
  ro.direct_io = opts_.read_direct_io && !page_cache;
  ro.depth = opts_.queue_depth;
  ro.read_bytes = opts_.read_bytes;
  ro.map_memory_files = opts_.map_memory_files;
  ro.verify = verify;
  return restore_file(path, data_start, data_len, spans, to_device, ro, parsers_, *cache_, *storage_, fd);
}

void Engine::prepare_cache(bool wait, std::size_t chunks) {
  const Work work(this);  // close() must not free the cache under us
  if (wait) {
    cache_->prepare_rest(chunks);
  } else {
    cache_->start_background(chunks);
  }
}

Engine::Work::Work(Engine* e) : engine(e) {
  std::lock_guard<std::mutex> lock(e->mu_);
  if (e->closing_) throw ErrorException(Error::value("the engine is closed; create a new DataStatesEngine"));
  ++e->in_flight_;
}

Engine::Work::~Work() {
  engine->job_finished();
}

void Engine::job_finished() {
  std::lock_guard<std::mutex> lock(mu_);
  if (--in_flight_ == 0) idle_cv_.notify_all();  // under the lock: close() cannot return before we are done
}

std::size_t Engine::in_flight() {
  std::lock_guard<std::mutex> lock(mu_);
  return in_flight_;
}

bool Engine::wait_idle(double timeout_s) {
  std::unique_lock<std::mutex> lock(mu_);
  auto idle = [&] { return in_flight_ == 0; };
  if (timeout_s < 0) {
    idle_cv_.wait(lock, idle);
    return true;
  }
  return idle_cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), idle);
}

void Engine::close() {
  std::lock_guard<std::mutex> serial(close_mu_);  // a second close waits for the first one's drain
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return;
    closing_ = true;
  }
  wait_idle(-1);
  copiers_.stop();
  host_copiers_.stop();
  summers_.stop();  // after the copiers, which hand it pieces
  parsers_.stop();
  for (auto& f : flushers_) f->stop();
  pinners_.stop();
  mirrors_.clear();
  cache_.reset();  // unpins and unmaps: a closed engine holds no memory
  std::lock_guard<std::mutex> lock(mu_);
  closed_ = true;
}

}  // namespace ds
