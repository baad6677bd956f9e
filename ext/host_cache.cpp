#include "host_cache.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <system_error>

#include "cuda.hpp"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14
#endif

namespace ds {

HostCache::HostCache(std::size_t bytes, std::size_t chunk_bytes, int pin_device, bool huge_pages)
    : chunk_bytes_(chunk_bytes), pin_device_(pin_device) {
  if (chunk_bytes_ == 0 || chunk_bytes_ % kPage != 0)
    throw ErrorException(Error::value("chunk size must be a positive multiple of 4096 bytes"));
  num_chunks_ = bytes / chunk_bytes_;
  if (num_chunks_ < 2) throw ErrorException(Error::value("host cache must hold at least two chunks"));
  bytes_ = num_chunks_ * chunk_bytes_;
  // Mapped on a huge-page boundary, with one huge page to spare, trimmed after.
  const std::size_t mapped = bytes_ + kHugePage;
  void* p = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED)
    throw ErrorException(Error::os(
        errno, "allocating the host cache of " + std::to_string(bytes_) + " bytes; lower host_cache_size",
        ""));
  char* raw = static_cast<char*>(p);
  base_ = reinterpret_cast<char*>((reinterpret_cast<std::uintptr_t>(raw) + kHugePage - 1) & ~(kHugePage - 1));
  if (base_ > raw) munmap(raw, static_cast<std::size_t>(base_ - raw));
  if (raw + mapped > base_ + bytes_)
    munmap(base_ + bytes_, static_cast<std::size_t>(raw + mapped - (base_ + bytes_)));
  madvise(base_, bytes_, MADV_DONTFORK);  // a fork (data loader workers) must not copy or share the cache
  // Huge pages where the kernel grants them (transparent huge pages not set to "never"): faulting in and
  // pinning then walk 512 times fewer pages.
  huge_pages_ = huge_pages && madvise(base_, bytes_, MADV_HUGEPAGE) == 0;
  prepare_once_ = std::make_unique<std::once_flag[]>(num_chunks_);
  chunk_pinned_ = std::make_unique<std::atomic<bool>[]>(num_chunks_);
  for (std::size_t i = 0; i < num_chunks_; ++i) chunk_pinned_[i].store(false);

  if (pin_device_ >= 0) {
    if (Error e = cuda::make_current(pin_device_)) {
      pin_error_ = e.message;
      pin_device_ = -1;
    }
  }
  // The first chunk decides whether pinning works, so that pinned() means something from the start.
  std::call_once(prepare_once_[0], [this] { prepare(0); });
  pinned_ = chunk_pinned_[0].load();
  if (pin_device_ >= 0 && !pinned_) pin_device_ = -1;  // pin_error_ says why; do not retry per chunk
  free_.reserve(num_chunks_);
  for (std::size_t i = num_chunks_; i-- > 0;) free_.push_back(base_ + i * chunk_bytes_);
}

void HostCache::start_background(std::size_t count) {
  std::lock_guard<std::mutex> lock(mu_);
  count = std::min(count, num_chunks_);
  if (count > target_.load()) target_.store(count);
  if (preparer_running_ || stop_.load()) return;  // a running thread reads the target at every chunk
  if (preparer_.joinable()) preparer_.join();     // it has left its loop: a larger count needs a new one
  preparer_running_ = true;
  try {
    preparer_ = std::thread([this] {
      name_this_thread("ds-cache-prep");
      for (;;) {
        const std::size_t reached = prepare_until([this] { return target_.load(); });
        std::lock_guard<std::mutex> lock(mu_);  // a target raised since is seen here, or starts a thread
        if (stop_.load() || reached >= target_.load()) {
          preparer_running_ = false;
          return;
        }
      }
    });
  } catch (const std::system_error&) {
    preparer_running_ = false;  // No thread: every chunk is then prepared by its first acquirer.
  }
}

HostCache::~HostCache() {
  stop_.store(true);
  if (preparer_.joinable()) preparer_.join();
  const cuda::Api* api = pinned_ ? cuda::api() : nullptr;
  for (std::size_t i = 0; api && i < num_chunks_; ++i)
    if (chunk_pinned_[i].load()) api->cuMemHostUnregister(base_ + i * chunk_bytes_);
  if (base_) munmap(base_, bytes_);
}

bool fault_in(char* p, std::size_t n) {
  // Now rather than in the middle of a copy; older kernels lack the advice: touch the pages.
  if (madvise(p, n, MADV_POPULATE_WRITE) == 0) return true;
  if (errno != EINVAL) return false;
  const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  for (std::size_t off = 0; off < n; off += page) p[off] = 0;
  return true;
}

Error pin(char* p, std::size_t n, int device) {
  if (Error e = cuda::make_current(device)) return e;  // per thread: the background one, or an acquirer
  return cuda::check(cuda::api()->cuMemHostRegister(p, n, cuda::kHostRegisterPortable), "cuMemHostRegister");
}

void HostCache::prepare(std::size_t i) {
  char* c = base_ + i * chunk_bytes_;
  fault_in(c, chunk_bytes_);
  if (pin_device_ >= 0) {
    Error e = pin(c, chunk_bytes_, pin_device_);
    if (!e) {
      chunk_pinned_[i].store(true);
    } else if (i == 0) {
      pin_error_ = e.message;
    }
  }
  prepared_.fetch_add(1);
}

char* HostCache::acquire() {
  char* c = nullptr;
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (free_.empty()) {
      const std::uint64_t t0 = now_ns();
      cv_.wait(lock, [&] { return !free_.empty(); });
      wait_ns_ += now_ns() - t0;
    }
    c = free_.back();
    free_.pop_back();
    const std::size_t used = num_chunks_ - free_.size();
    if (used > high_water_) high_water_ = used;
  }
  const std::size_t i = static_cast<std::size_t>(c - base_) / chunk_bytes_;
  std::call_once(prepare_once_[i], [this, i] { prepare(i); });  // waits if the background thread has it
  return c;
}

void HostCache::release(char* chunk) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(chunk);
  }
  cv_.notify_one();
}

CacheStats HostCache::stats(bool reset) {
  std::lock_guard<std::mutex> lock(mu_);
  CacheStats s{num_chunks_, chunk_bytes_, num_chunks_ - free_.size(), high_water_, wait_ns_, prepared_.load(),
               pinned_,     huge_pages_};
  if (reset) {
    high_water_ = num_chunks_ - free_.size();
    wait_ns_ = 0;
  }
  return s;
}

void HostCache::prepare_rest(std::size_t count) {
  // Alongside the background thread: each chunk is prepared once, by whoever comes first.
  count = std::min(count, num_chunks_);
  prepare_until([count] { return count; });
}

std::size_t HostCache::prepare_until(const std::function<std::size_t()>& end) {
  std::size_t i = 1;
  for (; i < end() && !stop_.load(); ++i) std::call_once(prepare_once_[i], [this, i] { prepare(i); });
  return i;
}

}  // namespace ds
