#include "checkpoint/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace bertshard::checkpoint {
namespace {

using nlohmann::json;

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exponent = (h >> 10) & 0x1f;
  uint32_t mantissa = h & 0x3ff;
  uint32_t bits;
  if (exponent == 0) {
    if (mantissa == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exponent = 127 - 15 + 1;
      while ((mantissa & 0x400) == 0) {
        mantissa <<= 1;
        --exponent;
      }
      mantissa &= 0x3ff;
      bits = sign | (exponent << 23) | (mantissa << 13);
    }
  } else if (exponent == 0x1f) {
    bits = sign | 0x7f800000 | (mantissa << 13);
  } else {
    bits = sign | ((exponent + 127 - 15) << 23) | (mantissa << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

float BFloatToFloat(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

void Convert(const uint8_t* src, DType dtype, int64_t count, float* out) {
  switch (dtype) {
    case DType::kF64:
      for (int64_t i = 0; i < count; ++i) {
        double d;
        std::memcpy(&d, src + 8 * i, 8);
        out[i] = static_cast<float>(d);
      }
      break;
    case DType::kF32:
      std::memcpy(out, src, static_cast<size_t>(count) * 4);
      break;
    case DType::kF16:
      for (int64_t i = 0; i < count; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        out[i] = HalfToFloat(h);
      }
      break;
    case DType::kBF16:
      for (int64_t i = 0; i < count; ++i) {
        uint16_t b;
        std::memcpy(&b, src + 2 * i, 2);
        out[i] = BFloatToFloat(b);
      }
      break;
    default:
      break;  // callers check IsFloating first
  }
}

absl::Status Bad(const std::string& path, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("safetensors file ", path, ": ", what));
}

}  // namespace

namespace {

struct DTypeName {
  absl::string_view name;
  DType dtype;
  int size;
};

constexpr DTypeName kDTypes[] = {
    {"F64", DType::kF64, 8},   {"F32", DType::kF32, 4},        {"F16", DType::kF16, 2},
    {"BF16", DType::kBF16, 2}, {"I64", DType::kI64, 8},        {"I32", DType::kI32, 4},
    {"I16", DType::kI16, 2},   {"I8", DType::kI8, 1},          {"U64", DType::kU64, 8},
    {"U32", DType::kU32, 4},   {"U16", DType::kU16, 2},        {"U8", DType::kU8, 1},
    {"BOOL", DType::kBool, 1}, {"F8_E4M3", DType::kF8E4M3, 1}, {"F8_E5M2", DType::kF8E5M2, 1},
};

absl::string_view DTypeString(DType dtype) {
  for (const auto& d : kDTypes) {
    if (d.dtype == dtype) return d.name;
  }
  return "?";
}

}  // namespace

absl::StatusOr<DType> ParseDType(absl::string_view name) {
  for (const auto& d : kDTypes) {
    if (d.name == name) return d.dtype;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("dtype ", name,
                   " is not a safetensors dtype (F64, F32, F16, BF16, I64, I32, I16, I8, U64, U32, "
                   "U16, U8, BOOL, F8_E4M3, F8_E5M2)"));
}

int DTypeSize(DType dtype) {
  for (const auto& d : kDTypes) {
    if (d.dtype == dtype) return d.size;
  }
  return 1;
}

bool IsFloating(DType dtype) {
  return dtype == DType::kF64 || dtype == DType::kF32 || dtype == DType::kF16 || dtype == DType::kBF16;
}

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  // O_NONBLOCK: a FIFO is refused below (not a regular file) instead of waiting for a writer.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) {
    return absl::NotFoundError(absl::StrCat("cannot open ", path, ": ", std::strerror(errno)));
  }
  auto file = OpenDescriptor(fd, path);
  ::close(fd);
  return file;
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::OpenDescriptor(int fd, const std::string& path) {
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) return Bad(path, "not a regular file");
  const size_t size = static_cast<size_t>(st.st_size);
  if (size < 8) return Bad(path, absl::StrCat("file is ", size, " bytes, shorter than the 8-byte header length"));
  void* map = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  if (map == MAP_FAILED) return absl::InternalError(absl::StrCat("cannot map ", path, ": ", std::strerror(errno)));
  const auto* bytes = static_cast<const uint8_t*>(map);
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | bytes[i];
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile(path, bytes, size, 8 + header_len));
  if (header_len > kMaxHeaderBytes) {
    return Bad(path, absl::StrCat("header length ", header_len, " exceeds the ", kMaxHeaderBytes, "-byte bound"));
  }
  if (header_len > size - 8) {
    return Bad(path, absl::StrCat("header length ", header_len, " runs past the end of the ", size,
                                  "-byte file (truncated?)"));
  }
  const json header = json::parse(bytes + 8, bytes + 8 + header_len, nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded() || !header.is_object()) return Bad(path, "header is not a JSON object");
  const uint64_t data_size = size - 8 - header_len;
  std::vector<const TensorInfo*> by_offset;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") continue;
    if (!entry.is_object() || !entry.contains("dtype") || !entry.contains("shape") || !entry.contains("data_offsets") ||
        !entry["dtype"].is_string() || !entry["shape"].is_array() || !entry["data_offsets"].is_array() ||
        entry["data_offsets"].size() != 2) {
      return Bad(path, absl::StrCat("tensor ", name, " needs dtype, shape and data_offsets [begin, end]"));
    }
    TensorInfo info;
    info.name = name;
    auto dtype = ParseDType(entry["dtype"].get<std::string>());
    if (!dtype.ok()) return Bad(path, absl::StrCat("tensor ", name, ": ", dtype.status().message()));
    info.dtype = *dtype;
    // Each dimension is checked before any product is formed, and the product is formed with an
    // overflow check: a wrapped element count (e.g. [2^32, 2^32] -> 0) could match a small byte
    // range and send ReadSlice far outside the mapping. Messages name the dimension, not the
    // header text.
    const json& shape = entry["shape"];
    for (size_t i = 0; i < shape.size(); ++i) {
      if (!shape[i].is_number_unsigned()) {
        return Bad(path,
                   absl::StrCat("tensor ", name, " has a bad shape: dimension ", i, " is not a non-negative integer"));
      }
      const uint64_t dim = shape[i].get<uint64_t>();
      if (dim > kMaxTensorElements) {
        return Bad(path, absl::StrCat("tensor ", name, " has a bad shape: dimension ", i, " is ", dim,
                                      ", more than the ", kMaxTensorElements, " elements a tensor may have"));
      }
      info.shape.push_back(static_cast<int64_t>(dim));
    }
    uint64_t numel = 1;
    if (std::find(info.shape.begin(), info.shape.end(), 0) != info.shape.end()) {
      numel = 0;  // an empty tensor, whatever its other dimensions
    } else {
      for (int64_t dim : info.shape) {
        if (numel > kMaxTensorElements / static_cast<uint64_t>(dim)) {
          return Bad(path,
                     absl::StrCat("tensor ", name, " has a shape of more than ", kMaxTensorElements, " elements"));
        }
        numel *= static_cast<uint64_t>(dim);
      }
    }
    for (const auto& o : entry["data_offsets"]) {
      if (!o.is_number_unsigned()) {
        return Bad(path, absl::StrCat("tensor ", name,
                                      " has bad data_offsets: they must be two non-negative integers "
                                      "[begin, end]"));
      }
    }
    info.begin = entry["data_offsets"][0].get<uint64_t>();
    info.end = entry["data_offsets"][1].get<uint64_t>();
    if (info.begin > info.end) {
      return Bad(path, absl::StrCat("tensor ", name, " has data_offsets [", info.begin, ", ", info.end,
                                    ") whose end comes before their begin"));
    }
    if (info.end > data_size) {
      return Bad(path, absl::StrCat("tensor ", name, " data_offsets [", info.begin, ", ", info.end,
                                    ") lie outside the ", data_size, "-byte data section"));
    }
    if (numel * static_cast<uint64_t>(DTypeSize(info.dtype)) != info.end - info.begin) {
      return Bad(path, absl::StrCat("tensor ", name, " has ", numel, " elements of ", DTypeSize(info.dtype),
                                    " bytes but ", info.end - info.begin, " bytes of data"));
    }
    auto [it, inserted] = file->tensors_.emplace(name, std::move(info));
    by_offset.push_back(&it->second);
  }
  std::sort(by_offset.begin(), by_offset.end(), [](const TensorInfo* a, const TensorInfo* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  uint64_t expected = 0;
  for (const TensorInfo* t : by_offset) {
    if (t->begin < expected) return Bad(path, absl::StrCat("tensor ", t->name, " overlaps the tensor before it"));
    if (t->begin > expected)
      return Bad(path, absl::StrCat("tensor ", t->name, " leaves a gap before it (not contiguous)"));
    expected = t->end;
  }
  if (expected != data_size) {
    return Bad(path, absl::StrCat("tensors cover ", expected, " of ", data_size, " data bytes"));
  }
  return file;
}

SafetensorsFile::~SafetensorsFile() { munmap(const_cast<uint8_t*>(map_), size_); }

const TensorInfo* SafetensorsFile::Find(absl::string_view name) const {
  auto it = tensors_.find(std::string(name));
  return it == tensors_.end() ? nullptr : &it->second;
}

namespace {

// Copied bytes are not needed in the mapping any more: dropping its pages keeps them out of the
// rank's resident set (they stay in the page cache, shared).
void ReleasePages(const uint8_t* begin, size_t length) {
  static const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  uintptr_t start = reinterpret_cast<uintptr_t>(begin) & ~(page - 1);
  const uintptr_t end = reinterpret_cast<uintptr_t>(begin) + length;
  if (end > start) madvise(reinterpret_cast<void*>(start), end - start, MADV_DONTNEED);
}

// Converts `count` contiguous elements into `out` a chunk at a time, dropping each chunk's pages
// as soon as it is copied: the file pages a copy touches count in the rank's resident set until
// dropped, so copying a whole tensor first (BERT-base's word embeddings: 94 MiB) would add its
// size to the rank's peak RSS.
void ConvertReleasing(const uint8_t* base, DType dtype, int64_t count, float* out) {
  constexpr int64_t kChunkElements = int64_t{1} << 20;
  const int esize = DTypeSize(dtype);
  for (int64_t done = 0; done < count; done += kChunkElements) {
    const int64_t n = std::min(kChunkElements, count - done);
    Convert(base + done * esize, dtype, n, out + done);
    ReleasePages(base + done * esize, static_cast<size_t>(n * esize));
  }
}

}  // namespace

absl::Status SafetensorsFile::ReadSlice(const TensorInfo& t, const Slice& slice, float* out) const {
  if (!IsFloating(t.dtype)) {
    return absl::InvalidArgumentError(absl::StrCat("tensor ", t.name, " has dtype ", DTypeString(t.dtype),
                                                   "; model weights must be F32, F16, BF16 or F64"));
  }
  const int esize = DTypeSize(t.dtype);
  const uint8_t* base = map_ + data_offset_ + t.begin;
  if (slice.dim < 0) {
    ConvertReleasing(base, t.dtype, t.numel(), out);
    bytes_read_ += static_cast<uint64_t>(t.numel() * esize);
    return absl::OkStatus();
  }
  if (slice.dim >= static_cast<int>(t.shape.size()) || slice.start < 0 || slice.end < slice.start ||
      slice.end > t.shape[static_cast<size_t>(slice.dim)]) {
    return absl::InvalidArgumentError(absl::StrCat("slice [", slice.start, ", ", slice.end, ") of dim ", slice.dim,
                                                   " is outside tensor ", t.name, " (", t.shape.size(), " dims)"));
  }
  // Row-major: the tensor is `outer` blocks of shape[dim] x `inner` elements, and the slice is the
  // same run of `width` elements in each block. Open bounded every product by kMaxTensorElements.
  const auto d = static_cast<size_t>(slice.dim);
  int64_t outer = 1, inner = 1;
  for (size_t i = 0; i < d; ++i) outer *= t.shape[i];
  for (size_t i = d + 1; i < t.shape.size(); ++i) inner *= t.shape[i];
  const int64_t stride = t.shape[d] * inner;
  const int64_t width = (slice.end - slice.start) * inner;
  const uint8_t* first = base + slice.start * inner * esize;
  if (outer == 1 || width == stride) {  // one contiguous run
    ConvertReleasing(first, t.dtype, outer * width, out);
  } else {
    // Blocks in groups of about 4 MiB of the file, each group's pages dropped once it is copied.
    const int64_t per_group = std::max<int64_t>(1, (int64_t{4} << 20) / std::max<int64_t>(1, stride * esize));
    for (int64_t group = 0; group < outer; group += per_group) {
      const int64_t last = std::min(outer, group + per_group);
      for (int64_t b = group; b < last; ++b) Convert(first + b * stride * esize, t.dtype, width, out + b * width);
      ReleasePages(base + group * stride * esize, static_cast<size_t>((last - group) * stride * esize));
    }
  }
  bytes_read_ += static_cast<uint64_t>(outer * width * esize);
  return absl::OkStatus();
}

absl::Status WriteSafetensors(const std::string& path, const std::vector<TensorData>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  uint64_t offset = 0;
  for (const TensorData& t : tensors) {
    int64_t numel = 1;
    for (int64_t d : t.shape) numel *= d;
    if (numel != static_cast<int64_t>(t.values.size())) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", t.name, " has ", t.values.size(), " values for a shape of ", numel, " elements"));
    }
    const uint64_t bytes = t.values.size() * 4;
    header[t.name] = {{"dtype", "F32"}, {"shape", t.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::string text = header.dump();
  while (text.size() % 8 != 0) text.push_back(' ');  // align the data section, as HF does
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return absl::InternalError(absl::StrCat("cannot write ", path));
  uint64_t len = text.size();
  char len_bytes[8];
  for (int i = 0; i < 8; ++i) len_bytes[i] = static_cast<char>((len >> (8 * i)) & 0xff);
  out.write(len_bytes, 8);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  for (const TensorData& t : tensors) {
    out.write(reinterpret_cast<const char*>(t.values.data()), static_cast<std::streamsize>(t.values.size() * 4));
  }
  out.close();
  if (!out) return absl::InternalError(absl::StrCat("error writing ", path));
  return absl::OkStatus();
}

}  // namespace bertshard::checkpoint
