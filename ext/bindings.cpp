// The Python binding of the core: argument conversion, GIL release around every blocking call, and the
// mapping of ds::Error to Python exceptions. No logic lives here.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "cuda.hpp"
#include "engine.hpp"
#include "fault.hpp"
#include "flush.hpp"
#include "plan.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace ds {
void bind_options(nb::module_& m);  // bindings_options.cpp
void bind_files(nb::module_& m);    // bindings_files.cpp
void bind_bytes(nb::module_& m);    // bindings_bytes.cpp
}  // namespace ds

namespace {

void set_python_error(const ds::Error& e) {
  switch (e.kind) {
    case ds::Error::Kind::Os: {
      nb::object args = e.path.empty() ? nb::make_tuple(e.os_errno, e.message)
                                       : nb::make_tuple(e.os_errno, e.message, e.path);
      PyErr_SetObject(PyExc_OSError, args.ptr());
      break;
    }
    case ds::Error::Kind::Value:
      PyErr_SetString(PyExc_ValueError, (e.path.empty() ? e.message : e.path + ": " + e.message).c_str());
      break;
    default:
      PyErr_SetString(PyExc_RuntimeError, (e.path.empty() ? e.message : e.path + ": " + e.message).c_str());
  }
}

int device_of(const nb::ndarray<>& a, const std::string& name) {
  if (a.device_type() == nb::device::cpu::value) return -1;
  if (a.device_type() == nb::device::cuda::value) return a.device_id();
  throw ds::ErrorException(
      ds::Error::value("tensor '" + name + "' is on an unsupported device (CPU and CUDA only)"));
}

ds::TensorSrc to_src(const nb::ndarray<>& a, std::string name, std::string dtype) {
  ds::TensorSrc t;
  t.device = device_of(a, name);
  t.name = std::move(name);
  t.dtype = std::move(dtype);
  t.itemsize = a.itemsize();
  t.data = static_cast<const char*>(a.data());
  std::size_t numel = 1;
  std::int64_t expect = 1;
  t.contiguous = true;
  t.shape.resize(a.ndim());
  t.strides.resize(a.ndim());
  for (std::size_t d = a.ndim(); d-- > 0;) {
    t.shape[d] = a.shape(d);
    t.strides[d] = a.stride(d);
    numel *= a.shape(d);
    if (a.shape(d) != 1 && a.stride(d) != expect) t.contiguous = false;
    expect *= a.shape(d);
  }
  if (numel == 0) t.contiguous = true;
  t.nbytes = numel * t.itemsize;
  return t;
}

// A staged tensor: bytes [offset, offset + itemsize * prod(shape)) of one of the bases (uint8 buffers).
using View = std::tuple<std::size_t, std::size_t, std::size_t, std::vector<std::int64_t>>;
// A file to save: path, tensor names, safetensors dtypes, then the tensors (arrays), or their views into
// the bases (a staged checkpoint: two DLPack exports instead of hundreds), metadata, embed_checksums.
using FileArg =
    std::tuple<std::string, std::vector<std::string>, std::vector<std::string>, std::vector<nb::ndarray<>>,
               std::vector<View>, ds::Metadata, bool, std::string, std::string>;

ds::TensorSrc view_src(const View& v, const std::vector<nb::ndarray<>>& bases, std::string name,
                       std::string dtype, const std::string& path) {
  const auto& [base, offset, itemsize, shape] = v;
  auto bad = [&](const std::string& why) {
    return ds::ErrorException(ds::Error::value("tensor '" + name + "' of " + path + ": " + why));
  };
  if (base >= bases.size()) throw bad("its view names buffer " + std::to_string(base) + ", which is absent");
  const nb::ndarray<>& b = bases[base];
  if (b.ndim() != 1 || b.itemsize() != 1 || (b.shape(0) > 1 && b.stride(0) != 1))
    throw bad("its buffer is not a contiguous byte buffer");
  std::vector<std::int64_t> strides(shape.size());
  std::size_t numel = 1;
  for (std::size_t d = shape.size(); d-- > 0;) {
    if (shape[d] < 0) throw bad("negative dimension");
    strides[d] = static_cast<std::int64_t>(numel);
    numel *= static_cast<std::size_t>(shape[d]);
  }
  const std::size_t nbytes = numel * itemsize;
  if (offset > b.shape(0) || nbytes > b.shape(0) - offset) throw bad("its view ends past its buffer");
  ds::TensorSrc t;
  t.device = device_of(b, name);
  t.name = std::move(name);
  t.dtype = std::move(dtype);
  t.itemsize = itemsize;
  t.shape = shape;
  t.strides = std::move(strides);
  t.nbytes = nbytes;
  t.data = static_cast<const char*>(b.data()) + offset;
  t.buffer = static_cast<int>(base);
  return t;
}

ds::SaveRequest to_request(FileArg& f, const std::vector<nb::ndarray<>>& bases) {
  auto& [path, names, dtypes, arrays, views, metadata, embed_checksums, mirror, recycle] = f;
  const std::size_t n = views.empty() ? arrays.size() : views.size();
  if (names.size() != n || dtypes.size() != n || (!views.empty() && !arrays.empty()))
    throw ds::ErrorException(ds::Error::value(path + ": names, dtypes and tensors differ in length"));
  ds::SaveRequest r;
  r.tensors.reserve(n);
  for (std::size_t i = 0; i < n; ++i)
    r.tensors.push_back(views.empty() ? to_src(arrays[i], names[i], dtypes[i])
                                      : view_src(views[i], bases, names[i], dtypes[i], path));
  r.path = std::move(path);
  r.metadata = std::move(metadata);
  r.embed_checksums = embed_checksums;
  r.mirror = std::move(mirror);
  r.recycle = std::move(recycle);
  return r;
}

// A file's layout without its bytes: path, tensor names, safetensors dtypes, item sizes, shapes, metadata,
// embed_checksums (Engine::prepare_mirrors).
using LayoutArg =
    std::tuple<std::string, std::vector<std::string>, std::vector<std::string>, std::vector<std::size_t>,
               std::vector<std::vector<std::int64_t>>, ds::Metadata, bool>;

ds::SaveRequest layout_request(const LayoutArg& f) {
  const auto& [path, names, dtypes, itemsizes, shapes, metadata, embed_checksums] = f;
  const std::size_t n = names.size();
  if (dtypes.size() != n || itemsizes.size() != n || shapes.size() != n)
    throw ds::ErrorException(
        ds::Error::value(path + ": names, dtypes, item sizes and shapes differ in length"));
  ds::SaveRequest r;
  for (std::size_t i = 0; i < n; ++i) {
    ds::TensorSrc t;
    t.name = names[i];
    t.dtype = dtypes[i];
    t.itemsize = itemsizes[i];
    t.shape = shapes[i];
    t.nbytes = t.itemsize;
    for (std::int64_t d : t.shape) {
      if (d < 0)
        throw ds::ErrorException(ds::Error::value(path + ": tensor '" + names[i] + "': negative dimension"));
      t.nbytes *= static_cast<std::size_t>(d);
    }
    r.tensors.push_back(std::move(t));
  }
  r.path = path;
  r.metadata = metadata;
  r.embed_checksums = embed_checksums;
  return r;
}

ds::HostCache& open_cache(ds::Engine& e) {
  if (!e.cache()) throw ds::ErrorException(ds::Error::value("the engine is closed"));
  return *e.cache();
}

nb::dict job_stats(ds::SaveJob& j) {
  const ds::JobStats s = j.stats();
  nb::dict d;
  d["file_bytes"] = s.file_bytes;
  d["tensor_bytes"] = s.tensor_bytes;
  d["t_submit_ns"] = s.t_submit_ns;
  d["t_snapshot_ns"] = s.t_snapshot_ns;
  d["t_persisted_ns"] = s.t_persisted_ns;
  d["direct_io"] = s.direct_io;
  d["mirrored"] = s.mirrored;
  d["mirror_kept"] = s.mirror_kept;
  d["mirror_refused"] = s.mirror_refused;
  return d;
}

}  // namespace

NB_MODULE(_core, m) {
  ds::bind_options(m);
  ds::bind_files(m);
  ds::bind_bytes(m);
  m.doc() =
      "nanotron_datastates core: host cache, copy, io_uring flush, restore (private; use the package API)";

  m.attr("built_with_io_uring") = ds::built_with_io_uring();
  m.attr("io_uring_absent_why") = ds::io_uring_absent_why();

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const ds::ErrorException& e) {
      set_python_error(e.error);
    }
  });

  nb::class_<ds::SaveJob>(m, "Job")
      .def_prop_ro("path", &ds::SaveJob::path)
      .def("wait_snapshot", &ds::SaveJob::wait_snapshot, "timeout"_a = -1.0,
           nb::call_guard<nb::gil_scoped_release>(), "False on timeout")
      .def("wait_persisted", &ds::SaveJob::wait_persisted, "timeout"_a = -1.0,
           nb::call_guard<nb::gil_scoped_release>(), "False on timeout")
      .def("snapshot_done", &ds::SaveJob::snapshot_done)
      .def("persisted_done", &ds::SaveJob::persisted_done)
      .def("failed", &ds::SaveJob::failed)
      .def(
          "raise_error",
          [](ds::SaveJob& j) {
            if (ds::Error e = j.error()) throw ds::ErrorException(e);
          },
          "Raises the job's error (OSError, ValueError or RuntimeError), if any")
      .def("stats", &job_stats)
      .def("mirror_error", &ds::SaveJob::mirror_error, "Why the mirror copy was dropped (empty: it was not)")
      .def("checksums", &ds::SaveJob::checksums, "[(tensor name, CRC-32C)] in file order, once persisted")
      .def("block_checksums", &ds::SaveJob::block_checksums,
           "(block size, [(tensor name, [CRC-32C per block segment])]) in file order, once persisted");

  m.def("wait_jobs", &ds::wait_jobs, "jobs"_a, "persisted"_a, "timeout"_a = -1.0,
        nb::call_guard<nb::gil_scoped_release>(), "Waits for every job; False on timeout");

  nb::class_<ds::Engine>(m, "Engine")
      .def(
          "__init__",
          [](ds::Engine* self, const ds::EngineOptions& options) {
            nb::gil_scoped_release release;  // allocating and pinning the cache can take seconds
            new (self) ds::Engine(options);
          },
          "options"_a,
          "The core's engine, started with `options` (an EngineOptions: core_setup.core_options)")
      .def_prop_ro("options", &ds::Engine::options, "The settings it was started with")
      .def(
          "save_many",
          [](ds::Engine& e, std::vector<FileArg> files, const std::vector<nb::ndarray<>>& bases,
             const std::vector<std::pair<int, std::uintptr_t>>& streams) {
            std::vector<ds::SaveRequest> requests;
            requests.reserve(files.size());
            for (FileArg& f : files) requests.push_back(to_request(f, bases));
            nb::gil_scoped_release release;
            return e.save_many(std::move(requests), streams);
          },
          "files"_a, "bases"_a, "streams"_a,
          "Queues files [(path, names, dtypes, arrays, views, metadata, embed_checksums, mirror, recycle)]; "
          "one Job each")
      .def(
          "prepare_mirrors",
          [](ds::Engine& e, const std::vector<LayoutArg>& files) {
            std::vector<ds::SaveRequest> requests;
            for (const LayoutArg& f : files) requests.push_back(layout_request(f));
            nb::gil_scoped_release release;  // pinning takes seconds
            return e.prepare_mirrors(requests);
          },
          "files"_a,
          "Makes, maps and pins a mirror file for each of [(path, names, dtypes, itemsizes, shapes, "
          "metadata, "
          "embed_checksums)], laid out as a save of such tensors; kept mapped for a save to recycle")
      .def(
          "keep_mirrors",
          [](ds::Engine& e, const std::optional<std::vector<std::string>>& paths) {
            nb::gil_scoped_release release;  // unpinning takes the CUDA driver's locks
            return paths ? e.keep_mirrors(*paths) : e.keep_named_mirrors();
          },
          "paths"_a.none(), "Keeps these mirror files (None: those still there) mapped; unmaps the others")
      .def(
          "restore_host",
          [](ds::Engine& e, const std::string& path, std::uint64_t data_start, std::uint64_t data_len,
             const std::vector<std::uint64_t>& begins, const std::vector<std::uint64_t>& ends, bool verify,
             int fd) {
            if (begins.size() != ends.size())
              throw ds::ErrorException(ds::Error::value("begins and ends differ in length"));
            std::vector<ds::RestoreSpan> spans(begins.size());
            for (std::size_t i = 0; i < spans.size(); ++i) spans[i] = {begins[i], ends[i], nullptr, -1};
            ds::RestoreResult r;
            {
              nb::gil_scoped_release release;
              r = e.restore(path, data_start, data_len, spans, false, verify, fd);
            }
            // One uint8 tensor per span, each with its own storage (storage_offset 0: some torch calls, such
            // as set_rng_state, ignore offsets) holding a reference to the shared buffer, freed with the last
            // one.
            auto shared = std::shared_ptr<ds::FileMapping>(std::move(r.mapping));
            nb::list out;
            for (const ds::RestoreSpan& sp : spans) {
              char* p = shared->data() + data_start + sp.begin;
              const std::size_t shape[1] = {static_cast<std::size_t>(sp.end - sp.begin)};
              auto* ref = new std::shared_ptr<ds::FileMapping>(shared);
              nb::capsule owner(
                  ref, [](void* q) noexcept { delete static_cast<std::shared_ptr<ds::FileMapping>*>(q); });
              out.append(nb::ndarray<nb::pytorch, std::uint8_t, nb::ndim<1>>(p, 1, shape, owner));
            }
            return nb::make_tuple(out, r.crcs);
          },
          "path"_a, "data_start"_a, "data_len"_a, "begins"_a, "ends"_a, "verify"_a, "fd"_a = -1,
          "Maps the file (`fd`, an open descriptor of `path`, where >= 0) and reads its data section in "
          "parallel: ([uint8 tensor per span], crcs)")
      .def(
          "restore_device",
          [](ds::Engine& e, const std::string& path, std::uint64_t data_start, std::uint64_t data_len,
             const std::vector<std::uint64_t>& begins, const std::vector<nb::ndarray<>>& dests, bool verify,
             int fd, bool page_cache) {
            if (begins.size() != dests.size())
              throw ds::ErrorException(ds::Error::value("begins and destinations differ in length"));
            std::vector<ds::RestoreSpan> spans(begins.size());
            for (std::size_t i = 0; i < spans.size(); ++i) {
              spans[i] = {begins[i], begins[i] + dests[i].nbytes(), static_cast<char*>(dests[i].data()),
                          device_of(dests[i], "destination " + std::to_string(i))};
            }
            nb::gil_scoped_release release;
            return e.restore(path, data_start, data_len, spans, true, verify, fd, page_cache).crcs;
          },
          "path"_a, "data_start"_a, "data_len"_a, "begins"_a, "dests"_a, "verify"_a, "fd"_a = -1,
          "page_cache"_a = false,
          "Reads the data section (of `fd`, an open descriptor of `path`, where >= 0) into CUDA tensors "
          "through pinned chunks (host destinations take the same path, memcpy for the upload; `page_cache`: "
          "never with O_DIRECT); returns the crcs")
      .def("prepare_cache", &ds::Engine::prepare_cache, "wait"_a, "chunks"_a,
           nb::call_guard<nb::gil_scoped_release>())
      .def("wait_idle", &ds::Engine::wait_idle, "timeout"_a = -1.0, nb::call_guard<nb::gil_scoped_release>())
      .def("close", &ds::Engine::close, nb::call_guard<nb::gil_scoped_release>())
      .def_prop_ro("in_flight", &ds::Engine::in_flight)
      .def_prop_ro("backend", &ds::Engine::backend)
      .def_prop_ro("fallback_reason", &ds::Engine::fallback_reason)
      .def_prop_ro("pinned", &ds::Engine::pinned)
      .def_prop_ro("pin_error", &ds::Engine::pin_error)
      .def_prop_ro("chunk_bytes", [](ds::Engine& e) { return open_cache(e).chunk_bytes(); })
      .def_prop_ro("num_chunks", [](ds::Engine& e) { return open_cache(e).num_chunks(); })
      .def(
          "cache_stats",
          [](ds::Engine& e, bool reset) {
            const ds::CacheStats s = open_cache(e).stats(reset);
            nb::dict d;
            d["chunks"] = s.chunks;
            d["chunk_bytes"] = s.chunk_bytes;
            d["in_use"] = s.in_use;
            d["high_water"] = s.high_water;
            d["wait_ns"] = s.wait_ns;
            d["pinned"] = s.pinned;
            d["huge_pages"] = s.huge_pages;
            d["prepared"] = s.prepared;
            return d;
          },
          "reset"_a = false);

  m.def("_arm_fault", &ds::fault::arm, "kind"_a, "err"_a, "path_contains"_a, "skip"_a = 0, "count"_a = 1,
        "Tests only: fail the next matching flush-layer ops with errno `err`");
  m.def("_disarm_fault", &ds::fault::disarm);
  m.def("_fault_hits", &ds::fault::hits);
  m.def("cuda_available", [] { return ds::cuda::api() != nullptr; });
  m.def("cuda_unavailable_reason", &ds::cuda::unavailable_reason);
}
