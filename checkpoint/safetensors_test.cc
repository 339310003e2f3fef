#include "checkpoint/safetensors.h"

#include <algorithm>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace bertshard::checkpoint {
namespace {

std::string TempPath(const std::string& name) {
  return std::string(std::getenv("TEST_TMPDIR")) + "/" + name;
}

// A file with an arbitrary header text and data bytes (or `data_bytes` zeros).
std::string RawFile(const std::string& name, const std::string& header, const std::string& data,
                    uint64_t header_len_override = 0) {
  const std::string path = TempPath(name);
  std::ofstream out(path, std::ios::binary);
  const uint64_t len = header_len_override ? header_len_override : header.size();
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>((len >> (8 * i)) & 0xff));
  out << header << data;
  return path;
}

std::string RawFile(const std::string& name, const std::string& header, size_t data_bytes,
                    uint64_t header_len_override = 0) {
  return RawFile(name, header, std::string(data_bytes, '\0'), header_len_override);
}

void ExpectRefused(const std::string& path, const std::string& fragment) {
  auto file = SafetensorsFile::Open(path);
  ASSERT_FALSE(file.ok()) << path;
  EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(file.status().message(), fragment)) << file.status();
}

TEST(Safetensors, WritesThenReadsSlicesOfRowsAndColumns) {
  const std::string path = TempPath("ok.safetensors");
  std::vector<float> m(4 * 6);
  for (size_t i = 0; i < m.size(); ++i) m[i] = static_cast<float>(i);
  ASSERT_TRUE(WriteSafetensors(path, {{"m", {4, 6}, m}, {"v", {3}, {1.5f, -2.f, 3.f}}}).ok());
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  const TensorInfo* t = (*file)->Find("m");
  ASSERT_NE(t, nullptr);
  std::vector<float> rows(2 * 6);
  ASSERT_TRUE((*file)->ReadSlice(*t, {.dim = 0, .start = 2, .end = 4}, rows.data()).ok());
  EXPECT_EQ(rows[0], 12.f);
  EXPECT_EQ(rows[11], 23.f);
  EXPECT_EQ((*file)->bytes_read(), 48u);
  std::vector<float> cols(4 * 3);
  ASSERT_TRUE((*file)->ReadSlice(*t, {.dim = 1, .start = 3, .end = 6}, cols.data()).ok());
  EXPECT_EQ(cols, (std::vector<float>{3, 4, 5, 9, 10, 11, 15, 16, 17, 21, 22, 23}));
  EXPECT_EQ((*file)->bytes_read(), 48u + 48u);
  std::vector<float> v(3);
  ASSERT_TRUE((*file)->ReadSlice(*(*file)->Find("v"), {}, v.data()).ok());
  EXPECT_EQ(v[1], -2.f);
  EXPECT_FALSE((*file)->ReadSlice(*t, {.dim = 0, .start = 3, .end = 5}, rows.data()).ok());
  EXPECT_EQ((*file)->Find("missing"), nullptr);
}

// Larger than one copy chunk (2^20 elements, or 4 MiB of rows for column slices): every chunk and
// row block lands where it belongs, the last one partial.
TEST(Safetensors, ReadsTensorsLargerThanOneChunk) {
  const std::string path = TempPath("large.safetensors");
  const int64_t rows = 1100, cols = 1024;  // 1,126,400 elements, 4.4 MiB
  std::vector<float> m(static_cast<size_t>(rows * cols));
  for (size_t i = 0; i < m.size(); ++i) m[i] = static_cast<float>(i % 100003);
  ASSERT_TRUE(WriteSafetensors(path, {{"m", {rows, cols}, m}}).ok());
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  const TensorInfo* t = (*file)->Find("m");
  std::vector<float> whole(m.size());
  ASSERT_TRUE((*file)->ReadSlice(*t, {}, whole.data()).ok());
  EXPECT_EQ(whole, m);
  std::vector<float> tail(static_cast<size_t>(1000 * cols));
  ASSERT_TRUE((*file)->ReadSlice(*t, {.dim = 0, .start = 100, .end = 1100}, tail.data()).ok());
  EXPECT_TRUE(std::equal(tail.begin(), tail.end(), m.begin() + 100 * cols));
  std::vector<float> column_slice(static_cast<size_t>(rows * 3));
  ASSERT_TRUE((*file)->ReadSlice(*t, {.dim = 1, .start = 1020, .end = 1023}, column_slice.data()).ok());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < 3; ++c) {
      ASSERT_EQ(column_slice[static_cast<size_t>(r * 3 + c)], m[static_cast<size_t>(r * cols + 1020 + c)])
          << r << ", " << c;
    }
  }
}

TEST(Safetensors, ConvertsHalfAndBfloat16) {
  // F16: 1.0 = 0x3c00, -2.0 = 0xc000, 2^-24 (smallest subnormal) = 0x0001.
  // BF16: 1.0 = 0x3f80, -0.5 = 0xbf00.
  std::string data;
  for (uint16_t h : {0x3c00, 0xc000, 0x0001, 0x3f80, 0xbf00}) {
    data.push_back(static_cast<char>(h & 0xff));
    data.push_back(static_cast<char>(h >> 8));
  }
  const std::string header = R"({"h":{"dtype":"F16","shape":[3],"data_offsets":[0,6]},)"
                             R"("b":{"dtype":"BF16","shape":[2],"data_offsets":[6,10]}})";
  auto file = SafetensorsFile::Open(RawFile("half.safetensors", header, data));
  ASSERT_TRUE(file.ok()) << file.status();
  std::vector<float> h(3), b(2);
  ASSERT_TRUE((*file)->ReadSlice(*(*file)->Find("h"), {}, h.data()).ok());
  ASSERT_TRUE((*file)->ReadSlice(*(*file)->Find("b"), {}, b.data()).ok());
  EXPECT_EQ(h, (std::vector<float>{1.f, -2.f, 5.9604644775390625e-08f}));
  EXPECT_EQ(b, (std::vector<float>{1.f, -0.5f}));
}

TEST(Safetensors, RefusesCorruptFiles) {
  {
    const std::string path = TempPath("tiny");
    std::ofstream(path, std::ios::binary) << "abc";
    ExpectRefused(path, "shorter than the 8-byte header length");
  }
  const std::string a8 = R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  ExpectRefused(RawFile("truncated_data", "{" + a8 + "}", 4), "lie outside the 4-byte data section");
  ExpectRefused(RawFile("truncated_header", "{" + a8 + "}", 8, 4096), "runs past the end");
  ExpectRefused(RawFile("huge_header", "{}", 0, uint64_t{1} << 40), "exceeds the");
  ExpectRefused(RawFile("bad_json", "{not json", 8), "header is not a JSON object");
  ExpectRefused(RawFile("array_json", "[1,2]", 0), "header is not a JSON object");
  ExpectRefused(RawFile("out_of_range", R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 8),
                "lie outside");
  ExpectRefused(RawFile("overlap", "{" + a8 + R"(,"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12),
                "tensor b overlaps");
  ExpectRefused(RawFile("gap", "{" + a8 + R"(,"b":{"dtype":"F32","shape":[2],"data_offsets":[12,20]}})", 20),
                "tensor b leaves a gap");
  ExpectRefused(RawFile("dtype_size", R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8),
                "has 3 elements of 4 bytes but 8 bytes");
  ExpectRefused(RawFile("dtype", R"({"a":{"dtype":"Q7","shape":[1],"data_offsets":[0,8]}})", 8),
                "dtype Q7 is not a safetensors dtype");
  ExpectRefused(RawFile("i64_size", R"({"a":{"dtype":"I64","shape":[2],"data_offsets":[0,8]}})", 8),
                "has 2 elements of 8 bytes but 8 bytes");
  ExpectRefused(RawFile("fields", R"({"a":{"dtype":"F32"}})", 0), "needs dtype, shape and data_offsets");
  ExpectRefused(RawFile("shape", R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", 4), "bad shape");
  ExpectRefused(RawFile("reversed", R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", 8), "lie outside");
  ExpectRefused(RawFile("trailing", "{" + a8 + "}", 12), "tensors cover 8 of 12 data bytes");
  EXPECT_EQ(SafetensorsFile::Open(TempPath("absent")).status().code(), absl::StatusCode::kNotFound);
  // The good file itself opens (so the cases above fail for their own reason).
  EXPECT_TRUE(SafetensorsFile::Open(RawFile("good", "{" + a8 + R"(,"__metadata__":{"format":"pt"}})", 8)).ok());
}

TEST(Safetensors, AcceptsIntegerBuffersButReadsOnlyFloats) {
  // Older HF checkpoints carry an I64 position_ids buffer next to the weights.
  double d = 0.25;
  std::string data(8, '\0');
  std::memcpy(data.data(), &d, 8);
  data += std::string(8, '\0');
  const std::string header = R"({"w":{"dtype":"F64","shape":[1],"data_offsets":[0,8]},)"
                             R"("bert.embeddings.position_ids":{"dtype":"I64","shape":[1,1],"data_offsets":[8,16]}})";
  auto file = SafetensorsFile::Open(RawFile("mixed.safetensors", header, data));
  ASSERT_TRUE(file.ok()) << file.status();
  float w = 0;
  ASSERT_TRUE((*file)->ReadSlice(*(*file)->Find("w"), {}, &w).ok());
  EXPECT_EQ(w, 0.25f);
  absl::Status ids = (*file)->ReadSlice(*(*file)->Find("bert.embeddings.position_ids"), {}, &w);
  EXPECT_EQ(ids.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(ids.message(), "has dtype I64")) << ids;
}

TEST(Safetensors, WriterRejectsShapeMismatch) {
  EXPECT_EQ(WriteSafetensors(TempPath("bad_write"), {{"x", {2, 2}, {1, 2, 3}}}).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace bertshard::checkpoint
