#include "restore.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <mutex>

#include "common.hpp"
#include "copy.hpp"
#include "crc32c.hpp"
#include "reader.hpp"

namespace ds {

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22  // Linux 5.14
#endif

FileMapping::FileMapping(int fd, std::size_t bytes, const std::string& path, bool read_only) : size_(bytes) {
  if (bytes == 0) return;
  void* p = fd < 0      ? mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
            : read_only ? mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0)
                        : mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
  if (p == MAP_FAILED) throw ErrorException(Error::os(errno, "mapping for restore", path));
  data_ = static_cast<char*>(p);
}

FileMapping::~FileMapping() {
  if (data_) munmap(data_, size_);
}

namespace {

// Faults in [p, p + n) of a file mapping (p page-aligned): the kernel reads the file, with readahead, into
// the page cache.
int populate(char* p, std::size_t n) {
  if (n == 0) return 0;
  if (madvise(p, n, MADV_POPULATE_READ) == 0) return 0;
  if (errno != EINVAL) return errno == EFAULT ? ENODATA : errno;  // EFAULT: past the end of the file
  volatile char sink = 0;                                         // kernels before 5.14: touch every page
  for (std::size_t o = 0; o < n; o += kPage) sink = sink + p[o];
  return 0;
}

// Reads [offset, offset + n) of the file into p: ENODATA where it ends first.
int read_at(int fd, char* p, std::uint64_t offset, std::size_t n) {
  while (n > 0) {
    const ssize_t got = pread(fd, p, n, static_cast<off_t>(offset));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) return errno;
    if (got == 0) return ENODATA;
    p += got;
    offset += static_cast<std::uint64_t>(got);
    n -= static_cast<std::size_t>(got);
  }
  return 0;
}

// Whether a user other than this one (root aside) may change or shorten the file: its bytes are then read
// into memory of the process's own, never mapped (a mapping would follow a change made after the checks,
// and touching it past a new end is a SIGBUS).
bool others_may_write(int fd) {
  struct stat st {};
  return fstat(fd, &st) != 0 || st.st_uid != geteuid() || (st.st_mode & (S_IWGRP | S_IWOTH)) != 0;
}

// Asks the kernel to read [offset, offset + n) of the file into the page cache, so that faulting those pages
// in finds them there and does not read around them (a fault reads read_ahead_kb, often megabytes, centred
// on the page). In steps of 2 MiB: one POSIX_FADV_WILLNEED reads at most the device's readahead size.
void read_ahead(int fd, std::uint64_t offset, std::size_t n) {
  constexpr std::size_t kStep = 2u << 20;
  for (std::size_t o = 0; o < n; o += kStep)
    posix_fadvise(fd, static_cast<off_t>(offset + o), static_cast<off_t>(std::min(kStep, n - o)),
                  POSIX_FADV_WILLNEED);
}

struct Restore {
  Restore(const std::string& path_, std::uint64_t data_start_, std::uint64_t data_len_,
          const std::vector<RestoreSpan>& spans_, bool to_device_, std::size_t piece_,
          const RestoreOptions& opts_, HostCache& cache_)
      : path(path_),
        data_start(data_start_),
        data_len(data_len_),
        base(align_down(data_start_, kPage)),
        file_end(data_start_ + data_len_),
        piece(piece_),
        spans(spans_),
        opts(opts_),
        to_device(to_device_),
        cache(cache_) {
    order.resize(spans.size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
    // By begin, then end: an empty span sorts before the span that starts where it is, so that the ends
    // rise with the order, which the binary search for the spans of a piece needs.
    std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
      return spans[a].begin != spans[b].begin ? spans[a].begin < spans[b].begin : spans[a].end < spans[b].end;
    });
    first_piece.resize(spans.size());
    parts.resize(spans.size());
    for (std::size_t i = 0; i < spans.size(); ++i) {
      if (spans[i].end <= spans[i].begin) continue;
      first_piece[i] = (data_start + spans[i].begin - base) / piece;
      const std::size_t last = (data_start + spans[i].end - 1 - base) / piece;
      parts[i].assign(last - first_piece[i] + 1, 0);
    }
  }

  std::size_t num_pieces() const { return data_len ? (file_end - base + piece - 1) / piece : 0; }

  // Each piece's sums folded into one CRC per span.
  std::vector<std::uint32_t> combine() const {
    std::vector<std::uint32_t> crcs(spans.size(), 0);
    for (std::size_t s = 0; s < spans.size(); ++s) {
      for (std::size_t j = 0; j < parts[s].size(); ++j) {
        const std::uint64_t lo = std::max(piece_lo(first_piece[s] + j), data_start + spans[s].begin);
        const std::uint64_t hi = std::min(piece_lo(first_piece[s] + j) + piece, data_start + spans[s].end);
        crcs[s] = j == 0 ? parts[s][0] : crc32c_combine(crcs[s], parts[s][j], hi - lo);
      }
    }
    return crcs;
  }

  const std::string& path;
  int fd = -1;
  const std::uint64_t data_start, data_len;
  const std::uint64_t base;      // file offset of piece 0: data_start rounded down to a block
  const std::uint64_t file_end;  // data_start + data_len
  const std::size_t piece;       // bytes per piece (a multiple of 4096)
  const std::vector<RestoreSpan>& spans;
  std::vector<std::size_t> order;  // span indices by begin
  std::vector<std::size_t> first_piece;
  std::vector<std::vector<std::uint32_t>> parts;  // per span: CRC of its bytes in each piece it spans
  const RestoreOptions& opts;
  const bool to_device;
  char* host = nullptr;       // host mode: the file mapping (file offset x at host + x)
  bool host_copy = false;     // host mode: `host` is memory of ours that the file's bytes are read into
  char* memory = nullptr;     // device mode, from a file in memory: its read-only shared mapping
  bool part_of_file = false;  // some pieces are not read
  HostCache& cache;

  std::mutex mu;
  std::condition_variable cv;
  std::size_t groups_left = 0;
  Error error;

  void fail(Error e) {
    std::lock_guard<std::mutex> lock(mu);
    if (!error) error = std::move(e);
  }
  bool failed() {
    std::lock_guard<std::mutex> lock(mu);
    return static_cast<bool>(error);
  }

  std::uint64_t piece_lo(std::size_t i) const { return base + i * piece; }

  // The first span (in `order`) that ends after file offset `lo`.
  std::vector<std::size_t>::const_iterator first_span_after(std::uint64_t lo) const {
    return std::partition_point(order.begin(), order.end(),
                                [&](std::size_t s) { return data_start + spans[s].end <= lo; });
  }

  // Whether any span has bytes in piece i.
  bool reaches(std::size_t i) const {
    const std::uint64_t lo = piece_lo(i), hi = lo + piece;
    for (auto it = first_span_after(lo); it != order.end() && data_start + spans[*it].begin < hi; ++it) {
      if (spans[*it].end > spans[*it].begin) return true;
    }
    return false;
  }

  // The pages of piece i that the spans cover, as runs of whole pages (the memory of piece i starts at
  // `mem`): block-aligned lengths to request, and the bytes that must arrive (the file may end inside the
  // last block). None where no span reaches into the piece: reading some tensors, or ranges of them, reads
  // their pages only.
  std::vector<ReadRange> runs(std::size_t i, char* mem) const {
    const std::uint64_t lo = piece_lo(i), hi = lo + piece, stop = align_up(file_end, kPage);
    std::vector<ReadRange> out;
    for (auto it = first_span_after(lo); it != order.end() && data_start + spans[*it].begin < hi; ++it) {
      if (spans[*it].end <= spans[*it].begin) continue;
      const std::uint64_t a = align_down(std::max(lo, data_start + spans[*it].begin), kPage);
      const std::uint64_t b =
          std::min<std::uint64_t>({align_up(std::min(hi, data_start + spans[*it].end), kPage), hi, stop});
      if (!out.empty() && a <= out.back().offset + out.back().len) {
        out.back().len = std::max<std::uint64_t>(out.back().len, b - out.back().offset);
      } else {
        out.push_back({mem + (a - lo), a, static_cast<std::size_t>(b - a), 0});
      }
    }
    for (ReadRange& r : out)
      r.need = static_cast<std::size_t>(std::min<std::uint64_t>(r.offset + r.len, file_end) - r.offset);
    return out;
  }

  Error io_error(int err) const {
    if (err == ENODATA)
      return Error::value("file ended before the end of its data section (truncated?)", path);
    return Error::os(err, "reading", path);
  }

  // Sums (and, to a device, delivers) every span's bytes in piece i, whose file bytes are at `mem`. With a
  // `stage` (pinned, a piece long), the bytes are copied there first and summed and uploaded from there:
  // what is summed is what is uploaded.
  Error scatter(std::size_t i, const char* mem, char* stage, DeviceUploader* up) {
    const std::uint64_t lo = piece_lo(i), hi = lo + piece;
    for (auto it = first_span_after(lo); it != order.end() && data_start + spans[*it].begin < hi; ++it) {
      const RestoreSpan& sp = spans[*it];
      const std::uint64_t b = std::max(lo, data_start + sp.begin), e = std::min(hi, data_start + sp.end);
      if (e <= b) continue;
      const char* src = mem + (b - lo);
      std::uint32_t& sum = parts[*it][i - first_piece[*it]];
      if (stage) {
        char* st = stage + (b - lo);
        if (opts.verify) {
          sum = crc32c_copy(0, st, src, e - b);
        } else {
          std::memcpy(st, src, e - b);
        }
        src = st;
      } else if (opts.verify) {
        sum = crc32c(0, src, e - b);
      }
      if (!up) continue;
      char* dst = sp.dst + (b - data_start - sp.begin);
      if (sp.device < 0) {
        std::memcpy(dst, src, e - b);  // a host destination (the stress test's; GPU restores have none)
      } else if (Error err = up->copy(sp.device, dst, src, e - b)) {
        return err;
      }
    }
    return {};
  }

  // Pieces todo[pb, pe).
  void run_group(const std::vector<std::size_t>& todo, std::size_t pb, std::size_t pe) {
    if (!to_device) {
      for (std::size_t k = pb; k < pe && !failed(); ++k) {
        const std::size_t j = todo[k];
        for (const ReadRange& r : runs(j, host + piece_lo(j))) {
          if (host_copy) {
            if (int err = read_at(fd, r.dst, r.offset, r.need)) return fail(io_error(err));
            continue;
          }
          // Part of the file: its pages asked for first (a whole file is faulted in, readahead helping).
          if (part_of_file || r.len < piece) read_ahead(fd, r.offset, r.need);
          if (int err = populate(r.dst, r.need)) return fail(io_error(err));
        }
        scatter(j, host + piece_lo(j), nullptr, nullptr);
      }
      return;
    }
    if (memory) return run_group_from_memory(todo, pb, pe);
    DeviceUploader up;
    for (std::size_t k = pb; k < pe && !failed(); ++k) {
      const std::size_t i = todo[k];
      char* chunk = cache.acquire();
      // One piece per chunk, its covered pages read as several block-aligned requests in flight.
      const std::vector<ReadRange> covered = runs(i, chunk);
      std::size_t total = 0;
      for (const ReadRange& r : covered) total += r.len;
      const std::size_t part = align_up(total / opts.depth + 1, kPage);
      std::vector<ReadRange> parts_of_piece;
      for (const ReadRange& r : covered) {
        for (std::size_t o = 0; o < r.len; o += part) {
          const std::size_t len = std::min(part, r.len - o);
          const std::size_t need = r.need > o ? std::min(len, r.need - o) : 0;
          parts_of_piece.push_back({r.dst + o, r.offset + o, len, need});
        }
      }
      Error err;
      if (int e = read_ranges(fd, parts_of_piece, opts.use_uring, opts.depth)) err = io_error(e);
      if (!err) err = scatter(i, chunk, nullptr, &up);
      if (Error e = up.finish(); e && !err) err = e;
      cache.release(chunk);
      if (err) return fail(err);
    }
  }

  // Device mode, from a file in memory (the memory tier): no read(2). Each piece's pages are mapped in, its
  // bytes copied (and summed) into one half of a pinned chunk and uploaded from there while the next piece
  // fills the other half. Pieces are half a chunk.
  void run_group_from_memory(const std::vector<std::size_t>& todo, std::size_t pb, std::size_t pe) {
    char* chunk = cache.acquire();
    const int halves = cache.chunk_bytes() >= 2 * piece ? 2 : 1;
    DeviceUploader up[2] = {DeviceUploader(0), DeviceUploader(1)};
    Error err;
    for (std::size_t k = pb; k < pe && !err && !failed(); ++k) {
      const std::size_t i = todo[k];
      const int h = static_cast<int>(k % halves);
      if ((err = up[h].wait())) break;  // that half's previous upload is done: it may be overwritten
      for (const ReadRange& r : runs(i, memory + piece_lo(i))) {
        if (int e = populate(r.dst, r.need)) {
          err = io_error(e);
          break;
        }
      }
      if (!err) err = scatter(i, memory + piece_lo(i), chunk + h * piece, &up[h]);
      if (Error e = up[h].mark(); e && !err) err = e;
    }
    for (DeviceUploader& u : up) {
      if (Error e = u.finish(); e && !err) err = e;  // always, before the chunk goes back
    }
    cache.release(chunk);
    if (err) fail(err);
  }
};

}  // namespace

RestoreResult restore_file(const std::string& path, std::uint64_t data_start, std::uint64_t data_len,
                           const std::vector<RestoreSpan>& spans, bool to_device, const RestoreOptions& opts,
                           TaskPool& pool, HostCache& cache, Storage& storage, int fd) {
  const bool direct = to_device && opts.direct_io;
  const int own = storage.open_read(path, direct, fd);
  if (own < 0) throw ErrorException(Error::os(-own, "opening for restore", path));
  const bool from_memory = to_device && opts.map_memory_files && storage.in_memory(own);
  if (from_memory) {
    // Touching a mapping past the end of its file is SIGBUS, not an error: a short file is refused here (the
    // tier's folder is private, so only its own user could shorten a file while it is read).
    struct stat st {};
    const bool ok = fstat(own, &st) == 0;
    const int err = errno;
    if (!ok || static_cast<std::uint64_t>(st.st_size) < data_start + data_len) {
      close(own);
      throw ErrorException(
          ok ? Error::value("file ended before the end of its data section (truncated?)", path)
             : Error::os(err, "stat for restore", path));
    }
  }
  std::size_t piece = std::max(kPage, align_up(opts.read_bytes, kPage));
  if (to_device)
    piece = from_memory ? std::max(kPage, align_down(cache.chunk_bytes() / 2, kPage)) : cache.chunk_bytes();
  Restore r(path, data_start, data_len, spans, to_device, piece, opts, cache);
  r.fd = own;
  RestoreResult out;
  std::unique_ptr<FileMapping> memory;  // from_memory: the shared mapping, unmapped when done
  try {
    if (from_memory) {
      memory = std::make_unique<FileMapping>(r.fd, r.file_end, path, /*read_only=*/true);
      r.memory = memory->data();
    } else if (!to_device) {
      r.host_copy = others_may_write(r.fd);
      out.mapping = std::make_unique<FileMapping>(r.host_copy ? -1 : r.fd, r.file_end, path);
      r.host = out.mapping->data();
    }
  } catch (...) {
    close(r.fd);
    throw;
  }
  std::vector<std::size_t> todo;  // the pieces some span reaches into
  for (std::size_t i = 0; i < r.num_pieces(); ++i) {
    if (r.reaches(i)) todo.push_back(i);
  }
  r.part_of_file = todo.size() < r.num_pieces();
  const std::size_t n = todo.size();
  if (n > 0) {
    // Contiguous runs of pieces, one per parser thread; the calling thread, which would only wait, runs the
    // first: a small file (one piece) never queues behind a large restore that keeps the pool busy.
    const std::size_t groups = std::min<std::size_t>(pool.size(), n);
    r.groups_left = groups;
    auto run = [&r, &todo, n, groups](std::size_t g) {
      try {
        r.run_group(todo, n * g / groups, n * (g + 1) / groups);
      } catch (const ErrorException& ex) {
        r.fail(ex.error);
      } catch (const std::exception& ex) {
        r.fail(Error::internal(std::string("restore failed: ") + ex.what()));
      }
      std::lock_guard<std::mutex> lock(r.mu);
      if (--r.groups_left == 0) r.cv.notify_all();
    };
    for (std::size_t g = 1; g < groups; ++g) pool.submit([run, g] { run(g); });
    run(0);
    std::unique_lock<std::mutex> lock(r.mu);
    r.cv.wait(lock, [&] { return r.groups_left == 0; });
  }
  close(r.fd);  // a mapping stays valid without its descriptor
  if (r.error) throw ErrorException(r.error);
  if (opts.verify) out.crcs = r.combine();
  return out;
}

}  // namespace ds
