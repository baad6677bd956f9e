#include "crc32c.hpp"

#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace ds {
namespace {

constexpr std::uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial

struct Tables {
  std::uint32_t t[8][256];
  std::uint32_t x2n[32];  // x^(2^n) mod P, for combine
};

// a*b mod P in the reflected representation (zlib's multmodp).
std::uint32_t multmodp(std::uint32_t a, std::uint32_t b) {
  std::uint32_t m = 1u << 31, p = 0;
  for (;;) {
    if (a & m) {
      p ^= b;
      if ((a & (m - 1)) == 0) break;
    }
    m >>= 1;
    b = b & 1 ? (b >> 1) ^ kPoly : b >> 1;
  }
  return p;
}

Tables make_tables() {
  Tables tb{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = c & 1 ? (c >> 1) ^ kPoly : c >> 1;
    tb.t[0][i] = c;
  }
  for (int s = 1; s < 8; ++s)
    for (int i = 0; i < 256; ++i) tb.t[s][i] = (tb.t[s - 1][i] >> 8) ^ tb.t[0][tb.t[s - 1][i] & 0xff];
  std::uint32_t p = 1u << 30;  // x^1
  tb.x2n[0] = p;
  for (int n = 1; n < 32; ++n) tb.x2n[n] = p = multmodp(p, p);
  return tb;
}

const Tables& tables() {
  static const Tables tb = make_tables();
  return tb;
}

// x^(n * 2^k) mod P
std::uint32_t x2nmodp(std::size_t n, unsigned k) {
  std::uint32_t p = 1u << 31;  // x^0
  while (n) {
    if (n & 1) p = multmodp(tables().x2n[k & 31], p);
    n >>= 1;
    ++k;
  }
  return p;
}

// Slicing-by-8 on the raw (pre-inverted) register.
std::uint32_t sw_update(std::uint32_t c, const unsigned char* p, std::size_t n) {
  const auto& t = tables().t;
  while (n >= 8) {
    std::uint64_t w;
    std::memcpy(&w, p, 8);
    w ^= c;
    c = t[7][w & 0xff] ^ t[6][(w >> 8) & 0xff] ^ t[5][(w >> 16) & 0xff] ^ t[4][(w >> 24) & 0xff] ^
        t[3][(w >> 32) & 0xff] ^ t[2][(w >> 40) & 0xff] ^ t[1][(w >> 48) & 0xff] ^ t[0][w >> 56];
    p += 8;
    n -= 8;
  }
  while (n--) c = (c >> 8) ^ t[0][(c ^ *p++) & 0xff];
  return c;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) std::uint32_t hw_update(std::uint32_t c, const unsigned char* p,
                                                          std::size_t n) {
  std::uint64_t c64 = c;
  while (n >= 8) {
    std::uint64_t w;
    std::memcpy(&w, p, 8);
    c64 = __builtin_ia32_crc32di(c64, w);
    p += 8;
    n -= 8;
  }
  c = static_cast<std::uint32_t>(c64);
  while (n--) c = __builtin_ia32_crc32qi(c, *p++);
  return c;
}

// The combine constant for lanes of `lane` bytes, kept per thread: sums of equal lengths (blocks, chunks)
// repeat it.
std::uint32_t lane_shift(std::size_t lane) {
  thread_local std::size_t last_lane = 0;
  thread_local std::uint32_t last_shift = 0;
  if (lane != last_lane) {
    last_shift = x2nmodp(lane, 3);
    last_lane = lane;
  }
  return last_shift;
}

// Three lanes of `lane` bytes summed side by side (a, b, c: their raw registers). kStore: each 8-byte word
// summed is also stored at dst, non-temporally: the copy costs no read of dst's lines, and what is summed
// is exactly what is stored, whatever happens to src meanwhile.
template <bool kStore>
__attribute__((target("sse4.2"))) void crc_lanes(std::uint64_t& a, std::uint64_t& b, std::uint64_t& c,
                                                 const unsigned char* p, std::size_t lane,
                                                 unsigned char* dst) {
  const unsigned char *pa = p, *pb = p + lane, *pc = p + 2 * lane;
  for (std::size_t i = 0; i < lane; i += 8) {
    std::uint64_t wa, wb, wc;
    std::memcpy(&wa, pa + i, 8);
    std::memcpy(&wb, pb + i, 8);
    std::memcpy(&wc, pc + i, 8);
    a = __builtin_ia32_crc32di(a, wa);
    b = __builtin_ia32_crc32di(b, wb);
    c = __builtin_ia32_crc32di(c, wc);
    if constexpr (kStore) {
      _mm_stream_si64(reinterpret_cast<long long*>(dst + i), static_cast<long long>(wa));
      _mm_stream_si64(reinterpret_cast<long long*>(dst + lane + i), static_cast<long long>(wb));
      _mm_stream_si64(reinterpret_cast<long long*>(dst + 2 * lane + i), static_cast<long long>(wc));
    }
  }
}

// Three independent streams hide the instruction's 3-cycle latency; the results are joined with combine.
// With `dst`, the bytes are also copied there (crc_lanes<true>, then the tail), and the tail summed from dst.
__attribute__((target("sse4.2"))) std::uint32_t hw_crc3(std::uint32_t crc, const unsigned char* p,
                                                        std::size_t n, unsigned char* dst = nullptr) {
  const std::size_t lane = n / 24 * 8;  // bytes per lane, a multiple of 8
  std::uint64_t a = ~crc & 0xffffffffu, b = 0xffffffffu, c = 0xffffffffu;
  if (dst) {
    crc_lanes<true>(a, b, c, p, lane, dst);
  } else {
    crc_lanes<false>(a, b, c, p, lane, nullptr);
  }
  std::uint32_t ca = ~static_cast<std::uint32_t>(a), cb = ~static_cast<std::uint32_t>(b),
                cc = ~static_cast<std::uint32_t>(c);
  const std::uint32_t shift = lane_shift(lane);
  std::uint32_t r = multmodp(shift, multmodp(shift, ca) ^ cb) ^ cc;
  const std::size_t done = 3 * lane;
  if (dst) {
    std::memcpy(dst + done, p + done, n - done);  // the tail, summed from dst
    return ~hw_update(~r, dst + done, n - done);
  }
  return ~hw_update(~r, p + done, n - done);
}

bool have_sse42() {
  static const bool yes = __builtin_cpu_supports("sse4.2");
  return yes;
}
#endif

}  // namespace

std::uint32_t crc32c(std::uint32_t crc, const void* data, std::size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
#if defined(__x86_64__)
  if (have_sse42()) {
    if (n >= 4096) return hw_crc3(crc, p, n);
    return ~hw_update(~crc, p, n);
  }
#endif
  return ~sw_update(~crc, p, n);
}

std::uint32_t crc32c_copy(std::uint32_t crc, void* dst, const void* src, std::size_t n) {
  auto* d = static_cast<unsigned char*>(dst);
  const auto* s = static_cast<const unsigned char*>(src);
#if defined(__x86_64__)
  if (have_sse42() && n >= 4096) {
    const std::size_t head = (8 - reinterpret_cast<std::uintptr_t>(d) % 8) % 8;  // to an aligned dst
    std::memcpy(d, s, head);
    crc = crc32c(crc, d, head);
    crc = hw_crc3(crc, s + head, n - head, d + head);
    _mm_sfence();  // the streamed stores are visible before anyone (a DMA engine) reads dst
    return crc;
  }
#endif
  std::memcpy(d, s, n);
  return crc32c(crc, d, n);
}

std::uint32_t crc32c_combine(std::uint32_t crc_a, std::uint32_t crc_b, std::size_t len_b) {
  return multmodp(x2nmodp(len_b, 3), crc_a) ^ crc_b;
}

}  // namespace ds
