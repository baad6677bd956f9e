#include "save_files.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>

namespace ds {
namespace {

std::atomic<std::uint64_t> g_seq{0};

}  // namespace

int make_dirs(const std::string& dir) {
  if (dir.empty()) return 0;
  struct stat st;
  if (stat(dir.c_str(), &st) == 0) return S_ISDIR(st.st_mode) ? 0 : ENOTDIR;
  const auto slash = dir.find_last_of('/');
  if (slash != std::string::npos && slash > 0)
    if (int e = make_dirs(dir.substr(0, slash))) return e;
  if (mkdir(dir.c_str(), 0777) != 0 && errno != EEXIST) return errno;
  return 0;
}

std::string temporary_path(const std::string& path, std::string* dir) {
  const auto slash = path.find_last_of('/');
  std::string base;
  if (slash == std::string::npos) {
    *dir = ".";
    base = path;
  } else {
    *dir = slash == 0 ? "/" : path.substr(0, slash);
    base = path.substr(slash + 1);
  }
  return *dir + "/." + base + ".dstmp." + std::to_string(getpid()) + "." + std::to_string(g_seq.fetch_add(1));
}

}  // namespace ds
