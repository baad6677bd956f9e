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

#include "bindings_requests.hpp"
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
  ds::bind_requests(m);
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
      .def("summed", &ds::SaveJob::summed, "Whether its tensors are summed (checksums() once persisted)")
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
          [](ds::Engine& e, std::vector<ds::FileSave> files, const std::vector<ds::Array>& bases,
             const std::vector<std::pair<int, std::uintptr_t>>& streams) {
            std::vector<ds::SaveRequest> requests;
            requests.reserve(files.size());
            for (ds::FileSave& f : files) requests.push_back(ds::to_request(f, bases));
            nb::gil_scoped_release release;
            return e.save_many(std::move(requests), streams);
          },
          "files"_a, "bases"_a, "streams"_a,
          "Queues the files (FileSave each; their views' bytes in `bases`), their device copies after an "
          "event "
          "recorded on each of `streams` [(device, stream)]; one Job each")
      .def(
          "prepare_mirrors",
          [](ds::Engine& e, const std::vector<ds::MirrorLayout>& files) {
            std::vector<ds::SaveRequest> requests;
            for (const ds::MirrorLayout& f : files) requests.push_back(ds::layout_request(f));
            nb::gil_scoped_release release;  // pinning takes seconds
            return e.prepare_mirrors(requests);
          },
          "files"_a,
          "Makes, maps and pins a mirror file for each MirrorLayout, laid out as a save of such tensors; "
          "kept "
          "mapped for a save to recycle")
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
             const std::vector<std::uint64_t>& begins, const std::vector<ds::Array>& dests, bool verify,
             int fd, bool page_cache) {
            if (begins.size() != dests.size())
              throw ds::ErrorException(ds::Error::value("begins and destinations differ in length"));
            std::vector<ds::RestoreSpan> spans(begins.size());
            for (std::size_t i = 0; i < spans.size(); ++i) {
              spans[i] = {begins[i], begins[i] + dests[i].nbytes(), static_cast<char*>(dests[i].data()),
                          ds::device_of(dests[i], "destination " + std::to_string(i))};
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
