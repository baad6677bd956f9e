// The host cache: one arena allocated once, cut into fixed-size chunks kept on a free list. No ring and no
// wrap-around: a chunk is either free or owned by exactly one piece of one file until its write completes.
// A caller that finds no free chunk waits (backpressure); nothing is ever too large, it just takes turns.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace ds {

struct CacheStats {
  std::size_t chunks = 0;
  std::size_t chunk_bytes = 0;
  std::size_t in_use = 0;
  std::size_t high_water = 0;  // most chunks in use at once since the last reset
  std::uint64_t wait_ns = 0;   // time callers spent waiting for a free chunk since the last reset
  bool pinned = false;
};

class HostCache {
 public:
  // Maps `bytes` (at least two chunks' worth) and faults it in. When `pin_device` >= 0 and a CUDA driver is
  // present, page-locks it for DMA; a failure to pin is not fatal and is reported by pin_error().
  HostCache(std::size_t bytes, std::size_t chunk_bytes, int pin_device);
  ~HostCache();
  HostCache(const HostCache&) = delete;
  HostCache& operator=(const HostCache&) = delete;

  // Blocks until a chunk is free. Thread-safe.
  char* acquire();
  void release(char* chunk);

  std::size_t chunk_bytes() const { return chunk_bytes_; }
  std::size_t num_chunks() const { return num_chunks_; }
  bool pinned() const { return pinned_; }
  const std::string& pin_error() const { return pin_error_; }
  CacheStats stats(bool reset);

 private:
  char* base_ = nullptr;
  std::size_t bytes_ = 0;
  std::size_t chunk_bytes_ = 0;
  std::size_t num_chunks_ = 0;
  bool pinned_ = false;
  std::string pin_error_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<char*> free_;  // LIFO: the most recently released chunk is still warm in the TLB
  std::size_t high_water_ = 0;
  std::uint64_t wait_ns_ = 0;
};

}  // namespace ds
