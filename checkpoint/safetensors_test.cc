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

std::string TempPath(const std::string& name) { return std::string(std::getenv("TEST_TMPDIR")) + "/" + name; }

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
  ExpectRefused(RawFile("shape", R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", 4),
                "tensor a has a bad shape: dimension 0 is not a non-negative integer");
  ExpectRefused(RawFile("reversed", R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", 8),
                "tensor a has data_offsets [8, 0) whose end comes before their begin");
  ExpectRefused(RawFile("trailing", "{" + a8 + "}", 12), "tensors cover 8 of 12 data bytes");
  EXPECT_EQ(SafetensorsFile::Open(TempPath("absent")).status().code(), absl::StatusCode::kNotFound);
  // The good file itself opens (so the cases above fail for their own reason).
  EXPECT_TRUE(SafetensorsFile::Open(RawFile("good", "{" + a8 + R"(,"__metadata__":{"format":"pt"}})", 8)).ok());
}

// Shapes whose element count overflows, or is absurd, or whose bytes lie beyond the file: refused
// before anything is read. [2^32, 2^32] and [2^40, 2^24] multiply to 2^64, which wraps to 0 in 64
// bits and so matched an empty byte range: that file used to open, and a slice of it read far
// outside the mapping.
TEST(Safetensors, RefusesShapesThatOverflowOrOutgrowTheFile) {
  const auto header = [](const std::string& shape, const std::string& offsets) {
    return R"({"a":{"dtype":"F32","shape":)" + shape + R"(,"data_offsets":)" + offsets + "}}";
  };
  ExpectRefused(RawFile("wrap_2x32", header("[4294967296,4294967296]", "[0,0]"), 0),
                "tensor a has a shape of more than 1099511627776 elements");
  ExpectRefused(RawFile("wrap_40_24", header("[1099511627776,16777216]", "[0,0]"), 0),
                "tensor a has a shape of more than 1099511627776 elements");
  ExpectRefused(RawFile("wrap_3d", header("[65536,65536,65536,65536]", "[0,0]"), 0),
                "tensor a has a shape of more than 1099511627776 elements");
  ExpectRefused(RawFile("too_many", header("[2097152,2097152]", "[0,8]"), 8),
                "tensor a has a shape of more than 1099511627776 elements");
  // One dimension beyond int64 (2^63), and one beyond uint64 (JSON gives it as a float).
  ExpectRefused(RawFile("dim_2_63", header("[9223372036854775808]", "[0,8]"), 8),
                "tensor a has a bad shape: dimension 0 is 9223372036854775808, more than the 1099511627776");
  ExpectRefused(RawFile("dim_2_64", header("[1,18446744073709551616]", "[0,8]"), 8),
                "tensor a has a bad shape: dimension 1 is not a non-negative integer");
  ExpectRefused(RawFile("dim_float", header("[2,1.5]", "[0,8]"), 8),
                "tensor a has a bad shape: dimension 1 is not a non-negative integer");
  ExpectRefused(RawFile("dim_string", header(R"([2,"1"])", "[0,8]"), 8),
                "tensor a has a bad shape: dimension 1 is not a non-negative integer");
  // 2^40 elements are allowed, but their 4 TiB are not in an 8-byte file.
  ExpectRefused(RawFile("beyond_file", header("[1048576,1048576]", "[0,4398046511104]"), 8),
                "tensor a data_offsets [0, 4398046511104) lie outside the 8-byte data section");
  ExpectRefused(RawFile("beyond_file_small_range", header("[1048576,1048576]", "[0,8]"), 8),
                "tensor a has 1099511627776 elements of 4 bytes but 8 bytes of data");
  // data_offsets that disagree with shape x dtype size, both ways.
  ExpectRefused(RawFile("offsets_long", header("[2,3]", "[0,32]"), 32),
                "tensor a has 6 elements of 4 bytes but 32 bytes");
  ExpectRefused(RawFile("offsets_short", header("[2,3]", "[0,16]"), 16),
                "tensor a has 6 elements of 4 bytes but 16 bytes");
  // A zero dimension makes an empty tensor, however large the others: no overflow to report.
  auto empty = SafetensorsFile::Open(RawFile("empty_huge", header("[1099511627776,0,1099511627776]", "[0,0]"), 0));
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_EQ((*empty)->Find("a")->numel(), 0);
  EXPECT_TRUE((*empty)->ReadSlice(*(*empty)->Find("a"), {.dim = 2, .start = 5, .end = 7}, nullptr).ok());
  EXPECT_EQ((*empty)->bytes_read(), 0u);
}

TEST(Safetensors, RefusesDataOffsetsThatAreNotTwoNonNegativeIntegers) {
  const auto header = [](const std::string& offsets) {
    return R"({"a":{"dtype":"F32","shape":[2],"data_offsets":)" + offsets + "}}";
  };
  const std::string not_integers = "tensor a has bad data_offsets: they must be two non-negative integers [begin, end]";
  ExpectRefused(RawFile("offsets_fraction", header("[0,1.5]"), 8), not_integers);
  ExpectRefused(RawFile("offsets_float", header("[0.0,8]"), 8), not_integers);
  ExpectRefused(RawFile("offsets_string", header(R"(["0","8"])"), 8), not_integers);
  ExpectRefused(RawFile("offsets_negative", header("[-8,0]"), 8), not_integers);
  ExpectRefused(RawFile("offsets_null", header("[0,null]"), 8), not_integers);
  ExpectRefused(RawFile("offsets_huge", header("[0,18446744073709551616]"), 8), not_integers);
  ExpectRefused(RawFile("offsets_reversed", header("[8,0]"), 8),
                "tensor a has data_offsets [8, 0) whose end comes before their begin");
  const std::string fields = "tensor a needs dtype, shape and data_offsets [begin, end]";
  ExpectRefused(RawFile("offsets_one", header("[8]"), 8), fields);
  ExpectRefused(RawFile("offsets_three", header("[0,8,8]"), 8), fields);
  ExpectRefused(RawFile("offsets_text", header(R"("0,8")"), 8), fields);
  // The same tensor with good offsets opens (the cases above fail for their offsets alone).
  EXPECT_TRUE(SafetensorsFile::Open(RawFile("offsets_good", header("[0,8]"), 8)).ok());
}

// The reference a slice is checked against: element by element through the multi-index, no
// contiguous-run arithmetic.
std::vector<float> NaiveSlice(const std::vector<float>& values, const std::vector<int64_t>& shape, const Slice& s) {
  std::vector<float> out;
  std::vector<int64_t> index(shape.size(), 0);
  for (size_t flat = 0; flat < values.size(); ++flat) {
    if (index[static_cast<size_t>(s.dim)] >= s.start && index[static_cast<size_t>(s.dim)] < s.end) {
      out.push_back(values[flat]);
    }
    for (size_t k = shape.size(); k-- > 0;) {  // next multi-index, last dimension fastest
      if (++index[k] < shape[k]) break;
      index[k] = 0;
    }
  }
  return out;
}

TEST(Safetensors, SlicesTensorsOfAnyRankAlongAnyDimension) {
  const std::string path = TempPath("rank3.safetensors");
  std::vector<float> t3(2 * 3 * 4), t4(2 * 3 * 2 * 5);
  for (size_t i = 0; i < t3.size(); ++i) t3[i] = static_cast<float>(i);
  for (size_t i = 0; i < t4.size(); ++i) t4[i] = 1000.f + static_cast<float>(i);
  ASSERT_TRUE(WriteSafetensors(path, {{"t3", {2, 3, 4}, t3}, {"t4", {2, 3, 2, 5}, t4}}).ok());
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  const TensorInfo& a = *(*file)->Find("t3");
  // Known values of the [2, 3, 4] tensor holding 0..23 (element [i][j][k] = 12i + 4j + k).
  std::vector<float> got(24, -1.f);
  ASSERT_TRUE((*file)->ReadSlice(a, {.dim = 0, .start = 1, .end = 2}, got.data()).ok());
  EXPECT_EQ(std::vector<float>(got.begin(), got.begin() + 12),
            (std::vector<float>{12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23}));
  ASSERT_TRUE((*file)->ReadSlice(a, {.dim = 1, .start = 1, .end = 3}, got.data()).ok());
  EXPECT_EQ(std::vector<float>(got.begin(), got.begin() + 16),
            (std::vector<float>{4, 5, 6, 7, 8, 9, 10, 11, 16, 17, 18, 19, 20, 21, 22, 23}));
  ASSERT_TRUE((*file)->ReadSlice(a, {.dim = 2, .start = 1, .end = 3}, got.data()).ok());
  EXPECT_EQ(std::vector<float>(got.begin(), got.begin() + 12),
            (std::vector<float>{1, 2, 5, 6, 9, 10, 13, 14, 17, 18, 21, 22}));
  EXPECT_EQ((*file)->bytes_read(), (12u + 16u + 12u) * 4u);
  // Every slice of every dimension of both tensors, against the element-by-element reference.
  const std::vector<std::pair<std::string, const std::vector<float>*>> tensors = {{"t3", &t3}, {"t4", &t4}};
  for (const auto& [name, values] : tensors) {
    const TensorInfo& t = *(*file)->Find(name);
    for (int dim = 0; dim < static_cast<int>(t.shape.size()); ++dim) {
      for (int64_t start = 0; start <= t.shape[static_cast<size_t>(dim)]; ++start) {
        for (int64_t end = start; end <= t.shape[static_cast<size_t>(dim)]; ++end) {
          SCOPED_TRACE(::testing::Message() << name << " dim " << dim << " [" << start << ", " << end << ")");
          const Slice slice{.dim = dim, .start = start, .end = end};
          const std::vector<float> want = NaiveSlice(*values, t.shape, slice);
          std::vector<float> out(want.size() + 1, -7.f);  // the element past the end stays untouched
          ASSERT_TRUE((*file)->ReadSlice(t, slice, out.data()).ok());
          EXPECT_EQ(std::vector<float>(out.begin(), out.end() - 1), want);
          EXPECT_EQ(out.back(), -7.f);
        }
      }
    }
  }
  // Out of bounds: a dimension the tensor lacks, a range past its end.
  absl::Status no_dim = (*file)->ReadSlice(a, {.dim = 3, .start = 0, .end = 1}, got.data());
  EXPECT_EQ(no_dim.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(no_dim.message(), "slice [0, 1) of dim 3 is outside tensor t3 (3 dims)")) << no_dim;
  absl::Status past = (*file)->ReadSlice(a, {.dim = 2, .start = 2, .end = 5}, got.data());
  EXPECT_EQ(past.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(past.message(), "slice [2, 5) of dim 2 is outside tensor t3")) << past;
}

// A rank-3 tensor whose blocks before the sliced dimension are each over the 4 MiB copy group,
// and one in half precision: the strided path converts and places every block.
TEST(Safetensors, SlicesLargeAndHalfPrecisionRank3Tensors) {
  const std::string path = TempPath("rank3_large.safetensors");
  const std::vector<int64_t> shape = {3, 1100, 1024};  // blocks of 4.3 MiB
  std::vector<float> m(static_cast<size_t>(shape[0] * shape[1] * shape[2]));
  for (size_t i = 0; i < m.size(); ++i) m[i] = static_cast<float>(i % 100003);
  ASSERT_TRUE(WriteSafetensors(path, {{"m", shape, m}}).ok());
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  for (const Slice& slice : {Slice{.dim = 1, .start = 1000, .end = 1100}, Slice{.dim = 2, .start = 1, .end = 3},
                             Slice{.dim = 0, .start = 1, .end = 3}}) {
    SCOPED_TRACE(::testing::Message() << "dim " << slice.dim);
    const std::vector<float> want = NaiveSlice(m, shape, slice);
    std::vector<float> got(want.size());
    ASSERT_TRUE((*file)->ReadSlice(*(*file)->Find("m"), slice, got.data()).ok());
    EXPECT_TRUE(got == want);
  }
  // BF16 [2, 2, 2] of 1, 2, ..., 8 (0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0, 0x4100).
  std::string data;
  for (uint16_t b : {0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0, 0x4100}) {
    data.push_back(static_cast<char>(b & 0xff));
    data.push_back(static_cast<char>(b >> 8));
  }
  auto bf16 = SafetensorsFile::Open(
      RawFile("bf16_rank3", R"({"b":{"dtype":"BF16","shape":[2,2,2],"data_offsets":[0,16]}})", data));
  ASSERT_TRUE(bf16.ok()) << bf16.status();
  std::vector<float> last_column(4);
  ASSERT_TRUE((*bf16)->ReadSlice(*(*bf16)->Find("b"), {.dim = 2, .start = 1, .end = 2}, last_column.data()).ok());
  EXPECT_EQ(last_column, (std::vector<float>{2, 4, 6, 8}));
  EXPECT_EQ((*bf16)->bytes_read(), 8u);
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
