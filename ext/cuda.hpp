// The CUDA driver API, loaded at run time with dlopen("libcuda.so.1"): one build runs with or without a GPU,
// and needs no CUDA headers or toolkit. Only the calls the engine uses are declared.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common.hpp"

namespace ds::cuda {

using CUresult = int;
using CUdevice = int;
using CUdeviceptr = unsigned long long;
using CUcontext = struct CUctx_st*;
using CUstream = struct CUstream_st*;
using CUevent = struct CUevent_st*;

struct Api {
  CUresult (*cuInit)(unsigned);
  CUresult (*cuDeviceGetCount)(int*);
  CUresult (*cuDeviceGet)(CUdevice*, int);
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice);
  CUresult (*cuCtxSetCurrent)(CUcontext);
  CUresult (*cuCtxGetCurrent)(CUcontext*);
  CUresult (*cuStreamCreate)(CUstream*, unsigned);
  CUresult (*cuStreamDestroy)(CUstream);
  CUresult (*cuStreamSynchronize)(CUstream);
  CUresult (*cuStreamWaitEvent)(CUstream, CUevent, unsigned);
  CUresult (*cuEventCreate)(CUevent*, unsigned);
  CUresult (*cuEventDestroy)(CUevent);
  CUresult (*cuEventRecord)(CUevent, CUstream);
  CUresult (*cuEventSynchronize)(CUevent);
  CUresult (*cuMemcpyDtoHAsync)(void*, CUdeviceptr, std::size_t, CUstream);
  CUresult (*cuMemcpyHtoDAsync)(CUdeviceptr, const void*, std::size_t, CUstream);
  CUresult (*cuMemHostRegister)(void*, std::size_t, unsigned);
  CUresult (*cuMemHostUnregister)(void*);
  CUresult (*cuGetErrorString)(CUresult, const char**);
};

constexpr unsigned kStreamNonBlocking = 0x1;
constexpr unsigned kEventBlockingSync = 0x1;
constexpr unsigned kEventDisableTiming = 0x2;
constexpr unsigned kHostRegisterPortable = 0x1;

// The loaded driver, or nullptr where there is none (CI) or cuInit fails. Thread-safe, loads once.
const Api* api();

// Why api() is null, for messages.
std::string unavailable_reason();

// Turns a failed call into an Error naming the call; a success into an empty Error.
Error check(CUresult r, const char* call);

// Makes the primary context of `device` (the one torch uses) current on this thread.
Error make_current(int device);

// One event per device, recorded on the callers' streams when files are queued: the copies of every file
// queued together wait for them. Shared by those files' jobs; the events go with the last of them.
class StreamEvents {
 public:
  StreamEvents() = default;
  ~StreamEvents();
  StreamEvents(const StreamEvents&) = delete;
  StreamEvents& operator=(const StreamEvents&) = delete;

  // On the caller's thread: an event on each (device, stream).
  Error record(const std::vector<std::pair<int, std::uintptr_t>>& streams);
  const std::unordered_map<int, CUevent>& events() const { return events_; }

 private:
  std::unordered_map<int, CUevent> events_;
};

}  // namespace ds::cuda
