// The files a save creates: its parent folders, and a temporary name beside the final path that no other
// save (of this process or another) takes, so that a rename puts the whole file in place at once.
#pragma once

#include <string>

namespace ds {

// mkdir -p; returns 0 or errno.
int make_dirs(const std::string& dir);

// "<dir>/.<name>.dstmp.<pid>.<n>" for `path` = "<dir>/<name>"; `*dir` receives <dir>.
std::string temporary_path(const std::string& path, std::string* dir);

}  // namespace ds
