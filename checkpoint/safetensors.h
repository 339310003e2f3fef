// File: checkpoint/safetensors.h
// -----------------------------------------------------------------------------
// A reader and writer of the safetensors format (HuggingFace): an 8-byte little-endian header
// length N, N bytes of JSON {"name": {"dtype", "shape", "data_offsets": [begin, end]}, ...,
// "__metadata__": {...}}, then the tensor bytes. The reader maps the file and copies out only the
// byte ranges of the slices asked for, so a rank reads just its shard; everything in the header
// is validated first and a bad file is refused with a message naming the problem.
//
// Example:
//   ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open("model.safetensors"));
//   const TensorInfo* q = file->Find("bert.encoder.layer.0.attention.self.query.weight");
//   std::vector<float> rows(384 * 768);
//   RETURN_IF_ERROR(file->ReadSlice(*q, {.dim = 0, .start = 384, .end = 768}, rows.data()));
//
// Thread safety: a SafetensorsFile is thread-compatible for reads after Open (ReadSlice only reads
// the mapping; its byte counter is atomic).
#ifndef BERTSHARD_CHECKPOINT_SAFETENSORS_H_
#define BERTSHARD_CHECKPOINT_SAFETENSORS_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace bertshard::checkpoint {

// Every dtype the format defines is accepted in a header (checkpoints carry e.g. I64 position_ids
// buffers); ReadSlice converts the floating ones (F64, F32, F16, BF16) to float32.
enum class DType { kF64, kF32, kF16, kBF16, kI64, kI32, kI16, kI8, kU64, kU32, kU16, kU8, kBool, kF8E4M3, kF8E5M2 };

// The format's dtype names ("F32", "BF16", "I64", ...); INVALID_ARGUMENT names any other.
absl::StatusOr<DType> ParseDType(absl::string_view name);
int DTypeSize(DType dtype);
bool IsFloating(DType dtype);  // F64, F32, F16, BF16: what ReadSlice reads

struct TensorInfo {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte offsets into the data section
  uint64_t end = 0;
  int64_t numel() const;
};

// A contiguous range of one dimension; dim -1 means the whole tensor.
struct Slice {
  int dim = -1;
  int64_t start = 0;
  int64_t end = 0;
};

// Largest header accepted: big checkpoints have a few thousand tensors (~1 MiB of JSON).
inline constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;
// Most elements (and largest dimension) a tensor may have: 2^40, far beyond any BERT weight
// (BERT-large's biggest is 31M), and small enough that element and byte counts never overflow.
inline constexpr uint64_t kMaxTensorElements = uint64_t{1} << 40;

class SafetensorsFile {
 public:
  // Maps and validates `path`. INVALID_ARGUMENT for any malformed header: length beyond the bound
  // or the file, bad JSON, unknown dtype, a shape that is not non-negative integers or has more
  // than kMaxTensorElements elements, data_offsets that are not two non-negative integers, reversed
  // (begin > end) or outside the data section, shape x dtype size != byte length, tensors not
  // contiguous or overlapping. NOT_FOUND if the file cannot be opened.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  // As Open, mapping the file `fd` is open on (`path` names it in errors); the caller keeps `fd`
  // (the mapping does not need it once this returns). How a checkpoint's weights are read: from
  // the descriptor its directory opened and checked (common/checkpoint_dir.h), never by path again.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> OpenDescriptor(int fd, const std::string& path);

  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  // nullptr if absent.
  const TensorInfo* Find(absl::string_view name) const;
  const std::map<std::string, TensorInfo>& tensors() const { return tensors_; }

  // Copies `slice` of a tensor into `out` (row-major, float32, the sliced dimension shortened to
  // end - start), converting F64/F16/BF16. Any rank, any dimension: a slice of dim d reads, for
  // each index of the dimensions before d, one contiguous run of the file. INVALID_ARGUMENT for a
  // non-floating dtype, or if the slice is out of the tensor's bounds. Bytes copied are added to
  // bytes_read().
  absl::Status ReadSlice(const TensorInfo& tensor, const Slice& slice, float* out) const;

  uint64_t bytes_read() const { return bytes_read_.load(); }

 private:
  SafetensorsFile(std::string path, const uint8_t* map, size_t size, uint64_t data_offset)
      : path_(std::move(path)), map_(map), size_(size), data_offset_(data_offset) {}

  const std::string path_;
  const uint8_t* const map_;
  const size_t size_;
  const uint64_t data_offset_;
  std::map<std::string, TensorInfo> tensors_;
  mutable std::atomic<uint64_t> bytes_read_{0};
};

// A float32 tensor to write.
struct TensorData {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> values;
};

// Writes `tensors` (F32, in the given order) with optional string metadata. INVALID_ARGUMENT if a
// shape does not match its values; INTERNAL on I/O errors.
absl::Status WriteSafetensors(const std::string& path, const std::vector<TensorData>& tensors,
                              const std::map<std::string, std::string>& metadata = {});

}  // namespace bertshard::checkpoint

#endif  // BERTSHARD_CHECKPOINT_SAFETENSORS_H_
