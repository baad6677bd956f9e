#include "cuda.hpp"

#include <dlfcn.h>

#include <mutex>
#include <type_traits>
#include <unordered_map>

namespace ds::cuda {
namespace {

std::string g_reason;

const Api* load() {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char* e = dlerror();
    g_reason = std::string("libcuda.so.1 not found: ") + (e ? e : "?");
    return nullptr;
  }
  static Api a{};
  bool ok = true;
  auto sym = [&](auto& fn, const char* name) {
    void* p = dlsym(lib, name);
    if (!p) {
      ok = false;
      g_reason = std::string("libcuda.so.1 lacks ") + name;
    }
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(p);
  };
  sym(a.cuInit, "cuInit");
  sym(a.cuDeviceGetCount, "cuDeviceGetCount");
  sym(a.cuDeviceGet, "cuDeviceGet");
  sym(a.cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
  sym(a.cuCtxSetCurrent, "cuCtxSetCurrent");
  sym(a.cuCtxGetCurrent, "cuCtxGetCurrent");
  sym(a.cuStreamCreate, "cuStreamCreate");
  sym(a.cuStreamDestroy, "cuStreamDestroy_v2");
  sym(a.cuStreamSynchronize, "cuStreamSynchronize");
  sym(a.cuStreamWaitEvent, "cuStreamWaitEvent");
  sym(a.cuEventCreate, "cuEventCreate");
  sym(a.cuEventDestroy, "cuEventDestroy_v2");
  sym(a.cuEventRecord, "cuEventRecord");
  sym(a.cuEventSynchronize, "cuEventSynchronize");
  sym(a.cuMemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2");
  sym(a.cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2");
  sym(a.cuMemHostRegister, "cuMemHostRegister_v2");
  sym(a.cuMemHostUnregister, "cuMemHostUnregister");
  sym(a.cuGetErrorString, "cuGetErrorString");
  if (!ok) return nullptr;
  if (CUresult r = a.cuInit(0); r != 0) {
    g_reason = "cuInit failed with CUDA error " + std::to_string(r);
    return nullptr;
  }
  int n = 0;
  if (a.cuDeviceGetCount(&n) != 0 || n == 0) {
    g_reason = "no CUDA device";
    return nullptr;
  }
  return &a;
}

}  // namespace

const Api* api() {
  static const Api* a = load();
  return a;
}

std::string unavailable_reason() {
  api();
  return g_reason;
}

Error check(CUresult r, const char* call) {
  if (r == 0) return {};
  const char* s = nullptr;
  if (api()) api()->cuGetErrorString(r, &s);
  return Error::cuda(std::string(call) + " failed: " + (s ? s : "CUDA error " + std::to_string(r)));
}

Error make_current(int device) {
  const Api* a = api();
  if (!a) return Error::cuda("CUDA tensor given but the CUDA driver is unavailable: " + unavailable_reason());
  static std::mutex mu;
  static std::unordered_map<int, CUcontext> contexts;  // retained once, for the life of the process
  CUcontext ctx = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = contexts.find(device);
    if (it == contexts.end()) {
      CUdevice dev = 0;
      if (Error e = check(a->cuDeviceGet(&dev, device), "cuDeviceGet")) return e;
      if (Error e = check(a->cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain")) return e;
      contexts.emplace(device, ctx);
    } else {
      ctx = it->second;
    }
  }
  CUcontext cur = nullptr;
  a->cuCtxGetCurrent(&cur);
  if (cur == ctx) return {};
  return check(a->cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
}

StreamEvents::~StreamEvents() {
  for (auto& [device, ev] : events_)
    if (!make_current(device)) api()->cuEventDestroy(ev);
}

Error StreamEvents::record(const std::vector<std::pair<int, std::uintptr_t>>& streams) {
  for (const auto& [device, stream] : streams) {
    if (Error e = make_current(device)) return e;
    const Api* a = api();
    CUevent ev = nullptr;
    if (Error e = check(a->cuEventCreate(&ev, kEventDisableTiming), "cuEventCreate")) return e;
    events_.emplace(device, ev);
    if (Error e = check(a->cuEventRecord(ev, reinterpret_cast<CUstream>(stream)), "cuEventRecord")) return e;
  }
  return {};
}

}  // namespace ds::cuda
