// The POSIX target of the storage seam (storage.hpp): local file systems, tmpfs included (the memory tier's
// mirror files). A file is written under a dot-name beside its final path and renamed onto it; reads open
// regular files only.
#include <dirent.h>
#include <fcntl.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <utility>
#include <vector>

#include "storage.hpp"

namespace ds {
namespace {

// Process-wide, so that two engines of one process never name the same temporary.
std::atomic<std::uint64_t> g_seq{0};

// mkdir -p; returns 0 or errno.
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

// "<dir>/.<name>.dstmp.<pid>.<n>" for `path` = "<dir>/<name>"; `*dir` receives <dir>.
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

int close_fd(int* fd) {
  if (*fd < 0) return 0;
  const int r = ::close(*fd);
  *fd = -1;
  return r == 0 ? 0 : errno;
}

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
// trust.walk_tree walks: one descriptor open at a time and no recursion, whatever the depth (a neighbour
// may plant a chain thousands deep); back up by `..`, checked to be the folder it came from.
bool empty(int fd) {
  std::vector<Frame> frames;
  auto enter = [&](std::string name) {
    struct stat st{};
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
        if (errno != ELOOP && errno != ENOTDIR) {  // else a link, or a file now: removed itself below
          ok = false;
          break;
        }
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
    struct stat st{};
    if (fd < 0 || fstat(fd, &st) != 0 || st.st_dev != frames.back().dev || st.st_ino != frames.back().ino) {
      ok = false;  // moved away meanwhile: left as it is
      break;
    }
    ok = unlinkat(fd, name.c_str(), AT_REMOVEDIR) == 0 || errno == ENOENT;
  }
  if (fd >= 0) close(fd);
  return ok;
}

class PosixStorage final : public Storage {
 public:
  int create(const std::string& path, StorageFile* file, const std::string& reuse) override {
    file->path = path;
    file->temp = temporary_path(path, &file->folder);
    if (int e = make_dirs(file->folder)) return e;
    file->reused = !reuse.empty() && rename(reuse.c_str(), file->temp.c_str()) == 0;
    return 0;
  }

  int open(StorageFile& file, Access access) override {
    if (access == Access::Mapped) {
      const int flags = O_RDWR | O_CLOEXEC | O_NOFOLLOW | (file.reused ? 0 : O_CREAT | O_EXCL);
      file.fd = ::open(file.temp.c_str(), flags, 0600);
      return file.fd < 0 ? errno : 0;
    }
    const int flags = O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC;
    if (access == Access::Direct) {
      file.fd = ::open(file.temp.c_str(), flags | O_DIRECT, 0666);
      file.direct = file.fd >= 0;
      if (file.fd < 0 && errno != EINVAL) return errno;  // EINVAL: no O_DIRECT here (tmpfs); write buffered
    }
    if (file.fd < 0) file.fd = ::open(file.temp.c_str(), flags, 0666);
    return file.fd < 0 ? errno : 0;
  }

  int truncate(int fd, std::uint64_t bytes) override {
    return ftruncate(fd, static_cast<off_t>(bytes)) == 0 ? 0 : errno;
  }

  int close(StorageFile& file) noexcept override {
    const int e = close_fd(&file.fd);
    const int f = close_fd(&file.folder_fd);
    return e ? e : f;
  }

  int publish(StorageFile& file) override {
    if (rename(file.temp.c_str(), file.path.c_str()) != 0) return errno;
    file.published = true;
    return 0;
  }

  int open_folder(StorageFile& file) override {
    file.folder_fd = ::open(file.folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    return file.folder_fd < 0 ? errno : 0;
  }

  int discard(StorageFile& file) noexcept override {
    close(file);
    const std::string& left = file.published ? file.path : file.temp;
    if (left.empty()) return 0;
    return unlink(left.c_str()) == 0 ? 0 : errno;
  }

  // The path opened first as a mere handle (O_PATH: a FIFO or a device is never opened, no driver is
  // called), its type checked on it, then opened for reading through it: what is read is what was checked.
  // Anything but a regular file is EINVAL.
  int open_read(const std::string& path, bool direct, int same_as) override {
    if (same_as >= 0) return reopen_read(same_as, direct);
    const int handle = ::open(path.c_str(), O_PATH | O_CLOEXEC);
    if (handle < 0) return -errno;
    struct stat st{};
    int fd = -EINVAL;
    if (fstat(handle, &st) == 0 && S_ISREG(st.st_mode)) {
      fd = open_for_read("/proc/self/fd/" + std::to_string(handle), direct, 0);
      if (fd == -ENOENT) fd = reopen_by_path(path, direct, st);  // no /proc
    }
    ::close(handle);
    return fd;
  }

  bool remove_tree(const std::string& root, const std::vector<std::string>& parts) noexcept override {
    if (parts.empty()) return false;
    try {
      int fd = ::open(root.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
      for (std::size_t i = 0; fd >= 0 && i + 1 < parts.size(); ++i) {
        const int next = openat(fd, parts[i].c_str(), kFolder);
        ::close(fd);
        fd = next;
      }
      if (fd < 0) return false;
      const char* last = parts.back().c_str();
      const int top = openat(fd, last, kFolder);
      const bool removed = top >= 0 && empty(top) && unlinkat(fd, last, AT_REMOVEDIR) == 0;
      ::close(fd);
      return removed;
    } catch (...) {  // a listing that cannot be held in memory: not removed
      return false;
    }
  }

  std::vector<std::uint8_t> takeable(const std::string& root,
                                     const std::vector<std::vector<std::string>>& files) noexcept override {
    std::vector<std::uint8_t> out;
    // The folders open below root, outermost first (-1: refused). Every allocation comes before the first
    // descriptor is opened: nothing after it can throw.
    std::vector<std::pair<const std::string*, int>> folders;
    try {
      out.assign(files.size(), 0);
      std::size_t depth = 0;
      for (const auto& parts : files) depth = std::max(depth, parts.size());
      folders.reserve(depth);
    } catch (...) {
      return std::vector<std::uint8_t>();
    }
    const int top = ::open(root.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (top < 0) return out;
    const uid_t me = geteuid();
    for (std::size_t k = 0; k < files.size(); ++k) {
      const auto& parts = files[k];
      if (parts.empty()) continue;
      const std::size_t dirs = parts.size() - 1;
      std::size_t keep = 0;  // the folders open already on this file's way
      while (keep < std::min(folders.size(), dirs) && *folders[keep].first == parts[keep]) ++keep;
      for (; folders.size() > keep; folders.pop_back())
        if (folders.back().second >= 0) ::close(folders.back().second);
      for (std::size_t i = keep; i < dirs; ++i) {
        const int parent = folders.empty() ? top : folders.back().second;
        folders.emplace_back(&parts[i], parent >= 0 ? openat(parent, parts[i].c_str(), kFolder) : -1);
      }
      const int at = folders.empty() ? top : folders.back().second;
      struct stat st{};
      out[k] = at >= 0 && fstatat(at, parts.back().c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 &&
               S_ISREG(st.st_mode) && st.st_uid == me && st.st_nlink == 1;
    }
    for (const auto& folder : folders)
      if (folder.second >= 0) ::close(folder.second);
    ::close(top);
    return out;
  }

  bool in_memory(int fd) override {
    struct statfs s{};
    return fstatfs(fd, &s) == 0 && (s.f_type == TMPFS_MAGIC || s.f_type == RAMFS_MAGIC);
  }

 private:
  // `path` opened to read, with O_DIRECT where asked and the file system takes it; -errno on failure.
  static int open_for_read(const std::string& path, bool direct, int extra) {
    const int flags = O_RDONLY | O_CLOEXEC | extra;
    int fd = direct ? ::open(path.c_str(), flags | O_DIRECT) : -1;
    if (fd < 0 && (!direct || errno == EINVAL)) fd = ::open(path.c_str(), flags);  // EINVAL: no O_DIRECT
    return fd >= 0 ? fd : -errno;
  }

  // By path again, non-blocking (a FIFO swapped in since must not hold the open), refused unless it is the
  // file checked.
  static int reopen_by_path(const std::string& path, bool direct, const struct stat& checked) {
    const int fd = open_for_read(path, direct, O_NONBLOCK);
    if (fd < 0) return fd;
    struct stat st{};
    const int mode = fcntl(fd, F_GETFL);
    if (fstat(fd, &st) != 0 || st.st_dev != checked.st_dev || st.st_ino != checked.st_ino || mode < 0 ||
        fcntl(fd, F_SETFL, mode & ~O_NONBLOCK) != 0) {
      ::close(fd);
      return -EINVAL;
    }
    return fd;
  }

  // A descriptor of our own for the caller's open file `fd`: the same file, whatever the path names now.
  // With O_DIRECT, a new open of the same inode through /proc (O_DIRECT is per open file, and the caller's
  // must stay as it is); else, or where that fails, a duplicate.
  static int reopen_read(int fd, bool direct) {
    if (direct) {
      const std::string self = "/proc/self/fd/" + std::to_string(fd);
      const int own = ::open(self.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
      if (own >= 0) return own;
    }
    const int dup = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    return dup >= 0 ? dup : -errno;
  }
};

}  // namespace

std::shared_ptr<Storage> posix_storage() {
  return std::make_shared<PosixStorage>();
}

}  // namespace ds
