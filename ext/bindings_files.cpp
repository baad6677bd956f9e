// The bindings of the storage target's work on whole folders (storage.hpp's remove_tree and takeable), run
// off the GIL: trust.remove_tree calls the first where a committer removes an old step, the memory tier's
// folders.ours the second for each checkpoint's files, beside a training thread (one call, not a GIL round
// trip for each of its hundreds of opens and stats).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "storage.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace ds {
namespace {

// The POSIX target both bindings work through, made once for the process.
Storage& posix() {
  static const std::shared_ptr<Storage> storage = posix_storage();
  return *storage;
}

}  // namespace

void bind_files(nb::module_& m) {
  m.def(
      "remove_tree",
      [](const std::string& root, const std::vector<std::string>& parts) {
        return posix().remove_tree(root, parts);
      },
      "root"_a, "parts"_a, nb::call_guard<nb::gil_scoped_release>(),
      "Removes root/parts... and all in it without following a link; False where it was not removed whole");
  m.def(
      "takeable",
      [](const std::string& root, const std::vector<std::vector<std::string>>& files) {
        return posix().takeable(root, files);
      },
      "root"_a, "files"_a, nb::call_guard<nb::gil_scoped_release>(),
      "For each file (its parts below root), whether it is a regular file of this user's with one name, "
      "reached without following a link");
}

}  // namespace ds
