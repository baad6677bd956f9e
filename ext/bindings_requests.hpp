// The typed arguments the binding takes for saves (FileSave, each tensor an array or a StagedView) and for
// mirror files made ahead (MirrorLayout), and their conversion into the core's SaveRequest. The conversions
// throw ErrorException (Value), which the module's translator raises as ValueError.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "engine.hpp"
#include "plan.hpp"

namespace ds {

// A tensor handed over by Python: any DLPack exporter (torch.Tensor in the stub, where every caller's
// tensors come from). The framework names only what an export would make; an import accepts any.
using Array = nanobind::ndarray<nanobind::pytorch>;

// A staged tensor: bytes [offset, offset + itemsize * prod(shape)) of the save's buffer `base` (a uint8
// buffer), C-contiguous.
struct StagedView {
  std::size_t base = 0;
  std::size_t offset = 0;
  std::size_t itemsize = 1;
  std::vector<std::int64_t> shape;
};

// A file to save: its tensors' names and safetensors dtypes, then the tensors themselves (`arrays`) or, for a
// staged checkpoint, their places in the save's buffers (`views`: two DLPack exports instead of hundreds).
struct FileSave {
  std::string path;
  std::vector<std::string> names;
  std::vector<std::string> dtypes;
  std::vector<Array> arrays;
  std::vector<StagedView> views;
  Metadata metadata;
  bool embed_checksums = true;
  std::string mirror;   // SaveRequest::mirror
  std::string recycle;  // SaveRequest::recycle
};

// A mirror file's layout without its bytes: laid out as a save of such tensors would lay out its file.
struct MirrorLayout {
  std::string path;
  std::vector<std::string> names;
  std::vector<std::string> dtypes;
  std::vector<std::size_t> itemsizes;
  std::vector<std::vector<std::int64_t>> shapes;
  Metadata metadata;
  bool embed_checksums = true;
};

// The CUDA ordinal of `a`, -1 for host memory; `name` names it in the error of another device.
int device_of(const Array& a, const std::string& name);

// `f` as the core's request (its strings moved out), its tensors' bytes in `bases` where it has views.
SaveRequest to_request(FileSave& f, const std::vector<Array>& bases);

SaveRequest layout_request(const MirrorLayout& f);

void bind_requests(nanobind::module_& m);

}  // namespace ds
