// Stage 2 of a save: copy tensor bytes into a chunk of the host cache.
//
// Host tensors are copied by the calling copy thread (memcpy, or a strided gather for non-contiguous
// views, so nothing is copied on the caller's thread). CUDA tensors are copied device-to-host on this
// thread's own stream, after the event the caller recorded on its stream at save(); finish() waits for
// them, so when it returns the chunk holds the bytes and the source may change.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <vector>

#include "common.hpp"
#include "cuda.hpp"
#include "plan.hpp"

namespace ds {

// This thread's streams with copies in flight: one non-blocking stream per device per thread, so several
// chunks are in flight on the copy engines at once. Copies are marked with this thread's event `slot`:
// InFlights of one thread with different slots are waited for apart.
class InFlight {
 public:
  explicit InFlight(int slot = 0) : slot_(slot) {}
  // This thread's stream for `device`, its primary context made current; `fresh`: none of its copies since
  // the last mark().
  Error stream(int device, cuda::CUstream* s, bool* fresh);
  // Marks the copies issued since the last mark(): wait() waits for those, not for copies issued after.
  Error mark();
  // Waits for the marked copies: their memory may then be reused.
  Error wait();
  // Waits for every copy issued so far.
  Error sync() {
    Error e = mark();
    Error w = wait();
    return e ? e : w;
  }

 private:
  int slot_;
  std::vector<std::pair<int, cuda::CUstream>> pending_;  // streams with copies issued, not yet marked
  std::vector<std::pair<int, cuda::CUevent>> marked_;    // events recorded, not yet waited for
};

// Paces the copies from staged buffers (which no training step waits for) to the host, across an engine's
// copy threads: each piece starts no sooner than the pieces before it, at `bytes_per_s`, allow. A copy that
// runs at the link's full speed crowds the step's own traffic to the host; spread over the next steps it
// does not. No credit builds up while idle: a checkpoint's first piece starts at once.
class CopyPacer {
 public:
  explicit CopyPacer(double bytes_per_s) : ns_per_byte_(bytes_per_s > 0 ? 1e9 / bytes_per_s : 0.0) {}
  // Sleeps until `n` more bytes may start (at once without a rate).
  void pace(std::size_t n);

 private:
  double ns_per_byte_;
  std::atomic<std::uint64_t> next_ns_{0};
};

class PieceCopier {
 public:
  // Device-to-host copies in flight at once from one thread, each of at most `max_copy` bytes.
  static constexpr int kCopiesInFlight = 2;
  // `events[d]` is the event recorded on the caller's stream for device d (absent: no CUDA tensors).
  // `max_copy`: the largest device-to-host copy (0: a run of bytes, however long, goes as one copy). A
  // training step's own reads from the GPU (`loss.item()`) queue behind the copies already on the copy
  // engine, whichever stream issued them: with at most kCopiesInFlight copies of `max_copy` bytes queued,
  // such a read waits for those, not for a whole chunk.
  // `pacer` (may be null) paces the copies from staged buffers.
  PieceCopier(const std::unordered_map<int, cuda::CUevent>* events, std::size_t max_copy,
              CopyPacer* pacer = nullptr)
      : events_(events), max_copy_(max_copy), pacer_(pacer) {}

  // Copies bytes [begin, end) of `t`'s row-major image to `dst` (device bytes: by finish() at the latest).
  Error copy(const TensorSrc& t, std::size_t begin, std::size_t end, char* dst);
  // Issues the device bytes still pending, then waits for the device-to-host copies since the last finish().
  Error finish();

 private:
  // Device bytes not yet issued. Ranges of one buffer that follow each other both on the device and in the
  // chunk go as one copy: a staged checkpoint's tensors are packed as in the file, so a piece is one copy,
  // not one per tensor (every copy call and its driver lock compete with the training thread's kernel
  // launches).
  struct Run {
    int device = -1;
    int buffer = -1;
    const char* src = nullptr;
    char* dst = nullptr;
    std::size_t len = 0;
  };
  Error issue();
  // Before the next copy from `device`: waits, once kCopiesInFlight copies are queued, for the oldest.
  Error throttle(int device);
  // After a copy on `s`: marks its end with the next of this thread's copy events.
  Error mark_copy(int device, cuda::CUstream s);

  const std::unordered_map<int, cuda::CUevent>* events_;
  std::size_t max_copy_;
  CopyPacer* pacer_;
  InFlight in_flight_;
  Run run_;
  std::size_t copies_ = 0;  // copies issued and marked by this copier (max_copy_ > 0)
  int copies_device_ = -1;  // the device of the copies marked
};

// Restore's host-to-device copies from (pinned) chunks, on this thread's stream per device. Uploaders of one
// thread with different slots are waited for apart: a thread fills one buffer while the other's copies run.
class DeviceUploader {
 public:
  static constexpr int kSlots = 2;
  explicit DeviceUploader(int slot = 0) : in_flight_(1 + slot) {}  // slot 0 of the thread is the copiers'
  Error copy(int device, char* dst_device, const char* src, std::size_t n);
  Error mark() { return in_flight_.mark(); }
  Error wait() { return in_flight_.wait(); }  // the source may then be reused
  Error finish() { return in_flight_.sync(); }

 private:
  InFlight in_flight_;
};

// Strided gather of bytes [begin, end) of a host tensor's row-major image.
void gather_host(const TensorSrc& t, std::size_t begin, std::size_t end, char* dst);

// memcpy of non-overlapping bytes with non-temporal stores (x86-64; elsewhere memcpy): a destination
// written once and read next by a DMA engine or another process costs no read of its lines first.
void stream_copy(void* dst, const void* src, std::size_t n);

}  // namespace ds
