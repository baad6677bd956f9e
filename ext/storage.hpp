// The storage seam: every file a save writes (its storage file, its mirror copy) and every file a restore
// reads is named, created, sized, published, removed and opened here, and nowhere else in the core. A target
// hands out plain descriptors: the flush workers write and fsync through them as IoOps (flush.hpp), the
// readers read them, restore maps them. POSIX is the first target (storage_posix.cpp); the memory tier's
// mirror files go through the same methods (tmpfs is a POSIX file system), opened with Access::Mapped.
//
// A new target implements Storage in its own file, declares its maker below, is listed in CMakeLists.txt,
// and the engine (engine.cpp) picks it. Errors are a positive errno: the callers name the step in their own
// words (the messages Python sees).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace ds {

// A file being written: a private temporary beside its final path until publish(), then the final path.
struct StorageFile {
  std::string path;     // the final path
  std::string temp;     // the temporary, where the bytes go until publish()
  std::string folder;   // the final path's folder
  int fd = -1;          // the temporary's descriptor (writes, its fsync); -1 once closed or handed on
  int folder_fd = -1;   // open_folder()'s descriptor: its fsync makes publish() durable
  bool direct = false;  // opened with O_DIRECT: writes of whole 4096-byte blocks, the tail cut by truncate()
  bool reused = false;  // create() renamed an earlier file onto the temporary: its blocks hold old bytes
  bool published = false;  // renamed onto `path`: discard() removes `path` then
};

// How open() opens a temporary.
enum class Access {
  Buffered,  // write-only, through the page cache
  Direct,    // write-only with O_DIRECT where the file system has it (tmpfs has not), else buffered
  Mapped,    // read-write for a shared mapping: owner-only (0600), never through a link
};

class Storage {
 public:
  virtual ~Storage() = default;

  // Names the temporary of a new file at `path` (`file->path`, `temp`, `folder`): a name no other save of
  // this or another process takes, beside the final path, so that publish() puts the whole file in place at
  // once. Makes the folder and its parents. Where `reuse` names an earlier file of this target's, it is
  // renamed onto the temporary (`file->reused`; gone or not renamed: a new file). Opens nothing. Returns 0
  // or the errno of making the folder.
  virtual int create(const std::string& path, StorageFile* file, const std::string& reuse = {}) = 0;

  // Opens the temporary (`file->fd`, `file->direct`): a new one, created exclusively, or the reused one
  // (Mapped only). Returns 0 or errno.
  virtual int open(StorageFile& file, Access access) = 0;

  // Sets the size of a file this target opened (`fd`): O_DIRECT's padding cut, a mapping's file sized.
  // Returns 0 or errno.
  virtual int truncate(int fd, std::uint64_t bytes) = 0;

  // Closes the file's descriptors (its temporary's, its folder's), each set to -1. Returns 0 or the first
  // errno (a close can be the first to report a failed write back).
  virtual int close(StorageFile& file) noexcept = 0;

  // Renames the temporary onto the final path, replacing what was there in one step; its descriptor, if
  // still open, stays valid. Returns 0 or errno.
  virtual int publish(StorageFile& file) = 0;

  // Opens the final path's folder (`file->folder_fd`): its fsync makes the rename of publish() durable.
  // Returns 0 or errno.
  virtual int open_folder(StorageFile& file) = 0;

  // Closes the file's descriptors and removes what it left: the temporary, or once published the final
  // path (renamed but not known to be durable, it must not look committed). Returns 0 or errno.
  virtual int discard(StorageFile& file) noexcept = 0;

  // A descriptor to read `path` from (the caller closes it), or -errno: a regular file only (anything else
  // EINVAL), never waiting on a FIFO, with O_DIRECT where `direct` and the file system has it. `same_as` >=
  // 0: a descriptor of that open file instead (the caller's, left open), whatever the path names now.
  virtual int open_read(const std::string& path, bool direct, int same_as = -1) = 0;

  // Whether the file's bytes are in memory already (tmpfs, ramfs): a mapping reaches them with no copy by the
  // kernel, and O_DIRECT means nothing.
  virtual bool in_memory(int fd) = 0;

  // Removes the folder root/parts[0]/.../parts[n-1] and everything in it (an old step's files): `root`
  // opened as given, every component below it and every folder inside opened from its parent's descriptor
  // without following a link (a link met inside is removed itself, never its target), entries last listed
  // first, what is gone already counted as removed; one descriptor open at a time, no recursion, any depth.
  // False at the first thing that cannot be removed (what is left stays): the folder missing or a link, an
  // entry the file system refuses to remove, a folder changed meanwhile (a file added, swapped for a link,
  // moved away while walked). `parts` are checked by the caller: no empty, `.`, `..` or `/`-holding part.
  virtual bool remove_tree(const std::string& root, const std::vector<std::string>& parts) noexcept = 0;

  // For each file (its path below `root` as parts, checked by the caller as for remove_tree; files in the
  // same folder next to each other), whether a save may take it over: a regular file of this user's with no
  // other name, reached without following a link. Each folder on the way is opened once for the files
  // beside each other in it (a 1.1B rank's weight files lie eight folders deep); `root` missing: none.
  virtual std::vector<std::uint8_t> takeable(const std::string& root,
                                             const std::vector<std::vector<std::string>>& files) noexcept = 0;
};

// The POSIX file system target (storage_posix.cpp); the engine holds one for its saves and restores.
std::shared_ptr<Storage> posix_storage();

}  // namespace ds
