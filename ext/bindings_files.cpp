// The binding of the storage target's work on whole folders (storage.hpp's remove_tree), run off the GIL:
// trust.remove_tree calls it where a committer removes an old step, beside a training thread.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "storage.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace ds {

void bind_files(nb::module_& m) {
  m.def(
      "remove_tree",
      [](const std::string& root, const std::vector<std::string>& parts) {
        static const std::shared_ptr<Storage> storage = posix_storage();
        return storage->remove_tree(root, parts);
      },
      "root"_a, "parts"_a, nb::call_guard<nb::gil_scoped_release>(),
      "Removes root/parts... and all in it without following a link; False where it was not removed whole");
}

}  // namespace ds
