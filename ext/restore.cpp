#include "restore.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <mutex>

#include "common.hpp"
#include "copy.hpp"
#include "crc32c.hpp"
#include "reader.hpp"

namespace ds {
namespace {

struct Slice {
  std::size_t tensor;
  std::uint64_t offset;  // in the file
  std::size_t len;
  char* dst;
  int device;
};

struct Shared {
  std::mutex mu;
  std::condition_variable cv;
  std::size_t groups_left = 0;
  Error error;
  bool failed = false;

  void fail(Error e) {
    std::lock_guard<std::mutex> lock(mu);
    if (!failed) error = std::move(e);
    failed = true;
  }
  bool has_failed() {
    std::lock_guard<std::mutex> lock(mu);
    return failed;
  }
};

Error io_error(int err, const std::string& path) {
  if (err == ENODATA) return Error::value("file ended before the end of its data section (truncated?)", path);
  return Error::os(err, "reading", path);
}

void read_group(int fd, const std::string& path, std::vector<Slice>& slices, std::size_t begin,
                std::size_t end, std::vector<std::uint32_t>& sums, const RestoreOptions& opts,
                HostCache& cache, Shared& shared) {
  std::vector<ReadRange> batch;
  std::vector<std::size_t> batch_ids;
  auto flush_host_batch = [&]() -> bool {
    if (batch.empty()) return true;
    if (int err = read_ranges(fd, batch, opts.use_uring, opts.depth)) {
      shared.fail(io_error(err, path));
      return false;
    }
    if (opts.verify)
      for (std::size_t id : batch_ids) sums[id] = crc32c(0, slices[id].dst, slices[id].len);
    batch.clear();
    batch_ids.clear();
    return true;
  };
  for (std::size_t i = begin; i < end; ++i) {
    if (shared.has_failed()) return;
    Slice& s = slices[i];
    if (s.device < 0) {
      batch.push_back({s.dst, s.offset, s.len});
      batch_ids.push_back(i);
      if (batch.size() >= opts.depth && !flush_host_batch()) return;
      continue;
    }
    if (!flush_host_batch()) return;
    char* chunk = cache.acquire();
    // Split the chunk's read so that several requests are in flight.
    std::vector<ReadRange> parts;
    const std::size_t part = std::max<std::size_t>(kPage, align_up(s.len / opts.depth + 1, kPage));
    for (std::size_t o = 0; o < s.len; o += part)
      parts.push_back({chunk + o, s.offset + o, std::min(part, s.len - o)});
    Error err;
    if (int e = read_ranges(fd, parts, opts.use_uring, opts.depth)) err = io_error(e, path);
    if (!err && opts.verify) sums[i] = crc32c(0, chunk, s.len);
    if (!err) err = copy_to_device(s.device, s.dst, chunk, s.len);
    cache.release(chunk);
    if (err) {
      shared.fail(err);
      return;
    }
  }
  flush_host_batch();
}

}  // namespace

std::vector<std::uint32_t> restore_file(const std::string& path, const std::vector<RestoreTensor>& tensors,
                                        const RestoreOptions& opts, TaskPool& pool, HostCache& cache) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw ErrorException(Error::os(errno, "opening for restore", path));

  // Slices in file order; CUDA slices must fit a cache chunk.
  std::vector<std::size_t> order(tensors.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(),
            [&](std::size_t a, std::size_t b) { return tensors[a].offset < tensors[b].offset; });
  std::vector<Slice> slices;
  std::size_t total = 0;
  for (std::size_t t : order) {
    const RestoreTensor& rt = tensors[t];
    const std::size_t step =
        rt.device >= 0 ? std::min(opts.read_bytes, cache.chunk_bytes()) : opts.read_bytes;
    for (std::size_t o = 0; o < rt.nbytes; o += step)
      slices.push_back({t, rt.offset + o, std::min(step, rt.nbytes - o), rt.dst + o, rt.device});
    total += rt.nbytes;
  }

  // Contiguous groups of about equal bytes, one per parser thread.
  const std::size_t ngroups = std::max<std::size_t>(1, std::min<std::size_t>(pool.size(), slices.size()));
  std::vector<std::size_t> bounds{0};
  std::size_t acc = 0, g = 1;
  for (std::size_t i = 0; i < slices.size() && g < ngroups; ++i) {
    acc += slices[i].len;
    if (acc >= total * g / ngroups) {
      bounds.push_back(i + 1);
      ++g;
    }
  }
  bounds.push_back(slices.size());

  std::vector<std::uint32_t> sums(slices.size(), 0);
  Shared shared;
  shared.groups_left = bounds.size() - 1;
  for (std::size_t k = 0; k + 1 < bounds.size(); ++k) {
    const std::size_t b = bounds[k], e = bounds[k + 1];
    pool.submit([&, b, e] {
      try {
        read_group(fd, path, slices, b, e, sums, opts, cache, shared);
      } catch (const std::exception& ex) {
        shared.fail(Error::internal(std::string("restore failed: ") + ex.what()));
      }
      std::lock_guard<std::mutex> lock(shared.mu);
      if (--shared.groups_left == 0) shared.cv.notify_all();
    });
  }
  {
    std::unique_lock<std::mutex> lock(shared.mu);
    shared.cv.wait(lock, [&] { return shared.groups_left == 0; });
  }
  close(fd);
  if (shared.failed) throw ErrorException(shared.error);

  std::vector<std::uint32_t> crcs(tensors.size(), 0);
  if (opts.verify) {
    std::vector<bool> seen(tensors.size(), false);
    for (std::size_t i = 0; i < slices.size(); ++i) {
      const std::size_t t = slices[i].tensor;
      crcs[t] = seen[t] ? crc32c_combine(crcs[t], sums[i], slices[i].len) : sums[i];
      seen[t] = true;
    }
  }
  return crcs;
}

}  // namespace ds
