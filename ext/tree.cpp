#include "tree.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <utility>

namespace ds {
namespace {

constexpr int kFolder = O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC;  // a folder, never a link to one
using Entries = std::vector<std::pair<std::string, bool>>;  // (name, a folder: not a link to one)

// The entries of the folder open at `fd`, which stays open; false where it cannot be listed.
bool list(int fd, Entries& out) {
  const int own = fcntl(fd, F_DUPFD_CLOEXEC, 0);  // closedir closes it
  DIR* dir = own < 0 ? nullptr : fdopendir(own);
  if (dir == nullptr) {
    if (own >= 0) close(own);
    return false;
  }
  for (;;) {
    errno = 0;  // readdir's end and its failure differ only by errno
    const dirent* e = readdir(dir);
    if (e == nullptr) break;
    const std::string name = e->d_name;
    if (name != "." && name != "..") out.emplace_back(name, e->d_type == DT_DIR || e->d_type == DT_UNKNOWN);
  }
  const bool listed = errno == 0;
  closedir(dir);
  return listed;
}

// A folder on the way down: its identity, the entries left in it, its name in its parent.
struct Frame {
  dev_t dev;
  ino_t ino;
  Entries left;
  std::string name;
};

// Removes everything below the folder open at `fd` (closed here), depth first, last listed first, as
// Python's walk did: one descriptor open at a time and no recursion, whatever the depth (a neighbour may
// plant a chain thousands deep); back up by `..`, checked to be the folder it came from.
bool empty(int fd) {
  std::vector<Frame> frames;
  auto enter = [&](std::string name) {
    struct stat st {};
    Frame f{0, 0, {}, std::move(name)};
    if (fstat(fd, &st) != 0 || !list(fd, f.left)) return false;
    f.dev = st.st_dev;
    f.ino = st.st_ino;
    frames.push_back(std::move(f));
    return true;
  };
  bool ok = enter("");
  while (ok) {
    Frame& at = frames.back();
    if (!at.left.empty()) {
      const auto [name, folder] = std::move(at.left.back());
      at.left.pop_back();
      if (folder) {
        const int child = openat(fd, name.c_str(), kFolder);
        if (child >= 0) {
          close(fd);
          fd = child;
          ok = enter(name);
          continue;
        }
        if (errno == ENOENT) continue;
        if (errno != ELOOP && errno != ENOTDIR) ok = false;  // else a link, or a file now: removed itself
        if (!ok) break;
      }
      ok = unlinkat(fd, name.c_str(), 0) == 0 || errno == ENOENT;
      continue;
    }
    if (frames.size() == 1) break;  // the top: its caller removes it
    const std::string name = std::move(at.name);
    frames.pop_back();
    const int up = openat(fd, "..", kFolder);
    close(fd);
    fd = up;
    struct stat st {};
    if (fd < 0 || fstat(fd, &st) != 0 || st.st_dev != frames.back().dev || st.st_ino != frames.back().ino) {
      ok = false;  // moved away meanwhile: left as it is
      break;
    }
    ok = unlinkat(fd, name.c_str(), AT_REMOVEDIR) == 0 || errno == ENOENT;
  }
  if (fd >= 0) close(fd);
  return ok;
}

}  // namespace

bool remove_tree(const std::string& root, const std::vector<std::string>& parts) noexcept {
  if (parts.empty()) return false;
  try {
    int fd = open(root.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    for (std::size_t i = 0; fd >= 0 && i + 1 < parts.size(); ++i) {
      const int next = openat(fd, parts[i].c_str(), kFolder);
      close(fd);
      fd = next;
    }
    if (fd < 0) return false;
    const char* last = parts.back().c_str();
    const int top = openat(fd, last, kFolder);
    const bool removed = top >= 0 && empty(top) && unlinkat(fd, last, AT_REMOVEDIR) == 0;
    close(fd);
    return removed;
  } catch (...) {  // a listing that cannot be held in memory: not removed
    return false;
  }
}

}  // namespace ds
