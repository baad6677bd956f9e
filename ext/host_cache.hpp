// The host cache: one arena allocated once, cut into fixed-size chunks kept on a free list. No ring and no
// wrap-around: a chunk is either free or owned by exactly one piece of one file until its write completes.
// A caller that finds no free chunk waits (backpressure); nothing is ever too large, it just takes turns.
//
// Faulting in and page-locking a cache of many GiB takes seconds (about 0.25-0.4 s per GiB to pin with 4 KiB
// pages; the arena asks for huge pages) and holds the CUDA driver's locks, stalling the training thread's
// CUDA calls meanwhile. So a chunk is prepared (faulted in, then pinned) by the first thread that acquires
// it, and the free list is a stack, so the same few chunks go round: a restore pins a handful, and saves pin
// no more of the cache than a checkpoint's bytes in flight, however large the cache. start_background()
// prepares the first ones, on request only.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common.hpp"

namespace ds {

struct CacheStats {
  std::size_t chunks = 0;
  std::size_t chunk_bytes = 0;
  std::size_t in_use = 0;
  std::size_t high_water = 0;  // most chunks in use at once since the last reset
  std::uint64_t wait_ns = 0;   // time callers spent waiting for a free chunk since the last reset
  std::size_t prepared = 0;    // chunks faulted in (and pinned when pinning) so far
  bool pinned = false;
  bool huge_pages = false;  // the arena asked for transparent huge pages, and the kernel took the advice
};

// Faults in [p, p + n) for writing (p page-aligned); false where the kernel could not supply the pages.
bool fault_in(char* p, std::size_t n);
// Page-locks [p, p + n) for DMA, through `device`'s context made current on this thread.
Error pin(char* p, std::size_t n, int device);

class HostCache {
 public:
  // Maps `bytes` (at least two chunks' worth). When `pin_device` >= 0 and a CUDA driver is present, chunks
  // are page-locked for DMA; a failure to pin is not fatal and is reported by pin_error(). `huge_pages`: ask
  // for transparent huge pages (the kernel may refuse: stats().huge_pages says whether it took the advice).
  // Returns once the first chunk is ready; the others are prepared on first use or by start_background() /
  // prepare_rest().
  HostCache(std::size_t bytes, std::size_t chunk_bytes, int pin_device, bool huge_pages = true);
  ~HostCache();
  HostCache(const HostCache&) = delete;
  HostCache& operator=(const HostCache&) = delete;

  // Blocks until a chunk is free; returns it prepared. Thread-safe.
  char* acquire();
  void release(char* chunk);

  std::size_t chunk_bytes() const { return chunk_bytes_; }
  std::size_t num_chunks() const { return num_chunks_; }
  // Whether chunks are page-locked (decided by the first chunk; a later chunk that fails stays pageable).
  bool pinned() const { return pinned_; }
  const std::string& pin_error() const { return pin_error_; }
  // The CUDA ordinal whose context pins the chunks; -1 where they are not pinned.
  int pin_device() const { return pinned_ ? pin_device_ : -1; }
  CacheStats stats(bool reset);
  // Starts preparing chunks [0, count) (those acquired first) on a background thread; count is capped at the
  // number of chunks. Repeatable: a larger count extends the work of the running thread, or starts another
  // once it has finished.
  void start_background(std::size_t count);
  // Prepares chunks [0, count) not prepared yet, on this thread too; returns when all are.
  void prepare_rest(std::size_t count);

 private:
  void prepare(std::size_t i);
  // Prepares chunks [1, end()) not prepared yet; end() is read at every chunk (the target may grow).
  // Returns the end it reached.
  std::size_t prepare_until(const std::function<std::size_t()>& end);

  static constexpr std::size_t kHugePage = std::size_t{2} << 20;

  char* base_ = nullptr;
  std::size_t bytes_ = 0;
  std::size_t chunk_bytes_ = 0;
  std::size_t num_chunks_ = 0;
  int pin_device_ = -1;
  bool pinned_ = false;
  bool huge_pages_ = false;
  std::string pin_error_;

  std::unique_ptr<std::once_flag[]> prepare_once_;
  std::unique_ptr<std::atomic<bool>[]> chunk_pinned_;
  std::atomic<std::size_t> prepared_{0};
  std::atomic<bool> stop_{false};
  std::thread preparer_;
  bool preparer_running_ = false;       // guarded by mu_
  std::atomic<std::size_t> target_{0};  // the background thread prepares chunks [1, target_)

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<char*> free_;  // LIFO: the most recently released chunk is still warm in the TLB
  std::size_t high_water_ = 0;
  std::uint64_t wait_ns_ = 0;
};

}  // namespace ds
