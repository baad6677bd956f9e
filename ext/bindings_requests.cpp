// The binding of a save's and a mirror file's typed arguments (bindings_requests.hpp): keyword
// constructors, fields readable and writable by name, and their checks as they become the core's requests.
#include "bindings_requests.hpp"

#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <utility>

namespace nb = nanobind;
using namespace nb::literals;

namespace ds {

int device_of(const Array& a, const std::string& name) {
  if (a.device_type() == nb::device::cpu::value) return -1;
  if (a.device_type() == nb::device::cuda::value) return a.device_id();
  throw ErrorException(Error::value("tensor '" + name + "' is on an unsupported device (CPU and CUDA only)"));
}

namespace {

TensorSrc array_src(const Array& a, std::string name, std::string dtype) {
  TensorSrc t;
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

TensorSrc view_src(const StagedView& v, const std::vector<Array>& bases, std::string name, std::string dtype,
                   const std::string& path) {
  auto bad = [&](const std::string& why) {
    return ErrorException(Error::value("tensor '" + name + "' of " + path + ": " + why));
  };
  if (v.base >= bases.size())
    throw bad("its view names buffer " + std::to_string(v.base) + ", which is absent");
  const Array& b = bases[v.base];
  if (b.ndim() != 1 || b.itemsize() != 1 || (b.shape(0) > 1 && b.stride(0) != 1))
    throw bad("its buffer is not a contiguous byte buffer");
  std::vector<std::int64_t> strides(v.shape.size());
  std::size_t numel = 1;
  for (std::size_t d = v.shape.size(); d-- > 0;) {
    if (v.shape[d] < 0) throw bad("negative dimension");
    strides[d] = static_cast<std::int64_t>(numel);
    numel *= static_cast<std::size_t>(v.shape[d]);
  }
  const std::size_t nbytes = numel * v.itemsize;
  if (v.offset > b.shape(0) || nbytes > b.shape(0) - v.offset) throw bad("its view ends past its buffer");
  TensorSrc t;
  t.device = device_of(b, name);
  t.name = std::move(name);
  t.dtype = std::move(dtype);
  t.itemsize = v.itemsize;
  t.shape = v.shape;
  t.strides = std::move(strides);
  t.nbytes = nbytes;
  t.data = static_cast<const char*>(b.data()) + v.offset;
  t.buffer = static_cast<int>(v.base);
  return t;
}

}  // namespace

SaveRequest to_request(FileSave& f, const std::vector<Array>& bases) {
  const std::size_t n = f.views.empty() ? f.arrays.size() : f.views.size();
  if (f.names.size() != n || f.dtypes.size() != n || (!f.views.empty() && !f.arrays.empty()))
    throw ErrorException(Error::value(f.path + ": names, dtypes and tensors differ in length"));
  SaveRequest r;
  r.tensors.reserve(n);
  for (std::size_t i = 0; i < n; ++i)
    r.tensors.push_back(f.views.empty() ? array_src(f.arrays[i], f.names[i], f.dtypes[i])
                                        : view_src(f.views[i], bases, f.names[i], f.dtypes[i], f.path));
  r.path = std::move(f.path);
  r.metadata = std::move(f.metadata);
  r.embed_checksums = f.embed_checksums;
  r.mirror = std::move(f.mirror);
  r.recycle = std::move(f.recycle);
  return r;
}

SaveRequest layout_request(const MirrorLayout& f) {
  const std::size_t n = f.names.size();
  if (f.dtypes.size() != n || f.itemsizes.size() != n || f.shapes.size() != n)
    throw ErrorException(Error::value(f.path + ": names, dtypes, item sizes and shapes differ in length"));
  SaveRequest r;
  for (std::size_t i = 0; i < n; ++i) {
    TensorSrc t;
    t.name = f.names[i];
    t.dtype = f.dtypes[i];
    t.itemsize = f.itemsizes[i];
    t.shape = f.shapes[i];
    t.nbytes = t.itemsize;
    for (std::int64_t d : t.shape) {
      if (d < 0)
        throw ErrorException(Error::value(f.path + ": tensor '" + f.names[i] + "': negative dimension"));
      t.nbytes *= static_cast<std::size_t>(d);
    }
    r.tensors.push_back(std::move(t));
  }
  r.path = f.path;
  r.metadata = f.metadata;
  r.embed_checksums = f.embed_checksums;
  return r;
}

void bind_requests(nb::module_& m) {
  nb::class_<StagedView>(m, "StagedView")
      .def(
          "__init__",
          [](StagedView* self, std::size_t base, std::size_t offset, std::size_t itemsize,
             std::vector<std::int64_t> shape) {
            new (self) StagedView{base, offset, itemsize, std::move(shape)};
          },
          nb::kw_only(), "base"_a, "offset"_a, "itemsize"_a, "shape"_a,
          "A staged tensor: bytes [offset, offset + itemsize * prod(shape)) of the save's buffer `base` (a "
          "uint8 buffer), C-contiguous")
      .def_rw("base", &StagedView::base)
      .def_rw("offset", &StagedView::offset)
      .def_rw("itemsize", &StagedView::itemsize)
      .def_rw("shape", &StagedView::shape);

  nb::class_<FileSave>(m, "FileSave")
      .def(
          "__init__",
          [](FileSave* self, std::string path, std::vector<std::string> names,
             std::vector<std::string> dtypes, Metadata metadata, bool embed_checksums,
             std::vector<Array> arrays, std::vector<StagedView> views, std::string mirror,
             std::string recycle) {
            new (self) FileSave{std::move(path),   std::move(names),  std::move(dtypes),
                                std::move(arrays), std::move(views),  std::move(metadata),
                                embed_checksums,   std::move(mirror), std::move(recycle)};
          },
          nb::kw_only(), "path"_a, "names"_a, "dtypes"_a, "metadata"_a, "embed_checksums"_a,
          "arrays"_a = std::vector<Array>(), "views"_a = std::vector<StagedView>(), "mirror"_a = "",
          "recycle"_a = "",
          "A file to save at `path`: its tensors' names and safetensors dtypes, and the tensors (`arrays`) "
          "or "
          "their places in the save's buffers (`views`); `mirror`: a second copy's path, the save's staging "
          "memory (empty: none); `recycle`: an earlier save's mirror file to take this one's bytes (empty: "
          "none)")
      .def_rw("path", &FileSave::path)
      .def_rw("names", &FileSave::names)
      .def_rw("dtypes", &FileSave::dtypes)
      .def_rw("metadata", &FileSave::metadata)
      .def_rw("embed_checksums", &FileSave::embed_checksums)
      .def_rw("arrays", &FileSave::arrays)
      .def_rw("views", &FileSave::views)
      .def_rw("mirror", &FileSave::mirror)
      .def_rw("recycle", &FileSave::recycle);

  nb::class_<MirrorLayout>(m, "MirrorLayout")
      .def(
          "__init__",
          [](MirrorLayout* self, std::string path, std::vector<std::string> names,
             std::vector<std::string> dtypes, std::vector<std::size_t> itemsizes,
             std::vector<std::vector<std::int64_t>> shapes, Metadata metadata, bool embed_checksums) {
            new (self)
                MirrorLayout{std::move(path),   std::move(names),    std::move(dtypes), std::move(itemsizes),
                             std::move(shapes), std::move(metadata), embed_checksums};
          },
          nb::kw_only(), "path"_a, "names"_a, "dtypes"_a, "itemsizes"_a, "shapes"_a, "metadata"_a,
          "embed_checksums"_a,
          "A mirror file to make at `path`, laid out as a save of tensors of these names, dtypes, item sizes "
          "and shapes with this metadata lays out its file")
      .def_rw("path", &MirrorLayout::path)
      .def_rw("names", &MirrorLayout::names)
      .def_rw("dtypes", &MirrorLayout::dtypes)
      .def_rw("itemsizes", &MirrorLayout::itemsizes)
      .def_rw("shapes", &MirrorLayout::shapes)
      .def_rw("metadata", &MirrorLayout::metadata)
      .def_rw("embed_checksums", &MirrorLayout::embed_checksums);
}

}  // namespace ds
