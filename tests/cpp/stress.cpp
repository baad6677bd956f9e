// Stress test of the core, built with AddressSanitizer or ThreadSanitizer (DATASTATES_SANITIZE) and run by
// tests/test_sanitizers.py. Several threads save random host states through a tiny cache (so every save
// streams with backpressure), on both flush backends; every file is read back with restore() and compared
// byte for byte; failures (an unwritable directory) are mixed in; engines are closed while saves are in
// flight. The POSIX storage target (storage.hpp) is checked alone first: names, publish, discard, reads.
//
// usage: ds_stress DIR [ROUNDS]     exit status 0 when every check passed
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "crc32c.hpp"
#include "engine.hpp"
#include "flush.hpp"
#include "storage.hpp"

namespace {

std::atomic<int> g_failures{0};

#define CHECK(cond, ...)                                 \
  do {                                                   \
    if (!(cond)) {                                       \
      std::fprintf(stderr, "CHECK failed: %s: ", #cond); \
      std::fprintf(stderr, __VA_ARGS__);                 \
      std::fprintf(stderr, "\n");                        \
      ++g_failures;                                      \
    }                                                    \
  } while (0)

struct State {
  std::vector<std::vector<char>> buffers;
  std::vector<ds::TensorSrc> tensors;
};

State make_state(std::mt19937_64& rng, int id) {
  State s;
  const int n = 1 + static_cast<int>(rng() % 12);
  for (int i = 0; i < n; ++i) {
    // Sizes from empty to several chunks, with unaligned tails.
    std::size_t bytes = rng() % 5 == 0 ? 0 : (rng() % (600 << 10)) * 4;
    std::vector<char> buf(bytes);
    for (auto& c : buf) c = static_cast<char>(rng());
    ds::TensorSrc t;
    t.name = "t" + std::to_string(id) + "_" + std::to_string(i);
    t.dtype = "F32";
    t.itemsize = 4;
    t.shape = {static_cast<std::int64_t>(bytes / 4)};
    t.strides = {1};
    t.nbytes = bytes;
    s.buffers.push_back(std::move(buf));
    s.tensors.push_back(t);
  }
  // One strided view (every other element of a buffer).
  std::vector<char> base(4 * 2 * 1000);
  for (auto& c : base) c = static_cast<char>(rng());
  ds::TensorSrc v;
  v.name = "strided" + std::to_string(id);
  v.dtype = "F32";
  v.itemsize = 4;
  v.shape = {1000};
  v.strides = {2};
  v.nbytes = 4000;
  v.contiguous = false;
  s.buffers.push_back(std::move(base));
  s.tensors.push_back(v);
  for (std::size_t i = 0; i < s.tensors.size(); ++i) s.tensors[i].data = s.buffers[i].data();
  return s;
}

State clone(const State& s) {
  State c = s;
  for (std::size_t i = 0; i < c.tensors.size(); ++i) c.tensors[i].data = c.buffers[i].data();
  return c;
}

// The bytes a tensor should have in the file.
std::vector<char> image_of(const ds::TensorSrc& t) {
  std::vector<char> out(t.nbytes);
  if (t.nbytes) ds::gather_host(t, 0, t.nbytes, out.data());
  return out;
}

// Reads the data offsets back from the header: "name":{"dtype":"F32","shape":[..],"data_offsets":[b,e]}.
bool find_offsets(const std::string& header, const std::string& name, std::size_t* b, std::size_t* e) {
  const std::string key = "\"" + name + "\":{";
  const auto p = header.find(key);
  if (p == std::string::npos) return false;
  const auto q = header.find("\"data_offsets\":[", p);
  return q != std::string::npos && std::sscanf(header.c_str() + q + 16, "%zu,%zu", b, e) == 2;
}

void verify_file(ds::Engine& engine, const std::string& path, const State& s) {
  FILE* f = std::fopen(path.c_str(), "rb");
  CHECK(f, "cannot open %s", path.c_str());
  if (!f) return;
  std::uint64_t n = 0;
  CHECK(std::fread(&n, 8, 1, f) == 1, "short header in %s", path.c_str());
  std::string header(n, ' ');
  CHECK(std::fread(&header[0], 1, n, f) == n, "short header in %s", path.c_str());
  std::fclose(f);
  CHECK((8 + n) % 4096 == 0, "data of %s starts at %llu", path.c_str(),
        static_cast<unsigned long long>(8 + n));

  struct stat st;
  stat(path.c_str(), &st);
  std::vector<ds::RestoreSpan> spans;
  for (const auto& t : s.tensors) {
    std::size_t b = 0, e = 0;
    CHECK(find_offsets(header, t.name, &b, &e), "%s lacks %s", path.c_str(), t.name.c_str());
    CHECK(e - b == t.nbytes, "%s: %s has %zu bytes", path.c_str(), t.name.c_str(), e - b);
    spans.push_back({b, e, nullptr, -1});
  }
  // Read once into a private mapping of the file, once through the cache's chunks (O_DIRECT) into host
  // buffers, as a restore to a GPU reads: chunks that concurrent saves and restores left full of other bytes
  // must never leak into a destination.
  std::vector<std::vector<char>> out(s.tensors.size());
  for (const bool chunked : {false, true}) {
    const char* how = chunked ? "chunked restore" : "restore";
    for (std::size_t i = 0; chunked && i < spans.size(); ++i) {
      out[i].assign(s.tensors[i].nbytes, '\x77');
      spans[i].dst = out[i].data();
    }
    ds::RestoreResult r;
    try {
      r = engine.restore(path, 8 + n, st.st_size - 8 - n, spans, chunked, true);
    } catch (const ds::ErrorException& ex) {
      CHECK(false, "%s of %s: %s", how, path.c_str(), ex.what());
      return;
    }
    for (std::size_t i = 0; i < s.tensors.size(); ++i) {
      const auto want = image_of(s.tensors[i]);
      const char* got = chunked ? out[i].data() : r.mapping->data() + 8 + n + spans[i].begin;
      CHECK(std::equal(want.begin(), want.end(), got), "%s of %s: bytes of %s differ", how, path.c_str(),
            s.tensors[i].name.c_str());
      CHECK(r.crcs[i] == ds::crc32c(0, want.data(), want.size()), "%s of %s: crc of %s", how, path.c_str(),
            s.tensors[i].name.c_str());
    }
  }
  // The middle third of every other tensor, as a reshard reads ranges: only the pages they cover are read,
  // into the mapping or through the chunks.
  std::vector<ds::RestoreSpan> some;
  std::vector<std::size_t> which;
  for (std::size_t i = 1; i < spans.size(); i += 2) {
    const std::size_t third = s.tensors[i].nbytes / 3;
    some.push_back({spans[i].begin + third, spans[i].begin + 2 * third, nullptr, -1});
    which.push_back(i);
  }
  for (const bool chunked : {false, true}) {
    for (std::size_t k = 0; chunked && k < some.size(); ++k) {
      out[k].assign(some[k].end - some[k].begin, '\x77');
      some[k].dst = out[k].data();
    }
    ds::RestoreResult r;
    try {
      r = engine.restore(path, 8 + n, st.st_size - 8 - n, some, chunked, true);
    } catch (const ds::ErrorException& ex) {
      CHECK(false, "ranges of %s: %s", path.c_str(), ex.what());
      return;
    }
    for (std::size_t k = 0; k < some.size(); ++k) {
      const auto whole = image_of(s.tensors[which[k]]);
      const std::size_t third = whole.size() / 3, len = some[k].end - some[k].begin;
      const char* got = chunked ? out[k].data() : r.mapping->data() + 8 + n + some[k].begin;
      CHECK(std::equal(whole.begin() + third, whole.begin() + third + len, got), "range of %s in %s differs",
            s.tensors[which[k]].name.c_str(), path.c_str());
      CHECK(r.crcs[k] == ds::crc32c(0, whole.data() + third, len), "crc of a range of %s in %s",
            s.tensors[which[k]].name.c_str(), path.c_str());
    }
  }
}

void round(const std::string& dir, const std::string& backend, int round_no) {
  ds::EngineOptions o;
  o.cache_bytes = 4 * 256 * 1024;  // four chunks of 256 KiB: every state streams
  o.chunk_bytes = 256 * 1024;
  o.parser_threads = 3;
  o.flush_threads = 2;
  o.queue_depth = 4;
  o.io_backend = backend;
  o.read_bytes = 300 * 1024;
  o.save.fsync = round_no % 2 == 0;
  ds::Engine engine(o);

  std::vector<std::thread> savers;
  for (int th = 0; th < 4; ++th) {
    savers.emplace_back([&, th] {
      std::mt19937_64 rng(round_no * 100 + th);
      for (int k = 0; k < 6; ++k) {
        const int id = th * 100 + k;
        State s = make_state(rng, id);
        const bool doomed = rng() % 7 == 0;  // a directory that cannot exist: a file is in the way
        const std::string path = doomed ? dir + "/blocker/x/f" + std::to_string(id) + ".safetensors"
                                        : dir + "/" + backend + "/r" + std::to_string(round_no) + "/f" +
                                              std::to_string(id) + ".safetensors";
        const State ref = clone(s);
        auto job = engine.save(path, s.tensors, {{"format", "pt"}}, {});
        job->wait_snapshot(-1);
        // After the snapshot the caller may mutate its tensors; the file must not change.
        for (auto& b : s.buffers) std::memset(b.data(), 0x5a, b.size());
        job->wait_persisted(-1);
        if (doomed) {
          CHECK(job->failed(), "save under a file should fail: %s", path.c_str());
          CHECK(job->error().os_errno == ENOTDIR, "errno %d", job->error().os_errno);
          continue;
        }
        CHECK(!job->failed(), "%s failed: %s", path.c_str(), job->error().message.c_str());
        verify_file(engine, path, ref);
      }
    });
  }
  // A last burst left in flight: close() must drain it.
  std::mt19937_64 rng(round_no);
  std::vector<State> tail;
  std::vector<std::shared_ptr<ds::SaveJob>> jobs;
  for (int k = 0; k < 5; ++k) {
    tail.push_back(make_state(rng, 900 + k));
    jobs.push_back(engine.save(
        dir + "/" + backend + "/tail" + std::to_string(round_no) + "_" + std::to_string(k) + ".safetensors",
        tail.back().tensors, {}, {}));
  }
  for (auto& t : savers) t.join();
  engine.close();
  engine.close();  // idempotent
  for (auto& j : jobs) CHECK(j->persisted_done() && !j->failed(), "tail job %s", j->path().c_str());
}

bool exists(const std::string& path) {
  struct stat st{};
  return lstat(path.c_str(), &st) == 0;
}

// The POSIX target on its own: a file written through it appears at its final path only when published;
// discard removes the temporary before, the final path after; two targets of one process never name the
// same temporary; reads open regular files only, and the caller's open file where one is given.
void storage_checks(const std::string& dir) {
  const auto a = ds::posix_storage(), b = ds::posix_storage();
  const std::string path = dir + "/storage/deep/er/file.bin";
  ds::StorageFile f, g;
  CHECK(a->create(path, &f) == 0 && b->create(path, &g) == 0, "create %s", path.c_str());
  CHECK(f.temp != g.temp && f.folder == dir + "/storage/deep/er", "temporaries %s %s", f.temp.c_str(),
        g.temp.c_str());
  CHECK(a->open(f, ds::Access::Direct) == 0 && f.fd >= 0, "open %s", f.temp.c_str());
  CHECK(b->open(g, ds::Access::Buffered) == 0 && !g.direct, "open %s", g.temp.c_str());
  CHECK(pwrite(g.fd, "abc", 3, 0) == 3 && b->truncate(g.fd, 2) == 0, "write and truncate %s", g.temp.c_str());
  CHECK(!exists(path) && exists(f.temp) && exists(g.temp), "only temporaries before publish");
  CHECK(b->close(g) == 0 && g.fd < 0 && b->publish(g) == 0 && exists(path) && !exists(g.temp), "publish");
  CHECK(b->open_folder(g) == 0 && g.folder_fd >= 0 && b->close(g) == 0 && g.folder_fd < 0, "open_folder");
  CHECK(a->discard(f) == 0 && !exists(f.temp) && exists(path) && f.fd < 0, "discard before publish");
  const int r = a->open_read(path, true);
  CHECK(r >= 0, "open_read %s: %d", path.c_str(), r);
  struct stat st{};
  CHECK(r >= 0 && fstat(r, &st) == 0 && st.st_size == 2, "the file published is the one written");
  const int same = a->open_read(dir + "/not-this-name", false, r);
  CHECK(same >= 0 && same != r, "open_read of an open file: %d", same);
  for (int fd : {r, same})
    if (fd >= 0) close(fd);
  CHECK(a->open_read(dir + "/storage", false) == -EINVAL, "a folder is not read");
  CHECK(a->open_read(dir + "/storage/missing", false) == -ENOENT, "a missing file");
  CHECK(b->discard(g) == 0 && !exists(path), "discard after publish removes the final path");
  // A mapped file reused by a later file's temporary: renamed, opened without creating.
  ds::StorageFile m, n;
  CHECK(a->create(path, &m) == 0 && a->open(m, ds::Access::Mapped) == 0 && a->publish(m) == 0, "mapped");
  CHECK(a->create(path, &n, path) == 0 && n.reused && !exists(path) && exists(n.temp), "reuse");
  CHECK(a->open(n, ds::Access::Mapped) == 0 && a->close(m) == 0 && a->discard(n) == 0 && !exists(n.temp),
        "reused file opened and discarded");
  ds::StorageFile blocked;
  CHECK(a->create(dir + "/blocker/x/y", &blocked) == ENOTDIR, "a file in the way of the folder");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s DIR [ROUNDS]\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 4;
  mkdir(dir.c_str(), 0777);
  FILE* blocker = std::fopen((dir + "/blocker").c_str(), "w");
  if (blocker) std::fclose(blocker);

  // CRC-32C known answer and combine.
  CHECK(ds::crc32c(0, "123456789", 9) == 0xE3069283u, "crc32c check value");
  std::vector<char> big(1 << 20);
  for (std::size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>(i * 7 + 3);
  const std::uint32_t whole = ds::crc32c(0, big.data(), big.size());
  const std::uint32_t a = ds::crc32c(0, big.data(), 12345),
                      b = ds::crc32c(0, big.data() + 12345, big.size() - 12345);
  CHECK(ds::crc32c_combine(a, b, big.size() - 12345) == whole, "crc32c_combine");
  storage_checks(dir);

  for (int r = 0; r < rounds; ++r)
    for (const char* backend : {"io_uring", "pwrite"})
      if (ds::built_with_io_uring() || std::string(backend) == "pwrite") round(dir, backend, r);
  if (g_failures) {
    std::fprintf(stderr, "%d check(s) failed\n", g_failures.load());
    return 1;
  }
  std::printf("stress: %d rounds on %s: all checks passed\n", rounds,
              ds::built_with_io_uring() ? "io_uring and pwrite" : "pwrite (built without io_uring)");
  if (!ds::built_with_io_uring()) std::printf("no io_uring: %s\n", ds::io_uring_absent_why());
  return 0;
}
