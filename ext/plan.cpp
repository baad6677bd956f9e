#include "plan.hpp"

#include <algorithm>
#include <cstring>

#include "common.hpp"

namespace ds {

void json_escape(std::string& out, const std::string& s) {
  static const char* hex = "0123456789abcdef";
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20) {
          out += "\\u00";
          out += hex[c >> 4];
          out += hex[c & 15];
        } else {
          out += static_cast<char>(c);
        }
    }
  }
}

namespace {

void put_string(std::string& out, const std::string& s) {
  out += '"';
  json_escape(out, s);
  out += '"';
}

constexpr std::size_t kMaxHeader = 100'000'000;  // safetensors refuses larger headers

// The header's first 8 bytes: the length of the JSON after them (the rest of `header`), little-endian.
void write_header_length(std::string& header) {
  const std::uint64_t hlen = header.size() - 8;
  for (int b = 0; b < 8; ++b) header[b] = static_cast<char>((hlen >> (8 * b)) & 0xff);
}

}  // namespace

Layout plan_layout(const std::vector<TensorSrc>& tensors, const Metadata& metadata, bool checksums,
                   std::size_t block_bytes) {
  Layout L;
  const std::size_t n = tensors.size();
  L.order.resize(n);
  for (std::size_t i = 0; i < n; ++i) L.order[i] = i;
  std::stable_sort(L.order.begin(), L.order.end(),
                   [&](std::size_t a, std::size_t b) { return tensors[a].itemsize > tensors[b].itemsize; });
  L.offset.assign(n, 0);
  std::size_t pos = 0;
  for (std::size_t i : L.order) {
    L.offset[i] = pos;
    pos += tensors[i].nbytes;
  }
  const std::size_t data_bytes = pos;

  std::string j;
  j.reserve(64 + n * 96);
  j += "{\"__metadata__\":{";
  bool first = true;
  for (const auto& [k, v] : metadata) {
    if (k == kCrcKey || k == kBlockCrcKey) continue;  // ours to write
    if (!first) j += ',';
    first = false;
    put_string(j, k);
    j += ':';
    put_string(j, v);
  }
  if (checksums) {
    if (!first) j += ',';
    put_string(j, kCrcKey);
    j += ":\"";
    L.crc_pos = 8 + j.size();
    L.has_crc = true;
    j.append(8 * n, '0');
    j += '"';
    if (block_bytes) {
      std::size_t segments = 0;
      for (std::size_t i : L.order) segments += num_segments(L.offset[i], tensors[i].nbytes, block_bytes);
      j += ',';
      put_string(j, kBlockCrcKey);
      j += ":\"";
      j += std::to_string(block_bytes);
      j += ':';
      L.block_bytes = block_bytes;
      L.block_pos = 8 + j.size();
      j.append(8 * segments, '0');
      j += '"';
    }
  }
  j += '}';
  for (std::size_t i : L.order) {
    const TensorSrc& t = tensors[i];
    j += ',';
    put_string(j, t.name);
    j += ":{\"dtype\":";
    put_string(j, t.dtype);
    j += ",\"shape\":[";
    for (std::size_t d = 0; d < t.shape.size(); ++d) {
      if (d) j += ',';
      j += std::to_string(t.shape[d]);
    }
    j += "],\"data_offsets\":[";
    j += std::to_string(L.offset[i]);
    j += ',';
    j += std::to_string(L.offset[i] + t.nbytes);
    j += "]}";
  }
  j += '}';
  if (j.size() > kMaxHeader)
    throw ErrorException(Error::value("safetensors header of " + std::to_string(j.size()) +
                                      " bytes exceeds the format's 100 MB limit; split the state"));

  L.data_start = align_up(8 + j.size(), kPage);
  L.header.assign(L.data_start, ' ');
  write_header_length(L.header);
  std::memcpy(&L.header[8], j.data(), j.size());
  L.file_size = L.data_start + data_bytes;
  return L;
}

void pad_header(Layout& L, std::size_t data_start) {
  if (data_start <= L.data_start || data_start % kPage != 0) return;
  L.header.resize(data_start, ' ');
  write_header_length(L.header);
  L.file_size += data_start - L.data_start;
  L.data_start = data_start;
}

void patch_checksums(Layout& layout, const std::vector<std::uint32_t>& crcs,
                     const std::vector<std::vector<std::uint32_t>>& blocks) {
  if (!layout.has_crc) return;
  static const char* hex = "0123456789abcdef";
  char* p = &layout.header[layout.crc_pos];
  for (std::uint32_t c : crcs)
    for (int s = 28; s >= 0; s -= 4) *p++ = hex[(c >> s) & 15];
  if (!layout.block_bytes) return;
  p = &layout.header[layout.block_pos];
  for (const auto& tensor : blocks)
    for (std::uint32_t c : tensor)
      for (int s = 28; s >= 0; s -= 4) *p++ = hex[(c >> s) & 15];
}

}  // namespace ds
