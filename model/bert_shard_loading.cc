// File: model/bert_shard_loading.cc
// -----------------------------------------------------------------------------
// BertShard::Impl's loading (bert_shard_impl.h): the tensors this rank's plan lists read from the
// checkpoint (only their byte ranges), converted to the plan's dtype, each layer's query, key and
// value fused as they arrive, and on the oneDNN path the linears' weights packed -- read
// transposed straight into the WeightArena where they can be.
//
// Thread safety: thread-compatible (called once, from BertShard::Load).
#include <ATen/ATen.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <new>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "model/bert_shard_impl.h"
#include "model/gemm.h"

namespace bertshard::model {
namespace {

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// The lookup tables of the embeddings: the only 2-D parameters that no linear reads (except the
// word embeddings tied to the LM decoder, which are read under both names).
bool IsEmbeddingTable(const std::string& name) { return absl::EndsWith(name, "_embeddings.weight"); }

// The query, key and value projections of a layer's self-attention, which the shard multiplies as
// one product (FuseQkvOnceWhole).
constexpr const char* kQkvParts[] = {"query", "key", "value"};
// Which of kQkvParts tensor `name` belongs to; -1 for none.
int QkvPartIndex(const std::string& name) {
  for (int i = 0; i < 3; ++i) {
    if (absl::StrContains(name, absl::StrCat(".attention.self.", kQkvParts[i], "."))) return i;
  }
  return -1;
}
bool IsQkvPart(const std::string& name) { return QkvPartIndex(name) >= 0; }

// "...attention.self." of a query, key or value tensor's name: its layer's fused QKV prefix.
std::string QkvPrefix(const std::string& part_name) {
  const std::string self = ".attention.self.";
  return part_name.substr(0, part_name.find(self) + self.size());
}

}  // namespace

// One mapping for a rank's packed linear weights, which never change after load, outside malloc's
// heap: the load's transient buffers (the read scratch, biases, the embeddings' conversions) cannot
// end up between the weights, where glibc keeps freed holes mapped. BERT-base, one rank, 2
// threads: peak RSS 717 -> 680 MiB, measured. Tensors carved from it keep it alive (their deleters
// hold it); it is unmapped with the last of them. (Transparent huge pages for it were tried: on
// this VM they made loads 1.0-1.4 s instead of 0.3 s, so it has plain pages.)
class BertShard::Impl::WeightArena {
 public:
  static std::shared_ptr<WeightArena> Create(int64_t bytes) {
    const int64_t size = std::max<int64_t>(bytes, 1);
    void* base = mmap(nullptr, static_cast<size_t>(size), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) throw std::bad_alloc();
    return std::shared_ptr<WeightArena>(new WeightArena(static_cast<char*>(base), size));
  }
  ~WeightArena() { munmap(base_, static_cast<size_t>(size_)); }

  // A float32 tensor of `shape` in the next free bytes (64-byte aligned, as oneDNN likes).
  at::Tensor Empty(std::vector<int64_t> shape, const std::shared_ptr<WeightArena>& self) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    const int64_t bytes = Bytes(n);
    if (used_ + bytes > size_) return at::empty(shape);  // the estimate fell short: never fail for it
    char* p = base_ + used_;
    used_ += bytes;
    return at::from_blob(
        p, shape, [self](void*) {}, at::TensorOptions().dtype(at::kFloat));
  }
  static int64_t Bytes(int64_t elements) { return (elements * static_cast<int64_t>(sizeof(float)) + 63) / 64 * 64; }

 private:
  WeightArena(char* base, int64_t size) : base_(base), size_(size) {}
  char* const base_;
  const int64_t size_;
  int64_t used_ = 0;
};

absl::Status BertShard::Impl::LoadTensors(const checkpoint::Checkpoint& ckpt, const BertShard::Progress& progress,
                                          int64_t* param_bytes, const Impl* donor) {
  const v1::RankShard* mine = nullptr;
  for (const auto& r : plan_.ranks()) {
    if (r.rank() == rank_) mine = &r;
  }
  if (mine == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank_, " is not in the plan (world size ", plan_.world_size(), ")"));
  }
  *param_bytes = 0;
  std::set<std::string> taken;
  bool share = false;
  if (donor != nullptr) {
    for (std::string& name : TakenFrom(*donor, *mine)) taken.insert(std::move(name));
    share = taken.size() == donor->shards_.size();  // nothing of the donor's left behind
  }
  int64_t arena_bytes = 0;
  for (const v1::TensorShard& t : mine->tensors()) {
    if (TransposesAtLoad(t) && taken.count(t.name()) == 0) {
      arena_bytes += WeightArena::Bytes(t.local_shape(0) * t.local_shape(1));
    }
  }
  // A layer's fused QKV weight takes its three parts' bytes; the slack covers its alignment.
  if (arena_bytes > 0) arena_ = WeightArena::Create(arena_bytes + 64 * static_cast<int64_t>(mine->tensors_size()));
  for (const v1::TensorShard& t : mine->tensors()) {
    if (taken.count(t.name()) > 0) {
      TakeFromDonor(*donor, t, share);
      *param_bytes += t.bytes();
      kept_bytes_ += t.bytes();
      shards_[t.name()] = &t;
      if (progress &&
          !progress(static_cast<int>(shards_.size()), mine->tensors_size(), *param_bytes, mine->param_bytes())) {
        return absl::CancelledError(absl::StrCat("loading rank ", rank_, " was cancelled"));
      }
      continue;
    }
    std::vector<std::string> aliases(t.aliases().begin(), t.aliases().end());
    // As HF's from_pretrained, accept a base-model checkpoint for a model with heads and the
    // other way round: the trunk's names differ only by the "bert." prefix.
    std::vector<std::string> candidates = aliases;
    for (const std::string& name : std::vector<std::string>{t.name()}) {
      if (name.rfind("bert.", 0) == 0) {
        candidates.push_back(name.substr(5));
      } else if (plan_.variant() == v1::BERT_MODEL) {
        candidates.push_back("bert." + name);
      }
    }
    std::string primary = t.name();
    if (plan_.tie_weight() && t.name() == "cls.predictions.decoder.weight" && !aliases.empty()) {
      // Tied: HF overwrites the decoder with the word embeddings, whatever the file stores.
      std::swap(primary, candidates.front());
    }
    ASSIGN_OR_RETURN(checkpoint::TensorLocation where, ckpt.Find(primary, candidates));
    const std::vector<int64_t> global(t.global_shape().begin(), t.global_shape().end());
    if (where.info->shape != global) {
      return absl::InvalidArgumentError(absl::StrCat("checkpoint tensor ", where.info->name, " has shape ",
                                                     ShapeString(where.info->shape),
                                                     "; the plan (from config.json) expects ", ShapeString(global)));
    }
    checkpoint::Slice slice;
    if (t.split_dim() >= 0) {
      // Rows past the real size are padding: they stay zero.
      slice = {t.split_dim(), t.start(), std::min(t.end(), global[static_cast<size_t>(t.split_dim())])};
    }
    if (TransposesAtLoad(t)) {
      RETURN_IF_ERROR(ReadTransposed(t, *where.file, *where.info, slice));
    } else {
      RETURN_IF_ERROR(ReadDense(t, *where.file, *where.info, slice, global));
    }
    *param_bytes += t.bytes();
    shards_[t.name()] = &t;
    if (IsQkvPart(t.name())) FuseQkvOnceWhole(t.name());
    if (progress &&
        !progress(static_cast<int>(shards_.size()), mine->tensors_size(), *param_bytes, mine->param_bytes())) {
      return absl::CancelledError(absl::StrCat("loading rank ", rank_, " was cancelled"));
    }
  }
  load_scratch_ = at::Tensor();
  arena_.reset();  // the tensors in it hold it from here on
  return absl::OkStatus();
}

absl::Status BertShard::Impl::ReadDense(const v1::TensorShard& t, const checkpoint::SafetensorsFile& file,
                                        const checkpoint::TensorInfo& info, const checkpoint::Slice& slice,
                                        const std::vector<int64_t>& global) {
  const std::vector<int64_t> local_shape(t.local_shape().begin(), t.local_shape().end());
  // Every element is read from the file unless the slice ends in padding rows, which are zeros:
  // no zero-fill pass over hundreds of megabytes that the read overwrites anyway.
  // A narrower dtype is converted a block of rows at a time, through the scratch buffer, so the
  // float32 form of a large tensor never exists whole: BERT-base's bf16 word embeddings held
  // their 89 MiB float32 copy at the load's high-water mark.
  const bool by_row_blocks = dtype_ != at::kFloat && local_shape.size() == 2 && slice.dim <= 0;
  const at::ScalarType read_dtype = by_row_blocks ? dtype_ : at::kFloat;
  at::Tensor local = t.padding() > 0 ? at::zeros(local_shape, read_dtype) : at::empty(local_shape, read_dtype);
  if (by_row_blocks) {
    const int64_t first = slice.dim < 0 ? 0 : slice.start, end = slice.dim < 0 ? global[0] : slice.end;
    const int64_t cols = local_shape[1];
    const int64_t block = std::max<int64_t>(1, (int64_t{4} << 20) / (4 * std::max<int64_t>(1, cols)));
    for (int64_t row = first; row < end; row += block) {
      const int64_t n = std::min(block, end - row);
      RETURN_IF_ERROR(file.ReadSlice(info, {0, row, row + n}, Scratch(n * cols)));
      local.narrow(0, row - first, n).copy_(load_scratch_.narrow(0, 0, n * cols).view({n, cols}));
    }
  } else if (slice.dim < 0 || slice.end > slice.start) {
    RETURN_IF_ERROR(file.ReadSlice(info, slice, local.data_ptr<float>()));
  }
  padding_bytes_ += PaddingBytes(t);
  // Read as float32 whatever the file holds (the reader converts F16/BF16 exactly), then
  // converted once: bf16 and fp16 files round-trip unchanged, fp32 ones round to nearest.
  local = local.to(device_, dtype_);
  // On the oneDNN path a weight that only linears read is held once, packed.
  if (PackIfLinearWeight(t, local)) {
    params_[t.name()] = local;
    for (const auto& a : t.aliases()) params_[a] = local;
  }
  return absl::OkStatus();
}

bool BertShard::Impl::TransposesAtLoad(const v1::TensorShard& t) const {
  if (gemm_ != GemmPath::kOneDnn || !OneDnnPacksByTransposing(dtype_, device_) || t.padding() > 0 ||
      t.local_shape_size() != 2) {
    return false;
  }
  if (IsQkvPart(t.name())) return absl::EndsWith(t.name(), ".weight");
  const LinearUse use = UseOf(t);
  return use.read_by_linear && !use.looked_up;
}

float* BertShard::Impl::Scratch(int64_t elements) {
  if (!load_scratch_.defined() || load_scratch_.numel() < elements) load_scratch_ = at::empty({elements});
  return load_scratch_.data_ptr<float>();
}

absl::Status BertShard::Impl::ReadTransposed(const v1::TensorShard& t, const checkpoint::SafetensorsFile& file,
                                             const checkpoint::TensorInfo& info, const checkpoint::Slice& slice) {
  const int64_t rows = t.local_shape(0), cols = t.local_shape(1);
  RETURN_IF_ERROR(file.ReadSlice(info, slice, Scratch(rows * cols)));
  if (const int part = QkvPartIndex(t.name()); part >= 0) {
    const std::string p = QkvPrefix(t.name());
    QkvInPlace& fused = qkv_in_place_[p];
    if (!fused.weight.defined()) fused.weight = arena_->Empty({cols, 3 * rows}, arena_);
    TransposeInto(load_scratch_.data_ptr<float>(), rows, cols, fused.weight.data_ptr<float>() + part * rows, 3 * rows);
    ++fused.parts;
    return absl::OkStatus();
  }
  at::Tensor packed = arena_->Empty({cols, rows}, arena_);
  TransposeInto(load_scratch_.data_ptr<float>(), rows, cols, packed.data_ptr<float>(), rows);
  packed_[t.name()] = packed;
  for (const auto& a : t.aliases()) packed_[a] = packed;
  return absl::OkStatus();
}

void BertShard::Impl::FuseQkvOnceWhole(const std::string& part_name) {
  const std::string p = QkvPrefix(part_name);
  // Weights read straight into their fused packed form (ReadTransposed) are not in params_.
  const auto in_place = qkv_in_place_.find(p);
  if (in_place != qkv_in_place_.end() && in_place->second.parts < 3) return;  // not all in yet
  std::vector<at::Tensor> weights, biases;
  for (const char* part : kQkvParts) {
    const auto weight = params_.find(absl::StrCat(p, part, ".weight"));
    const auto bias = params_.find(absl::StrCat(p, part, ".bias"));
    if ((in_place == qkv_in_place_.end() && weight == params_.end()) || bias == params_.end()) return;
    if (in_place == qkv_in_place_.end()) weights.push_back(weight->second);
    biases.push_back(bias->second);
  }
  for (const char* part : kQkvParts) {
    params_.erase(absl::StrCat(p, part, ".weight"));
    params_.erase(absl::StrCat(p, part, ".bias"));
  }
  params_[p + "qkv.bias"] = at::cat(biases, 0);
  if (in_place != qkv_in_place_.end()) {
    packed_[p + "qkv.weight"] = in_place->second.weight;
    qkv_in_place_.erase(in_place);
    return;
  }
  at::Tensor weight = at::cat(weights, 0);
  weights.clear();
  if (gemm_ == GemmPath::kOneDnn) {
    packed_[p + "qkv.weight"] = PackOneDnnWeight(weight);
  } else {
    params_[p + "qkv.weight"] = weight;
  }
}

bool BertShard::Impl::PackIfLinearWeight(const v1::TensorShard& t, const at::Tensor& local) {
  if (gemm_ != GemmPath::kOneDnn || local.dim() != 2 || IsQkvPart(t.name())) return true;
  const LinearUse use = UseOf(t);
  if (!use.read_by_linear) return true;
  const at::Tensor packed = PackOneDnnWeight(local);
  packed_[t.name()] = packed;
  for (const auto& a : t.aliases()) packed_[a] = packed;
  return use.looked_up;
}

BertShard::Impl::LinearUse BertShard::Impl::UseOf(const v1::TensorShard& t) const {
  LinearUse use;
  std::vector<std::string> names = {t.name()};
  names.insert(names.end(), t.aliases().begin(), t.aliases().end());
  for (const std::string& name : names) {
    if (IsEmbeddingTable(name)) {
      use.looked_up |= !route_.empty() && route_.front().stage == stage_;  // this stage runs the embeddings
    } else {
      use.read_by_linear = true;
    }
  }
  return use;
}

int64_t BertShard::Impl::PaddingBytes(const v1::TensorShard& t) const {
  int64_t row_elements = 1;
  for (int i = 1; i < t.local_shape_size(); ++i) row_elements *= t.local_shape(i);
  return t.padding() * row_elements * static_cast<int64_t>(c10::elementSize(dtype_));
}

bool BertShard::Impl::HeldAlikeBy(const Impl& donor, const v1::TensorShard& t) const {
  if (donor.dtype_ != dtype_ || donor.device_ != device_ || donor.gemm_ != gemm_) return false;
  const auto found = donor.shards_.find(t.name());
  if (found == donor.shards_.end()) return false;
  const v1::TensorShard& d = *found->second;
  const auto same = [](const auto& a, const auto& b) { return std::equal(a.begin(), a.end(), b.begin(), b.end()); };
  const LinearUse mine = UseOf(t), theirs = donor.UseOf(d);
  return d.split_dim() == t.split_dim() && d.start() == t.start() && d.end() == t.end() && d.padding() == t.padding() &&
         same(d.local_shape(), t.local_shape()) && same(d.global_shape(), t.global_shape()) &&
         same(d.aliases(), t.aliases()) && mine.read_by_linear == theirs.read_by_linear &&
         mine.looked_up == theirs.looked_up && donor.TransposesAtLoad(d) == TransposesAtLoad(t);
}

std::vector<std::string> BertShard::Impl::TakenFrom(const Impl& donor, const v1::RankShard& mine) const {
  std::vector<std::string> taken;
  std::map<std::string, int> qkv_parts, qkv_alike;  // by layer prefix: parts in the table, held alike
  for (const v1::TensorShard& t : mine.tensors()) {
    const bool alike = HeldAlikeBy(donor, t);
    if (IsQkvPart(t.name())) {
      ++qkv_parts[QkvPrefix(t.name())];
      qkv_alike[QkvPrefix(t.name())] += alike ? 1 : 0;
    } else if (alike) {
      taken.push_back(t.name());
    }
  }
  for (const v1::TensorShard& t : mine.tensors()) {
    if (!IsQkvPart(t.name())) continue;
    const std::string p = QkvPrefix(t.name());
    const bool fused_there = donor.params_.count(p + "qkv.bias") > 0 &&
                             (donor.params_.count(p + "qkv.weight") > 0 || donor.packed_.count(p + "qkv.weight") > 0);
    if (qkv_parts[p] == 6 && qkv_alike[p] == 6 && fused_there) taken.push_back(t.name());
  }
  return taken;
}

void BertShard::Impl::TakeFromDonor(const Impl& donor, const v1::TensorShard& t, bool share) {
  // Copied only when it lies in the donor's arena (read transposed there) and the donor is not
  // wholly taken: a shared tensor would keep the whole arena mapped.
  const auto keep = [share](const at::Tensor& held, bool in_arena) { return share || !in_arena ? held : held.clone(); };
  if (IsQkvPart(t.name())) {
    const std::string p = QkvPrefix(t.name());
    if (params_.count(p + "qkv.bias") > 0) return;  // the layer's fused pair is taken already
    params_[p + "qkv.bias"] = donor.params_.at(p + "qkv.bias");
    if (auto w = donor.params_.find(p + "qkv.weight"); w != donor.params_.end()) params_[p + "qkv.weight"] = w->second;
    if (auto w = donor.packed_.find(p + "qkv.weight"); w != donor.packed_.end()) {
      const bool in_arena = gemm_ == GemmPath::kOneDnn && OneDnnPacksByTransposing(dtype_, device_);
      packed_[p + "qkv.weight"] = keep(w->second, in_arena);
    }
    return;
  }
  std::vector<std::string> names = {t.name()};
  names.insert(names.end(), t.aliases().begin(), t.aliases().end());
  at::Tensor dense, packed;
  if (auto d = donor.params_.find(t.name()); d != donor.params_.end()) dense = d->second;
  if (auto k = donor.packed_.find(t.name()); k != donor.packed_.end()) packed = keep(k->second, TransposesAtLoad(t));
  for (const std::string& name : names) {
    if (dense.defined()) params_[name] = dense;
    if (packed.defined()) packed_[name] = packed;
  }
  padding_bytes_ += PaddingBytes(t);
}

}  // namespace bertshard::model
