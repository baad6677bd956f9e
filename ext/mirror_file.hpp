// A save's mirror copy as its staging memory: the mirror file (a memory tier on tmpfs) is mapped shared and
// the save copies each piece straight into it, the flush workers write the storage file from it, and what
// remains when the save commits is the memory copy. No cache chunk and no second copy on the host.
//
// Mapping and page-locking many GiB costs seconds (0.25-0.4 s per GiB with 4 KiB pages), so a mapping is
// kept after its save (MirrorFiles) and recycled by a later save of the same file: the file is renamed to its
// new name and its pages, still pinned, take the new bytes. A new file's blocks are faulted in and pinned by
// a small pool ahead of the copies (MirrorFiles::prepare_in_background), or by the first copy that reaches
// one.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "common.hpp"
#include "storage.hpp"
#include "task_pool.hpp"

namespace ds {

class MirrorFile {
 public:
  // Takes `fd` (the file at `path`, opened by `storage` with Access::Mapped), checks it is a regular file of
  // this user's with one name, sizes it to `bytes` (a multiple of 4096) through `storage`, reserves its
  // memory (ENOSPC now, not a SIGBUS later) and maps it shared. Pins blocks through `pin_device`'s context
  // (-1: never): [0, origin), then `block` bytes each from `origin` on, so that a piece of the data section
  // (at origin + i * block) lies in one registration (a device copy into memory that spans two registrations
  // fails). Throws ErrorException naming the file, leaving `fd` to the caller; owns it once constructed.
  MirrorFile(Storage& storage, int fd, const std::string& path, std::size_t bytes, std::size_t block,
             std::size_t origin, int pin_device);
  ~MirrorFile();
  MirrorFile(const MirrorFile&) = delete;
  MirrorFile& operator=(const MirrorFile&) = delete;

  char* data() const { return base_; }
  std::size_t size() const { return bytes_; }
  std::size_t origin() const { return origin_; }
  // Faults in (and pins) the blocks that [offset, offset + len) touches, once each.
  void prepare(std::size_t offset, std::size_t len);
  // Block i, once (a copy that reaches it first waits for it, or does it).
  void prepare_block_once(std::size_t i);
  std::size_t blocks() const { return blocks_; }
  // The device whose context pins its blocks (-1: never pinned: a save of host memory only copies into it).
  int pin_device() const { return pin_device_; }
  // Whether `path` (reached without following a link at its end) is still this mapping's file.
  bool named(const std::string& path) const;
  // Why a save must not write into this kept mapping now that its file is at `path` (empty: it may): the
  // file, checked on the mapping's descriptor, is no longer a regular file of this user's with one name (a
  // hard link added since would receive the new bytes), or `path` names another file.
  Error reusable(const std::string& path) const;
  // Makes the file `file_bytes` long through `storage` (a recycled file was cut to its exact size within its
  // last page).
  Error resize(Storage& storage, std::size_t file_bytes, const std::string& path);

 private:
  void prepare_block(std::size_t i);
  std::size_t block_of(std::size_t offset) const;
  std::size_t block_start(std::size_t i) const;

  int fd_ = -1;
  char* base_ = nullptr;
  std::size_t bytes_ = 0;
  std::size_t block_ = 0;
  std::size_t origin_ = 0;
  std::size_t blocks_ = 0;
  int pin_device_ = -1;
  dev_t dev_ = 0;  // the file's identity, for `named`
  ino_t ino_ = 0;
  std::unique_ptr<std::once_flag[]> once_;
  std::unique_ptr<std::atomic<bool>[]> pinned_;
};

// The mirror mappings kept after their saves, by the path each file has now; a save recycling a file takes
// its mapping out. Thread-safe.
class MirrorFiles {
 public:
  // Threads that fault in and pin a new mapping's blocks ahead of the copies (several at once: one copy
  // thread alone would pin a 14.5 GB checkpoint's tmpfs pages for seconds). Null: the copies do it.
  void set_pool(TaskPool* pool) { pool_ = pool; }
  void prepare_in_background(const std::shared_ptr<MirrorFile>& file);
  std::shared_ptr<MirrorFile> take(const std::string& path);
  void put(const std::string& path, std::shared_ptr<MirrorFile> file);
  // Drops (unpins, unmaps) every mapping but those of `keep`; returns how many are kept.
  std::size_t keep_only(const std::vector<std::string>& keep);
  // Drops every mapping whose path no longer names its file (removed, or replaced); returns how many are
  // kept.
  std::size_t keep_named();
  void clear();

 private:
  // Drops every mapping `keep(path, file)` refuses; returns how many are kept.
  std::size_t keep_if(const std::function<bool(const std::string&, const MirrorFile&)>& keep);

  TaskPool* pool_ = nullptr;
  std::mutex mu_;
  std::unordered_map<std::string, std::shared_ptr<MirrorFile>> files_;
};

}  // namespace ds
