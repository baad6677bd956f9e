// The binding of the core's settings: one EngineOptions, built in Python from DataStatesConfig
// (core_setup.core_options) and handed to the Engine whole. Every field is a required keyword: the core
// defaults none of the engine's settings, so Python's defaults are the only ones a run ever takes.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "engine.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace ds {

void bind_options(nb::module_& m) {
  nb::class_<EngineOptions>(m, "EngineOptions")
      .def(
          "__init__",
          [](EngineOptions* self, std::size_t cache_bytes, std::size_t chunk_bytes, int pin_device,
             bool huge_pages, unsigned copy_threads, unsigned host_copy_threads, unsigned checksum_threads,
             std::size_t device_copy_bytes, double device_copy_bytes_per_s, unsigned flush_threads,
             int flush_nice, unsigned flush_depth, const std::string& io_backend, bool direct_io, bool fsync,
             bool checksums, bool memory_checksums, unsigned parser_threads, unsigned queue_depth,
             std::size_t read_bytes, bool read_direct_io, bool map_memory_files) {
            EngineOptions* o = new (self) EngineOptions();
            // The cache
            o->cache_bytes = cache_bytes;
            o->chunk_bytes = chunk_bytes;
            o->pin_device = pin_device;
            o->huge_pages = huge_pages;
            // Saves: copy, flush, commit
            o->copy_threads = copy_threads;
            o->host_copy_threads = host_copy_threads;
            o->checksum_threads = checksum_threads;
            o->device_copy_bytes = device_copy_bytes;
            o->device_copy_bytes_per_s = device_copy_bytes_per_s;
            o->flush_threads = flush_threads;
            o->flush_nice = flush_nice;
            o->flush_depth = flush_depth;
            o->io_backend = io_backend;
            o->save = {direct_io, fsync, checksums, memory_checksums};
            // Restores
            o->parser_threads = parser_threads;
            o->queue_depth = queue_depth;
            o->read_bytes = read_bytes;
            o->read_direct_io = read_direct_io;
            o->map_memory_files = map_memory_files;
          },
          "cache_bytes"_a, "chunk_bytes"_a, "pin_device"_a, "huge_pages"_a, "copy_threads"_a,
          "host_copy_threads"_a, "checksum_threads"_a, "device_copy_bytes"_a, "device_copy_bytes_per_s"_a,
          "flush_threads"_a, "flush_nice"_a, "flush_depth"_a, "io_backend"_a, "direct_io"_a, "fsync"_a,
          "checksums"_a, "memory_checksums"_a, "parser_threads"_a, "queue_depth"_a, "read_bytes"_a,
          "read_direct_io"_a, "map_memory_files"_a,
          "Every setting by keyword, none defaulted here: DataStatesConfig owns the defaults")
      .def_ro("cache_bytes", &EngineOptions::cache_bytes)
      .def_ro("chunk_bytes", &EngineOptions::chunk_bytes)
      .def_ro("pin_device", &EngineOptions::pin_device)
      .def_ro("huge_pages", &EngineOptions::huge_pages)
      .def_ro("copy_threads", &EngineOptions::copy_threads)
      .def_ro("host_copy_threads", &EngineOptions::host_copy_threads)
      .def_ro("checksum_threads", &EngineOptions::checksum_threads)
      .def_ro("device_copy_bytes", &EngineOptions::device_copy_bytes)
      .def_ro("device_copy_bytes_per_s", &EngineOptions::device_copy_bytes_per_s)
      .def_ro("flush_threads", &EngineOptions::flush_threads)
      .def_ro("flush_nice", &EngineOptions::flush_nice)
      .def_ro("flush_depth", &EngineOptions::flush_depth)
      .def_ro("io_backend", &EngineOptions::io_backend)
      .def_prop_ro("direct_io", [](const EngineOptions& o) { return o.save.direct_io; })
      .def_prop_ro("fsync", [](const EngineOptions& o) { return o.save.fsync; })
      .def_prop_ro("checksums", [](const EngineOptions& o) { return o.save.checksums; })
      .def_prop_ro("memory_checksums", [](const EngineOptions& o) { return o.save.memory_checksums; })
      .def_ro("parser_threads", &EngineOptions::parser_threads)
      .def_ro("queue_depth", &EngineOptions::queue_depth)
      .def_ro("read_bytes", &EngineOptions::read_bytes)
      .def_ro("read_direct_io", &EngineOptions::read_direct_io)
      .def_ro("map_memory_files", &EngineOptions::map_memory_files);
}

}  // namespace ds
