// The binding of the core's byte-level tools, for tests and tools: CRC-32C (plain, combined, summed while
// copied), the non-temporal copy, and the header the engine writes for a set of tensors.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <string>
#include <vector>

#include "copy.hpp"
#include "crc32c.hpp"
#include "plan.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace ds {

void bind_bytes(nb::module_& m) {
  m.def(
      "crc32c", [](nb::bytes data, std::uint32_t crc) { return crc32c(crc, data.c_str(), data.size()); },
      "data"_a, "crc"_a = 0, "CRC-32C of `data`, continuing from `crc`");
  m.def("crc32c_combine", &crc32c_combine, "crc_a"_a, "crc_b"_a, "len_b"_a);
  m.def(
      "crc32c_copy",
      [](nb::bytes data, std::size_t offset) {
        std::string dst(offset + data.size(), '\0');
        const std::uint32_t crc = crc32c_copy(0, dst.data() + offset, data.c_str(), data.size());
        return nb::make_tuple(crc, nb::bytes(dst.data() + offset, data.size()));
      },
      "data"_a, "offset"_a = 0,
      "(CRC-32C, the bytes) of `data` copied `offset` bytes into a new buffer, summed as they are stored");
  m.def(
      "copy_streaming",
      [](std::uintptr_t dst, std::uintptr_t src, std::size_t n) {
        nb::gil_scoped_release unlocked;
        stream_copy(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), n);
      },
      "dst"_a, "src"_a, "n"_a,
      "Copies `n` bytes from address `src` to `dst` (memory the caller holds, not overlapping) with "
      "non-temporal stores: no read of dst's lines first");
  m.def(
      "encode_header",
      [](const std::vector<std::string>& names, const std::vector<std::string>& dtypes,
         const std::vector<std::vector<std::int64_t>>& shapes, const std::vector<std::size_t>& itemsizes,
         const Metadata& metadata, bool checksums, std::size_t block_bytes) {
        std::vector<TensorSrc> ts(names.size());
        for (std::size_t i = 0; i < ts.size(); ++i) {
          ts[i].name = names[i];
          ts[i].dtype = dtypes[i];
          ts[i].shape = shapes[i];
          ts[i].itemsize = itemsizes[i];
          std::size_t n = itemsizes[i];
          for (auto s : shapes[i]) n *= static_cast<std::size_t>(s);
          ts[i].nbytes = n;
        }
        const Layout l = plan_layout(ts, metadata, checksums, block_bytes);
        return nb::bytes(l.header.data(), l.header.size());
      },
      "names"_a, "dtypes"_a, "shapes"_a, "itemsizes"_a, "metadata"_a, "checksums"_a, "block_bytes"_a = 0,
      "The header bytes the engine writes for these tensors (checksums as zeros): for tests and tools");
}

}  // namespace ds
