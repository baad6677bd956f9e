#include "copy.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

namespace ds {
namespace {

// A thread's streams and events, destroyed when it exits: restores also run on the callers' threads, which
// come and go (errors are ignored: at process exit the driver may be gone first).
struct ThreadStreams {
  std::unordered_map<int, cuda::CUstream> streams;
  std::unordered_map<int, cuda::CUevent> events;  // by device * kEventSlots + slot
  ~ThreadStreams() {
    const cuda::Api* a = cuda::api();
    if (!a) return;
    for (auto& [device, s] : streams) a->cuStreamDestroy(s);
    for (auto& [device, ev] : events) a->cuEventDestroy(ev);
  }
};
thread_local ThreadStreams t_streams;

// One non-blocking stream per device per thread, created on first use; each copy thread copies on its own
// stream so several chunks are in flight on the copy engines at once.
cuda::CUstream thread_stream(int device, Error* err) {
  auto& streams = t_streams.streams;
  auto it = streams.find(device);
  if (it != streams.end()) return it->second;
  cuda::CUstream s = nullptr;
  *err = cuda::check(cuda::api()->cuStreamCreate(&s, cuda::kStreamNonBlocking), "cuStreamCreate");
  if (*err) return nullptr;
  streams.emplace(device, s);
  return s;
}

// This thread's event `slot` for `device`, to wait for its stream with: a blocking-sync event puts the
// waiting thread to sleep, where cuStreamSynchronize would spin and contend with the training thread for the
// driver while the copies overlap the next forward and backward passes. Slot 0 is the copiers' InFlight's;
// an uploader takes 1 + its own slot; a PieceCopier's copies in flight take the slots from kCopySlot on.
constexpr int kCopySlot = 1 + DeviceUploader::kSlots;
constexpr int kEventSlots = kCopySlot + PieceCopier::kCopiesInFlight;
cuda::CUevent thread_event(int device, int slot, Error* err) {
  auto& events = t_streams.events;
  const int key = device * kEventSlots + slot;
  auto it = events.find(key);
  if (it != events.end()) return it->second;
  cuda::CUevent ev = nullptr;
  *err = cuda::check(cuda::api()->cuEventCreate(&ev, cuda::kEventBlockingSync | cuda::kEventDisableTiming),
                     "cuEventCreate");
  if (*err) return nullptr;
  events.emplace(key, ev);
  return ev;
}

}  // namespace

void gather_host(const TensorSrc& t, std::size_t begin, std::size_t end, char* dst) {
  if (t.contiguous) {
    std::memcpy(dst, t.data + begin, end - begin);
    return;
  }
  const std::size_t isz = t.itemsize;
  const std::size_t nd = t.shape.size();
  std::vector<std::int64_t> idx(nd, 0);
  std::int64_t rem = static_cast<std::int64_t>(begin / isz);
  for (std::size_t d = nd; d-- > 0;) {
    idx[d] = rem % t.shape[d];
    rem /= t.shape[d];
  }
  std::size_t skip = begin % isz;  // the range may start inside an element
  std::size_t left = end - begin;
  const bool inner_contig = nd > 0 && t.strides[nd - 1] == 1;
  while (left > 0) {
    std::int64_t off = 0;
    for (std::size_t d = 0; d < nd; ++d) off += idx[d] * t.strides[d];
    const std::int64_t run = inner_contig ? t.shape[nd - 1] - idx[nd - 1] : 1;
    const std::size_t take = std::min(static_cast<std::size_t>(run) * isz - skip, left);
    std::memcpy(dst, t.data + off * static_cast<std::int64_t>(isz) + skip, take);
    dst += take;
    left -= take;
    skip = 0;
    if (nd == 0) break;
    idx[nd - 1] += run;
    for (std::size_t d = nd - 1; d > 0 && idx[d] >= t.shape[d]; --d) {
      idx[d] = 0;
      ++idx[d - 1];
    }
  }
}

Error InFlight::stream(int device, cuda::CUstream* s, bool* fresh) {
  if (Error e = cuda::make_current(device)) return e;
  Error err;
  *s = thread_stream(device, &err);
  if (err) return err;
  *fresh = std::none_of(pending_.begin(), pending_.end(), [&](auto& p) { return p.first == device; });
  if (*fresh) pending_.emplace_back(device, *s);
  return {};
}

Error InFlight::mark() {
  Error first;
  for (auto& [device, s] : pending_) {
    Error e = cuda::make_current(device);
    cuda::CUevent ev = e ? nullptr : thread_event(device, slot_, &e);
    if (!e) e = cuda::check(cuda::api()->cuEventRecord(ev, s), "cuEventRecord");
    if (!e && std::none_of(marked_.begin(), marked_.end(), [&](auto& m) { return m.first == device; }))
      marked_.emplace_back(device, ev);
    if (e) {
      cuda::api()->cuStreamSynchronize(s);  // nothing to wait on later: the memory must not be reused early
      if (!first) first = e;
    }
  }
  pending_.clear();
  return first;
}

Error InFlight::wait() {
  Error first;
  for (auto& [device, ev] : marked_) {
    Error e = cuda::make_current(device);
    if (!e) e = cuda::check(cuda::api()->cuEventSynchronize(ev), "cuEventSynchronize");
    if (e && !first) first = e;
  }
  marked_.clear();
  return first;
}

Error PieceCopier::copy(const TensorSrc& t, std::size_t begin, std::size_t end, char* dst) {
  if (end <= begin) return {};
  if (t.device < 0) {
    gather_host(t, begin, end, dst);
    return {};
  }
  if (!t.contiguous) return Error::internal("non-contiguous CUDA tensor reached the copy stage: " + t.name);
  const char* src = t.data + begin;
  if (run_.len && t.buffer >= 0 && run_.buffer == t.buffer && run_.device == t.device &&
      run_.src + run_.len == src && run_.dst + run_.len == dst) {
    run_.len += end - begin;
    return {};
  }
  if (Error e = issue()) return e;
  run_ = {t.device, t.buffer, src, dst, end - begin};
  return {};
}

Error PieceCopier::finish() {
  Error err = issue();
  if (Error e = in_flight_.sync(); e && !err) err = e;
  return err;
}

Error PieceCopier::issue() {
  if (run_.len == 0) return {};
  const Run r = run_;
  run_.len = 0;
  cuda::CUstream s = nullptr;
  bool fresh = false;
  if (Error e = in_flight_.stream(r.device, &s, &fresh)) return e;
  const cuda::Api* a = cuda::api();
  if (fresh) {
    // Order this stream after everything the caller had queued when it called save().
    const auto ev =
        events_ ? events_->find(r.device) : std::unordered_map<int, cuda::CUevent>::const_iterator{};
    if (!events_ || ev == events_->end())
      return Error::internal("no CUDA event recorded for device " + std::to_string(r.device));
    if (Error e = cuda::check(a->cuStreamWaitEvent(s, ev->second, 0), "cuStreamWaitEvent")) return e;
  }
  const std::size_t step = max_copy_ ? max_copy_ : r.len;
  for (std::size_t done = 0; done < r.len; done += step) {
    const std::size_t n = std::min(step, r.len - done);
    if (pacer_ && r.buffer >= 0) pacer_->pace(n);
    if (max_copy_) {
      if (Error e = throttle(r.device)) return e;
    }
    const auto src = reinterpret_cast<cuda::CUdeviceptr>(r.src + done);
    if (Error e = cuda::check(a->cuMemcpyDtoHAsync(r.dst + done, src, n, s), "cuMemcpyDtoHAsync")) return e;
    if (max_copy_) {
      if (Error e = mark_copy(r.device, s)) return e;
    }
  }
  return {};
}

void CopyPacer::pace(std::size_t n) {
  if (ns_per_byte_ <= 0) return;
  const std::uint64_t now = now_ns();
  const auto cost = static_cast<std::uint64_t>(static_cast<double>(n) * ns_per_byte_);
  std::uint64_t next = next_ns_.load(std::memory_order_relaxed), start = 0;
  do {
    start = std::max(next, now);
  } while (!next_ns_.compare_exchange_weak(next, start + cost, std::memory_order_relaxed));
  if (start > now) std::this_thread::sleep_for(std::chrono::nanoseconds(start - now));
}

Error PieceCopier::throttle(int device) {
  if (device != copies_device_) {  // another device's events: none of this one's is recorded yet
    copies_device_ = device;
    copies_ = 0;
  }
  if (copies_ < kCopiesInFlight) return {};
  Error err;
  cuda::CUevent ev = thread_event(device, kCopySlot + static_cast<int>(copies_ % kCopiesInFlight), &err);
  if (err) return err;
  return cuda::check(cuda::api()->cuEventSynchronize(ev), "cuEventSynchronize");
}

Error PieceCopier::mark_copy(int device, cuda::CUstream s) {
  Error err;
  cuda::CUevent ev = thread_event(device, kCopySlot + static_cast<int>(copies_ % kCopiesInFlight), &err);
  if (err) return err;
  if (Error e = cuda::check(cuda::api()->cuEventRecord(ev, s), "cuEventRecord")) return e;
  ++copies_;
  return {};
}

Error DeviceUploader::copy(int device, char* dst_device, const char* src, std::size_t n) {
  cuda::CUstream s = nullptr;
  bool fresh = false;
  if (Error e = in_flight_.stream(device, &s, &fresh)) return e;
  return cuda::check(
      cuda::api()->cuMemcpyHtoDAsync(reinterpret_cast<cuda::CUdeviceptr>(dst_device), src, n, s),
      "cuMemcpyHtoDAsync");
}

void stream_copy(void* dst, const void* src, std::size_t n) {
  auto* d = static_cast<unsigned char*>(dst);
  const auto* s = static_cast<const unsigned char*>(src);
#if defined(__x86_64__)
  if (n >= 4096) {
    const std::size_t head = (16 - reinterpret_cast<std::uintptr_t>(d) % 16) % 16;  // to an aligned dst
    std::memcpy(d, s, head);
    std::size_t i = head;
    for (; i + 64 <= n; i += 64) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
      const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
    }
    std::memcpy(d + i, s + i, n - i);
    _mm_sfence();  // the streamed stores are visible before anyone (a DMA engine) reads dst
    return;
  }
#endif
  std::memcpy(d, s, n);
}

}  // namespace ds
