// The binding of the core's work on folder trees (tree.cpp): plain functions, each run off the GIL.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "tree.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace ds {

void bind_files(nb::module_& m) {
  m.def("remove_tree", &remove_tree, "root"_a, "parts"_a, nb::call_guard<nb::gil_scoped_release>(),
        "Removes root/parts... and all in it without following a link; False where it was not removed whole");
}

}  // namespace ds
