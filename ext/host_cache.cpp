#include "host_cache.hpp"

#include <sys/mman.h>

#include <cerrno>

#include "common.hpp"
#include "cuda.hpp"

namespace ds {

HostCache::HostCache(std::size_t bytes, std::size_t chunk_bytes, int pin_device) : chunk_bytes_(chunk_bytes) {
  if (chunk_bytes_ == 0 || chunk_bytes_ % kPage != 0)
    throw ErrorException(Error::value("chunk size must be a positive multiple of 4096 bytes"));
  num_chunks_ = bytes / chunk_bytes_;
  if (num_chunks_ < 2) throw ErrorException(Error::value("host cache must hold at least two chunks"));
  bytes_ = num_chunks_ * chunk_bytes_;
  // MAP_POPULATE: the first save must not pay the page faults of the whole cache.
  void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
  if (p == MAP_FAILED)
    throw ErrorException(Error::os(
        errno, "allocating the host cache of " + std::to_string(bytes_) + " bytes; lower host_cache_size",
        ""));
  base_ = static_cast<char*>(p);
  madvise(base_, bytes_, MADV_DONTFORK);  // a fork (data loader workers) must not copy or share the cache

  if (pin_device >= 0) {
    if (Error e = cuda::make_current(pin_device)) {
      pin_error_ = e.message;
    } else if (Error e2 =
                   cuda::check(cuda::api()->cuMemHostRegister(base_, bytes_, cuda::kHostRegisterPortable),
                               "cuMemHostRegister")) {
      pin_error_ = e2.message;
    } else {
      pinned_ = true;
    }
  }
  free_.reserve(num_chunks_);
  for (std::size_t i = num_chunks_; i-- > 0;) free_.push_back(base_ + i * chunk_bytes_);
}

HostCache::~HostCache() {
  if (pinned_) cuda::api()->cuMemHostUnregister(base_);
  if (base_) munmap(base_, bytes_);
}

char* HostCache::acquire() {
  std::unique_lock<std::mutex> lock(mu_);
  if (free_.empty()) {
    const std::uint64_t t0 = now_ns();
    cv_.wait(lock, [&] { return !free_.empty(); });
    wait_ns_ += now_ns() - t0;
  }
  char* c = free_.back();
  free_.pop_back();
  const std::size_t used = num_chunks_ - free_.size();
  if (used > high_water_) high_water_ = used;
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
  CacheStats s{num_chunks_, chunk_bytes_, num_chunks_ - free_.size(), high_water_, wait_ns_, pinned_};
  if (reset) {
    high_water_ = num_chunks_ - free_.size();
    wait_ns_ = 0;
  }
  return s;
}

}  // namespace ds
