#include "model/bert_shard.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <malloc.h>
#include <sys/mman.h>
#include <torch/version.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <new>
#include <stdexcept>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "model/gemm.h"
#include "model/torch_compat.h"
#include "model/torch_status.h"
#include "planner/model_config.h"
#include "planner/stage_layout.h"

namespace bertshard::model {
namespace {

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// The lookup tables of the embeddings: the only 2-D parameters that no linear reads (except the
// word embeddings tied to the LM decoder, which are read under both names).
bool IsEmbeddingTable(const std::string& name) { return absl::EndsWith(name, "_embeddings.weight"); }

// A tiny run of every op the forward uses, in `dtype` on `device`: LibTorch 1.13 has no CPU kernel
// for fp16 products, norms or activations, and finding that out at load beats failing mid-forward.
absl::Status ProbeKernels(at::ScalarType dtype, c10::Device device, const std::string& name) {
  const auto options = at::TensorOptions().dtype(dtype).device(device);
  const char* op = "";
  try {
    const at::Tensor x = at::ones({1, 2, 4}, options), w = at::ones({4, 4}, options), b = at::ones({4}, options);
    op = "linear";
    at::linear(x, w, b);
    op = "matmul";
    at::matmul(x, x.transpose(-1, -2));
    op = "layer_norm";
    at::layer_norm(x, {4}, b, b, 1e-12);
    op = "softmax";
    at::softmax(x, -1);
    op = "gelu";
    at::gelu(x);
    at::gelu(x, "tanh");
    op = "tanh";
    at::tanh(x);
    op = "embedding";
    at::embedding(w, at::zeros({1, 2}, at::TensorOptions().dtype(at::kLong).device(device)));
  } catch (const std::exception&) {
    return absl::FailedPreconditionError(
        absl::StrCat("dtype ", name, " cannot run on ", device.str(), " with this LibTorch (", TORCH_VERSION,
                     "): it has no ", op, " kernel for it", device.is_cpu() ? "; on CPU use fp32 or bf16" : ""));
  }
  return absl::OkStatus();
}

// The LibTorch type of a plan's dtype (unset: float32).
at::ScalarType ScalarTypeOf(v1::Dtype dtype) {
  switch (dtype) {
    case v1::BF16:
      return at::kBFloat16;
    case v1::FP16:
      return at::kHalf;
    default:
      return at::kFloat;
  }
}

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

// One mapping for a rank's packed linear weights, which never change after load, outside malloc's
// heap: the load's transient buffers (the read scratch, biases, the embeddings' conversions) cannot
// end up between the weights, where glibc keeps freed holes mapped. BERT-base, one rank, 2
// threads: peak RSS 717 -> 680 MiB, measured. Tensors carved from it keep it alive (their deleters
// hold it); it is unmapped with the last of them. (Transparent huge pages for it were tried: on
// this VM they made loads 1.0-1.4 s instead of 0.3 s, so it has plain pages.)
class WeightArena {
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

// One pipeline slot in route order: which stage runs it and the layers it covers.
struct Slot {
  int stage = 0;
  int64_t start = 0, end = 0;
};

}  // namespace

class BertShard::Impl {
 public:
  Impl(const v1::ShardPlan& plan, int rank, c10::Device device, GemmPath gemm)
      : plan_(plan),
        rank_(rank),
        device_(device),
        gemm_(device.is_cpu() ? gemm : GemmPath::kBlas),
        dtype_(ScalarTypeOf(plan.dtype())) {
    const auto& sc = plan.shard_config();
    tp_ = std::max(1, sc.tensor_parallel_size());
    stage_ = rank / tp_;
    tp_rank_ = rank % tp_;
    sp_ = sc.sp_mode() == v1::SPLIT_GATHER && tp_ > 1;
    prefix_ = plan.variant() == v1::BERT_MODEL ? "" : "bert.";
    const int stages = plan.stages_size();
    const int slots = plan.layers_per_stage_size();
    // The route over the slots, as the plan's stages hold them.
    std::vector<int64_t> prefix_sum(static_cast<size_t>(slots) + 1, 0);
    for (int k = 0; k < slots; ++k) prefix_sum[k + 1] = prefix_sum[k] + plan.layers_per_stage(k);
    for (int k = 0; k < slots; ++k) {
      const int stage = static_cast<int>(planner::SlotStage(k, stages, sc.pp_style() == v1::ZBV));
      route_.push_back({stage, prefix_sum[k], prefix_sum[k + 1]});
    }
    for (int s = 0; s < stages; ++s) {
      if (plan.stages(s).is_last()) head_stage_ = s;
    }
  }

  absl::Status LoadTensors(const checkpoint::Checkpoint& ckpt, const BertShard::Progress& progress,
                           int64_t* param_bytes) {
    const v1::RankShard* mine = nullptr;
    for (const auto& r : plan_.ranks()) {
      if (r.rank() == rank_) mine = &r;
    }
    if (mine == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("rank ", rank_, " is not in the plan (world size ", plan_.world_size(), ")"));
    }
    *param_bytes = 0;
    int64_t arena_bytes = 0;
    for (const v1::TensorShard& t : mine->tensors()) {
      if (TransposesAtLoad(t)) arena_bytes += WeightArena::Bytes(t.local_shape(0) * t.local_shape(1));
    }
    // A layer's fused QKV weight takes its three parts' bytes; the slack covers its alignment.
    if (arena_bytes > 0) arena_ = WeightArena::Create(arena_bytes + 64 * static_cast<int64_t>(mine->tensors_size()));
    for (const v1::TensorShard& t : mine->tensors()) {
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

  // Reads `t` into a dense tensor in the shard's dtype and device, and keeps it under its names
  // (and packed, where a linear reads it on the oneDNN path).
  absl::Status ReadDense(const v1::TensorShard& t, const checkpoint::SafetensorsFile& file,
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
    int64_t row_elements = 1;
    for (int i = 1; i < t.local_shape_size(); ++i) row_elements *= t.local_shape(i);
    padding_bytes_ += t.padding() * row_elements * static_cast<int64_t>(c10::elementSize(dtype_));
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

  // Whether tensor `t` goes from the file straight into the transposed form the oneDNN sgemm path
  // multiplies (PackOneDnnWeight's), with no dense copy of it ever made: a float32 CPU weight that
  // only linears read, with no padding rows to fill. The dense-then-pack route held both copies of
  // a weight at once (the load's RSS high-water mark) and transposed at 2-4 GB/s.
  bool TransposesAtLoad(const v1::TensorShard& t) const {
    if (gemm_ != GemmPath::kOneDnn || !OneDnnPacksByTransposing(dtype_, device_) || t.padding() > 0 ||
        t.local_shape_size() != 2) {
      return false;
    }
    if (IsQkvPart(t.name())) return absl::EndsWith(t.name(), ".weight");
    const LinearUse use = UseOf(t);
    return use.read_by_linear && !use.looked_up;
  }

  // The load's scratch buffer, grown to at least `elements` floats and reused across tensors.
  float* Scratch(int64_t elements) {
    if (!load_scratch_.defined() || load_scratch_.numel() < elements) load_scratch_ = at::empty({elements});
    return load_scratch_.data_ptr<float>();
  }

  // Reads `t` into a scratch buffer reused across tensors and transposes it into its packed
  // tensor: a query, key or value weight into its third of the layer's fused [in, 3 x width] one,
  // anything else into its own [in, out].
  absl::Status ReadTransposed(const v1::TensorShard& t, const checkpoint::SafetensorsFile& file,
                              const checkpoint::TensorInfo& info, const checkpoint::Slice& slice) {
    const int64_t rows = t.local_shape(0), cols = t.local_shape(1);
    RETURN_IF_ERROR(file.ReadSlice(info, slice, Scratch(rows * cols)));
    if (const int part = QkvPartIndex(t.name()); part >= 0) {
      const std::string p = QkvPrefix(t.name());
      QkvInPlace& fused = qkv_in_place_[p];
      if (!fused.weight.defined()) fused.weight = arena_->Empty({cols, 3 * rows}, arena_);
      TransposeInto(load_scratch_.data_ptr<float>(), rows, cols, fused.weight.data_ptr<float>() + part * rows,
                    3 * rows);
      ++fused.parts;
      return absl::OkStatus();
    }
    at::Tensor packed = arena_->Empty({cols, rows}, arena_);
    TransposeInto(load_scratch_.data_ptr<float>(), rows, cols, packed.data_ptr<float>(), rows);
    packed_[t.name()] = packed;
    for (const auto& a : t.aliases()) packed_[a] = packed;
    return absl::OkStatus();
  }

  // A layer's query, key and value weights (this rank's heads of each) become one [3 x local
  // width, hidden] weight and one bias, in that order: one product with three times the columns
  // instead of three, which keeps the GEMM's cores busier. Done as soon as the layer's six tensors
  // are in (`part_name` is one of them), so that the parts and the concatenation are freed while
  // the load goes on and their memory serves the next layer's: fused all at the end, they left
  // ~170 MiB of freed holes in the heap of a BERT-base rank. The bytes held are unchanged.
  void FuseQkvOnceWhole(const std::string& part_name) {
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

  bool holds_heads() const { return stage_ == head_stage_; }
  int64_t padding_bytes() const { return padding_bytes_; }
  GemmPath gemm_path() const { return gemm_; }
  at::ScalarType dtype() const { return dtype_; }

  absl::StatusOr<std::map<std::string, at::Tensor>> Forward(const ModelInputs& in, int micro_batches,
                                                            Collectives* comm) {
    RETURN_IF_ERROR(Validate(in, micro_batches, comm));
    comm_ = comm;
    const int64_t rows = in.input_ids.size(0);
    const int64_t batch = rows / in.choices;
    std::vector<ModelInputs> mbs;
    int64_t batch_start = 0;
    for (int m = 0; m < micro_batches; ++m) {
      const int64_t size = batch / micro_batches + (m < batch % micro_batches ? 1 : 0);
      const int64_t r0 = batch_start * in.choices, nrows = size * in.choices;
      batch_start += size;
      mbs.push_back({ToDevice(in.input_ids.narrow(0, r0, nrows)), ToDevice(in.attention_mask.narrow(0, r0, nrows)),
                     ToDevice(in.token_type_ids.narrow(0, r0, nrows)), in.choices});
    }
    std::map<std::string, std::vector<at::Tensor>> pieces;
    ASSIGN_OR_RETURN(pieces, RunMicroBatches(mbs));
    std::map<std::string, at::Tensor> outputs;
    for (auto& [name, list] : pieces) outputs[name] = at::cat(list, 0).to(at::kFloat);
    // On a GPU the forward (every collective included) is only queued so far: wait for it within
    // the group's timeout, so that the copies below find it done instead of blocking for ever
    // behind a collective whose peer is gone.
    RETURN_IF_ERROR(comm_->Synchronize());
    for (auto& [name, t] : outputs) t = ToHost(t);
    return outputs;
  }

 private:
  absl::Status Validate(const ModelInputs& in, int micro_batches, Collectives* comm) const {
    const v1::BertConfig& c = plan_.config();
    if (comm == nullptr || comm->tp_size() != tp_ || comm->tp_rank() != tp_rank_) {
      return absl::InternalError("collectives do not match the plan's tensor-parallel group");
    }
    if (in.input_ids.dim() != 2 || in.input_ids.sizes() != in.attention_mask.sizes() ||
        in.input_ids.sizes() != in.token_type_ids.sizes()) {
      return absl::InvalidArgumentError(
          "input_ids, attention_mask and token_type_ids must share one [rows, seq] shape");
    }
    const int64_t rows = in.input_ids.size(0), seq = in.input_ids.size(1);
    if (rows < 1 || seq < 1) return absl::InvalidArgumentError("inputs must hold at least one token");
    if (in.choices < 1 || rows % in.choices != 0) {
      return absl::InvalidArgumentError("rows must be a whole number of choice groups");
    }
    if ((in.choices > 1) != (plan_.variant() == v1::BERT_FOR_MULTIPLE_CHOICE)) {
      return absl::InvalidArgumentError(
          "inputs are [batch, choices, seq] exactly for BertForMultipleChoice, [batch, seq] otherwise");
    }
    if (seq > c.max_position_embeddings()) {
      return absl::InvalidArgumentError(
          absl::StrCat("sequence length ", seq, " exceeds max_position_embeddings ", c.max_position_embeddings()));
    }
    if (sp_ && seq % tp_ != 0) {
      return absl::InvalidArgumentError(absl::StrCat("split_gather sequence parallelism needs the sequence length (",
                                                     seq, ") to be a multiple of tp_size ", tp_));
    }
    if (in.input_ids.min().item<int64_t>() < 0 || in.input_ids.max().item<int64_t>() >= c.vocab_size()) {
      return absl::InvalidArgumentError(absl::StrCat("input_ids must be in [0, vocab_size ", c.vocab_size(), ")"));
    }
    if (in.token_type_ids.min().item<int64_t>() < 0 || in.token_type_ids.max().item<int64_t>() >= c.type_vocab_size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("token_type_ids must be in [0, type_vocab_size ", c.type_vocab_size(), ")"));
    }
    const int64_t batch = rows / in.choices;
    if (micro_batches < 1 || micro_batches > batch) {
      return absl::InvalidArgumentError(
          absl::StrCat("micro_batches must be in 1..batch size ", batch, ", got ", micro_batches));
    }
    return absl::OkStatus();
  }

  const at::Tensor& P(const std::string& name) const { return params_.at(name); }

  // Inputs reach a GPU from pinned (page-locked) host memory, copied asynchronously: the host goes
  // on queueing kernels instead of staging a pageable copy. On CPU: the tensor itself.
  at::Tensor ToDevice(const at::Tensor& host) const {
    if (!device_.is_cuda()) return host.to(device_);
    return host.pin_memory().to(at::TensorOptions().device(device_), /*non_blocking=*/true);
  }

  // An output on the host: from a GPU, copied into pinned memory (about twice the bandwidth of a
  // pageable copy). Blocking, and so complete on return whatever the collectives are; called once
  // the device work is done, so it cannot wait on a stuck GPU.
  at::Tensor ToHost(const at::Tensor& t) const {
    if (!t.is_cuda()) return t;
    at::Tensor host = at::empty(t.sizes(), at::TensorOptions().dtype(t.scalar_type()).pinned_memory(true));
    host.copy_(t);
    return host;
  }

  double Lowest() const {
    switch (dtype_) {
      case at::kBFloat16:
        return static_cast<double>(std::numeric_limits<c10::BFloat16>::lowest());
      case at::kHalf:
        return static_cast<double>(std::numeric_limits<c10::Half>::lowest());
      default:
        return std::numeric_limits<float>::lowest();
    }
  }

  // On the oneDNN path, packs `local` (tensor `t` of the plan) once if a linear reads it, under
  // each of its names. Returns whether the dense copy is still needed: always on the BLAS path;
  // on the oneDNN path for everything but linear weights, and for the word embeddings tied to the
  // LM decoder where this rank looks them up (a decoder on a later stage has them as an alias it
  // never looks up).
  bool PackIfLinearWeight(const v1::TensorShard& t, const at::Tensor& local) {
    if (gemm_ != GemmPath::kOneDnn || local.dim() != 2 || IsQkvPart(t.name())) return true;
    const LinearUse use = UseOf(t);
    if (!use.read_by_linear) return true;
    const at::Tensor packed = PackOneDnnWeight(local);
    packed_[t.name()] = packed;
    for (const auto& a : t.aliases()) packed_[a] = packed;
    return use.looked_up;
  }

  // How this rank reads a 2-D tensor under its names: as a linear's weight, and as an embedding
  // table it looks rows up in (the word embeddings tied to the LM decoder can be both).
  struct LinearUse {
    bool read_by_linear = false, looked_up = false;
  };
  LinearUse UseOf(const v1::TensorShard& t) const {
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

  // In place: `x` is always a product's fresh output, so no second buffer of its size is needed.
  at::Tensor Act(at::Tensor x) const {
    const std::string& act = plan_.config().hidden_act();
    if (act == "relu") return at::relu_(x);
    if (act == "gelu_new" || act == "gelu_pytorch_tanh") return at::gelu_(x, "tanh");
    return at::gelu_(x);  // "gelu": the exact (erf) form
  }

  // The residual stream -- every LayerNorm and the hidden states between layers and stages -- is
  // float32 whatever the dtype; only the products (and the attention between them) run in it, as
  // autocast runs a model. All-bf16 residuals lose ~3x more: 1.6% against 0.5% relative L2 error
  // over 12 random BERT-base layers (measured with Debian's torch). The norm's parameters are
  // held in the dtype and widened per call (2 x hidden elements).
  at::Tensor Norm(const at::Tensor& x, const std::string& module) const {
    const at::Tensor& weight = P(module + ".weight");
    const at::Tensor& bias = P(module + ".bias");
    const double eps = plan_.config().layer_norm_eps();
    if (dtype_ == at::kFloat) return at::layer_norm(x, {x.size(-1)}, weight, bias, eps);
    return at::layer_norm(x.to(at::kFloat), {x.size(-1)}, weight.to(at::kFloat), bias.to(at::kFloat), eps);
  }

  // In the dtype: float32 hidden states are narrowed on the way in.
  at::Tensor Linear(const at::Tensor& x, const std::string& module) const {
    const at::Tensor in = x.to(dtype_);  // the tensor itself when already in the dtype
    if (gemm_ == GemmPath::kOneDnn) return OneDnnLinear(in, packed_.at(module + ".weight"), P(module + ".bias"));
    return at::linear(in, P(module + ".weight"), P(module + ".bias"));
  }

  // Linear1D_Row: this rank's input features times its weight columns, summed over the group
  // (or reduce-scattered along the sequence under split_gather), then the whole bias once; plus
  // `residual`. The sums are in place: the product is a fresh buffer.
  absl::StatusOr<at::Tensor> RowLinear(const at::Tensor& x, const std::string& module, const at::Tensor& residual) {
    const at::Tensor in = x.to(dtype_);  // the tensor itself when already in the dtype
    at::Tensor y = gemm_ == GemmPath::kOneDnn ? OneDnnLinear(in, packed_.at(module + ".weight"), at::Tensor())
                                              : at::matmul(in, P(module + ".weight").t());
    if (tp_ > 1) {
      if (sp_) {
        ASSIGN_OR_RETURN(y, comm_->ReduceScatter(y, 1));
      } else {
        RETURN_IF_ERROR(comm_->AllReduceSum(y));
      }
    }
    y.add_(P(module + ".bias"));
    // A float32 residual (the stream, under bf16) takes the sum in float32.
    return residual.scalar_type() == y.scalar_type() ? y.add_(residual) : residual + y;
  }

  // [mb, seq] ids -> [mb, seq, H] (full sequence on every TP rank).
  absl::StatusOr<at::Tensor> Embeddings(const ModelInputs& in) {
    const std::string word_name = prefix_ + "embeddings.word_embeddings.weight";
    const at::Tensor& word = P(word_name);
    const v1::TensorShard& shard = *shards_.at(word_name);
    at::Tensor words;
    if (tp_ > 1) {
      // VocabParallelEmbedding1D: ids outside this rank's rows look up row 0, are zeroed, and the
      // sum over the group assembles every token's row.
      const at::Tensor outside = (in.input_ids < shard.start()) | (in.input_ids >= shard.end());
      const at::Tensor local_ids = (in.input_ids - shard.start()).masked_fill(outside, 0);
      words = at::embedding(word, local_ids).masked_fill(outside.unsqueeze(-1), 0.0);
      RETURN_IF_ERROR(comm_->AllReduceSum(words));
    } else {
      words = at::embedding(word, in.input_ids);
    }
    const int64_t seq = in.input_ids.size(1);
    const at::Tensor positions = at::arange(seq, at::TensorOptions().dtype(at::kLong).device(device_));
    at::Tensor x = words + at::embedding(P(prefix_ + "embeddings.token_type_embeddings.weight"), in.token_type_ids);
    x = x + at::embedding(P(prefix_ + "embeddings.position_embeddings.weight"), positions).unsqueeze(0);
    return Norm(x, prefix_ + "embeddings.LayerNorm");
  }

  // HF's extended mask: 0 where attended, the dtype's lowest value where masked (finfo(dtype).min,
  // made in the dtype: float's lowest would round to -inf in bf16); decoders also mask future
  // positions. [mb, 1, 1 or seq, seq].
  at::Tensor ExtendedMask(const at::Tensor& attention_mask) const {
    at::Tensor m = attention_mask.to(dtype_);
    at::Tensor keep;
    if (plan_.variant() == v1::BERT_LM_HEAD_MODEL && plan_.config().is_decoder()) {
      const int64_t seq = m.size(1);
      const at::Tensor ids = at::arange(seq, at::TensorOptions().dtype(at::kLong).device(device_));
      const at::Tensor causal = (ids.unsqueeze(0) <= ids.unsqueeze(1)).to(dtype_);  // [q, k]
      keep = (causal.unsqueeze(0) * m.unsqueeze(1)).unsqueeze(1);
    } else {
      keep = m.unsqueeze(1).unsqueeze(2);
    }
    return (1.0 - keep) * Lowest();
  }

  // One encoder layer on this rank's heads. `x` is [mb, seq or seq/tp (split_gather), H].
  absl::StatusOr<at::Tensor> Layer(const at::Tensor& x, int64_t index, const at::Tensor& ext_mask) {
    const std::string p = absl::StrCat(prefix_, "encoder.layer.", index, ".");
    const v1::BertConfig& c = plan_.config();
    at::Tensor full = x;
    if (sp_) {
      // Linear1D_Col under split_gather gathers the sequence before its matmul; Q, K and V share
      // one gathered input.
      ASSIGN_OR_RETURN(full, comm_->AllGather(x, 1));
    }
    const int64_t head_dim = c.hidden_size() / c.num_attention_heads();
    const at::Tensor context =
        Attention(Linear(full, p + "attention.self.qkv"), ext_mask, c.num_attention_heads() / tp_, head_dim);
    ASSIGN_OR_RETURN(at::Tensor attn, RowLinear(context, p + "attention.output.dense", x));
    const at::Tensor x1 = Norm(attn, p + "attention.output.LayerNorm");
    at::Tensor x1_full = x1;
    if (sp_) {
      ASSIGN_OR_RETURN(x1_full, comm_->AllGather(x1, 1));
    }
    const at::Tensor inter = Act(Linear(x1_full, p + "intermediate.dense"));
    ASSIGN_OR_RETURN(at::Tensor out, RowLinear(inter, p + "output.dense", x1));
    return Norm(out, p + "output.LayerNorm");
  }

  // Scaled dot-product attention of `heads` heads from the fused projection `qkv` ([mb, seq, 3 x
  // heads x head_dim]: all queries, then keys, then values), into [mb, seq, heads x head_dim]:
  // softmax(q k^T / sqrt(head_dim) + mask) v per head, as HF's BertSelfAttention.
  at::Tensor Attention(const at::Tensor& qkv, const at::Tensor& ext_mask, int64_t heads, int64_t head_dim) const {
    const int64_t mb = qkv.size(0), seq = qkv.size(1), width = heads * head_dim;
    const double root = std::sqrt(static_cast<double>(head_dim));
    const DnnlSgemmFn sgemm = DnnlSgemm();
    if (sgemm != nullptr && qkv.is_cpu() && qkv.scalar_type() == at::kFloat && qkv.is_contiguous()) {
      // fp32 on CPU: each (sequence, head) is one task on LibTorch's threads, with oneDNN's small
      // GEMM (unlike OpenBLAS it runs concurrent calls in parallel: BERT-base's attention at
      // b8 x s128 took 18 ms a layer through OpenBLAS, 5 ms here): its scores, scaled and masked,
      // softmax in place, and its context written straight into its columns of the output. The
      // heads are read where the projection wrote them (the GEMM takes the row stride), so no
      // head is permuted or copied, and a [seq, seq] block stays in cache from its product to
      // its softmax to its second product.
      at::Tensor context = at::empty({mb, seq, width}, qkv.options());
      at::Tensor scores = at::empty({mb * heads, seq, seq}, qkv.options());
      const at::Tensor mask = ext_mask.to(at::kFloat);
      std::atomic<int> failure{0};
      at::parallel_for(0, mb * heads, 1, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          const int64_t b = i / heads, h = i % heads;
          const float* rows = qkv.data_ptr<float>() + b * seq * 3 * width;
          at::Tensor s = scores[i];
          int status = sgemm('N', 'T', seq, seq, head_dim, 1.f, rows + h * head_dim, 3 * width,
                             rows + width + h * head_dim, 3 * width, 0.f, s.data_ptr<float>(), seq);
          // Divided, then masked, as HF does (a scale folded into the product rounds differently).
          s.div_(root).add_(mask[b][0]);  // mask [1 or seq, seq]
          at::_softmax_out(s, s, -1, /*half_to_float=*/false);
          status |= sgemm('N', 'N', seq, head_dim, seq, 1.f, s.data_ptr<float>(), seq, rows + 2 * width + h * head_dim,
                          3 * width, 0.f, context.data_ptr<float>() + b * seq * width + h * head_dim, width);
          if (status != 0) failure = status;
        }
      });
      if (failure != 0) throw std::runtime_error(absl::StrCat("dnnl_sgemm failed with status ", failure.load()));
      return context;
    }
    // Other dtypes and devices: LibTorch's fused attention where it has one (2.x), else batched
    // products (for bf16 on CPU, oneDNN's batched matmul).
    const auto part = [&](int64_t index) {
      return qkv.narrow(2, index * width, width).view({mb, seq, heads, head_dim}).permute({0, 2, 1, 3});
    };
    return ScaledDotProductAttention(part(0), part(1), part(2), ext_mask.to(qkv.scalar_type()))
        .permute({0, 2, 1, 3})
        .reshape({mb, seq, width});
  }

  // The layers of one slot on a full-sequence hidden state; split and gathered around them under
  // split_gather (tensors between stages are full-sequence).
  absl::StatusOr<at::Tensor> RunSlot(const Slot& slot, at::Tensor hidden, const at::Tensor& ext_mask) {
    if (slot.start == slot.end) return hidden;
    if (sp_) {
      const int64_t part = hidden.size(1) / tp_;
      hidden = hidden.narrow(1, tp_rank_ * part, part).contiguous();
    }
    for (int64_t l = slot.start; l < slot.end; ++l) {
      ASSIGN_OR_RETURN(hidden, Layer(hidden, l, ext_mask));
    }
    if (sp_) {
      ASSIGN_OR_RETURN(hidden, comm_->AllGather(hidden, 1));
    }
    return hidden;
  }

  absl::StatusOr<at::Tensor> LmLogits(const at::Tensor& hidden) {
    at::Tensor t = Act(Linear(hidden, "cls.predictions.transform.dense"));
    t = Norm(t, "cls.predictions.transform.LayerNorm").to(dtype_);  // float32 out of the norm
    // VocabParallelLMHead1D with gather_output (PaddingLMHead without TP): padded rows are zero
    // weights and bias, and are cut off after the gather.
    at::Tensor logits = gemm_ == GemmPath::kOneDnn
                            ? OneDnnLinear(t, packed_.at("cls.predictions.decoder.weight"), P("cls.predictions.bias"))
                            : at::linear(t, P("cls.predictions.decoder.weight"), P("cls.predictions.bias"));
    if (tp_ > 1) {
      ASSIGN_OR_RETURN(logits, comm_->AllGather(logits, logits.dim() - 1));
    }
    return logits.narrow(-1, 0, plan_.config().vocab_size()).contiguous();
  }

  absl::StatusOr<std::map<std::string, at::Tensor>> Heads(const at::Tensor& hidden, int64_t choices) {
    std::map<std::string, at::Tensor> out;
    const v1::ModelVariant v = plan_.variant();
    at::Tensor pooled;
    if (planner::HasPooler(v)) {
      pooled = at::tanh(Linear(hidden.select(1, 0), prefix_ + "pooler.dense"));
    }
    switch (v) {
      case v1::BERT_MODEL:
        out["last_hidden_state"] = hidden;
        out["pooler_output"] = pooled;
        break;
      case v1::BERT_FOR_PRE_TRAINING: {
        ASSIGN_OR_RETURN(out["prediction_logits"], LmLogits(hidden));
        out["seq_relationship_logits"] = Linear(pooled, "cls.seq_relationship");
        break;
      }
      case v1::BERT_LM_HEAD_MODEL:
      case v1::BERT_FOR_MASKED_LM: {
        ASSIGN_OR_RETURN(out["logits"], LmLogits(hidden));
        break;
      }
      case v1::BERT_FOR_NEXT_SENTENCE_PREDICTION:
        out["logits"] = Linear(pooled, "cls.seq_relationship");
        break;
      case v1::BERT_FOR_SEQUENCE_CLASSIFICATION:
        out["logits"] = Linear(pooled, "classifier");
        break;
      case v1::BERT_FOR_TOKEN_CLASSIFICATION:
        out["logits"] = Linear(hidden, "classifier");
        break;
      case v1::BERT_FOR_MULTIPLE_CHOICE:
        out["logits"] = Linear(pooled, "classifier").view({-1, choices});
        break;
      case v1::BERT_FOR_QUESTION_ANSWERING: {
        const at::Tensor logits = Linear(hidden, "qa_outputs");
        out["start_logits"] = logits.select(-1, 0).contiguous();
        out["end_logits"] = logits.select(-1, 1).contiguous();
        break;
      }
      default:
        return absl::InternalError("plan has no model variant");
    }
    return out;
  }

  // Runs this rank's slots of the route for every micro-batch, receiving from and sending to the
  // neighbouring stages. The order is slot-major: each of this stage's slots for micro-batches 0..M-1,
  // then its next slot. With one slot per stage (plain PP) that is the usual pipeline; with several
  // (interleaved, V) a stage finishes its first chunk for every micro-batch while the later stages
  // start on theirs, so no stage waits for a micro-batch to come back round before it can go on
  // (depth-first, an interleaved stage would idle for each micro-batch's whole trip through the
  // others). Every rank walks (slot, micro-batch) in the same order and every item needs only the
  // item before it on the route, so every receive's send has been issued or will be without waiting
  // on it: no deadlock, since sends do not wait for their receive. Where a send does wait (NCCL
  // here: its kernel holds the rank's in-order communication stream until the peer receives),
  // slot-major could deadlock (a stage sending its second micro-batch while its peer sends back
  // the first), so those ranks go micro-batch-major: each micro-batch's whole route, in turn.
  // Returns the heads' outputs, one entry per micro-batch, in order.
  absl::StatusOr<std::map<std::string, std::vector<at::Tensor>>> RunMicroBatches(const std::vector<ModelInputs>& mbs) {
    const int slots = static_cast<int>(route_.size());
    const int micro_batches = static_cast<int>(mbs.size());
    const auto tag = [&](int k, int m) { return m * (slots + 1) + k; };
    const auto peer = [&](int stage) { return stage * tp_ + tp_rank_; };
    std::vector<at::Tensor> ext_masks, hidden(static_cast<size_t>(micro_batches));
    for (const ModelInputs& mb : mbs) ext_masks.push_back(ExtendedMask(mb.attention_mask));
    std::map<std::string, std::vector<at::Tensor>> pieces;
    std::vector<std::pair<int, int>> items;  // (slot, micro-batch), in the order this rank runs them
    for (int outer = 0; outer < (comm_->SendsReturnAtOnce() ? slots : micro_batches); ++outer) {
      for (int inner = 0; inner < (comm_->SendsReturnAtOnce() ? micro_batches : slots); ++inner) {
        const int k = comm_->SendsReturnAtOnce() ? outer : inner, m = comm_->SendsReturnAtOnce() ? inner : outer;
        if (route_[static_cast<size_t>(k)].stage == stage_) items.emplace_back(k, m);
      }
    }
    for (const auto& [k, m] : items) {
      const Slot& slot = route_[static_cast<size_t>(k)];
      {
        const ModelInputs& mb = mbs[static_cast<size_t>(m)];
        at::Tensor& h = hidden[static_cast<size_t>(m)];
        if (k == 0) {
          ASSIGN_OR_RETURN(h, Embeddings(mb));
        } else if (route_[static_cast<size_t>(k) - 1].stage != stage_) {
          h = at::empty({mb.input_ids.size(0), mb.input_ids.size(1), plan_.config().hidden_size()},
                        at::TensorOptions().dtype(at::kFloat).device(device_));  // the float32 stream
          RETURN_IF_ERROR(comm_->Recv(h, peer(route_[static_cast<size_t>(k) - 1].stage), tag(k, m)));
        }  // else: this stage ran slot k - 1 too, and `h` holds its output
        ASSIGN_OR_RETURN(h, RunSlot(slot, h, ext_masks[static_cast<size_t>(m)]));
        if (k == slots - 1) {
          std::map<std::string, at::Tensor> outputs;
          ASSIGN_OR_RETURN(outputs, Heads(h, mb.choices));
          for (auto& [name, t] : outputs) pieces[name].push_back(t);
          h = at::Tensor();
        } else if (route_[static_cast<size_t>(k) + 1].stage != stage_) {
          RETURN_IF_ERROR(comm_->Send(h.contiguous(), peer(route_[static_cast<size_t>(k) + 1].stage), tag(k + 1, m)));
          h = at::Tensor();  // the send holds what it needs until WaitForSends
        }
      }
    }
    return pieces;
  }

  const v1::ShardPlan plan_;
  const int rank_;
  const c10::Device device_;
  const GemmPath gemm_;
  const at::ScalarType dtype_;
  int tp_ = 1, stage_ = 0, tp_rank_ = 0, head_stage_ = 0;
  bool sp_ = false;
  std::string prefix_;
  std::vector<Slot> route_;
  std::map<std::string, at::Tensor> params_;              // by state-dict name and alias
  std::map<std::string, at::Tensor> packed_;              // oneDNN path: the linears' weights, by name and alias
  std::map<std::string, const v1::TensorShard*> shards_;  // points into plan_
  // While loading: each layer's fused, packed QKV weight as its parts arrive (ReadTransposed), by
  // the layer's "...attention.self." prefix, and the buffer every transposed tensor is read into.
  struct QkvInPlace {
    at::Tensor weight;
    int parts = 0;
  };
  std::map<std::string, QkvInPlace> qkv_in_place_;
  at::Tensor load_scratch_;
  std::shared_ptr<WeightArena> arena_;  // what ReadTransposed writes into
  Collectives* comm_ = nullptr;         // set for the duration of Forward
  int64_t padding_bytes_ = 0;
};

BertShard::BertShard(std::unique_ptr<Impl> impl, int stage, int64_t param_bytes)
    : impl_(std::move(impl)), stage_(stage), param_bytes_(param_bytes) {}

BertShard::~BertShard() = default;

bool BertShard::holds_heads() const { return impl_->holds_heads(); }
int64_t BertShard::padding_bytes() const { return impl_->padding_bytes(); }
GemmPath BertShard::gemm_path() const { return impl_->gemm_path(); }
at::ScalarType BertShard::dtype() const { return impl_->dtype(); }

absl::StatusOr<std::unique_ptr<BertShard>> BertShard::Load(const v1::ShardPlan& plan, int rank,
                                                           const checkpoint::Checkpoint& checkpoint, c10::Device device,
                                                           const Progress& progress) {
  return Load(plan, rank, checkpoint, LoadOptions{device, GemmPath::kBlas, progress});
}

absl::StatusOr<std::unique_ptr<BertShard>> BertShard::Load(const v1::ShardPlan& plan, int rank,
                                                           const checkpoint::Checkpoint& checkpoint,
                                                           const LoadOptions& options) {
  if (rank < 0 || rank >= plan.world_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " is outside the plan's world of ", plan.world_size()));
  }
  try {
    auto impl = std::make_unique<Impl>(plan, rank, options.device, options.gemm);
    RETURN_IF_ERROR(GemmPathAvailable(impl->gemm_path()));  // before reading anything
    RETURN_IF_ERROR(ProbeKernels(impl->dtype(), options.device, planner::DtypeName(plan.dtype())));
    int64_t bytes = 0;
    RETURN_IF_ERROR(impl->LoadTensors(checkpoint, options.progress, &bytes));
#ifdef __GLIBC__
    // The load's transient buffers (tensors read before conversion or packing) are free but may
    // sit between live ones, where glibc keeps them mapped: give their pages back.
    malloc_trim(0);
#endif
    const int tp = std::max(1, plan.shard_config().tensor_parallel_size());
    return std::unique_ptr<BertShard>(new BertShard(std::move(impl), rank / tp, bytes));
  } catch (const std::exception& e) {
    // A CUDA device too small for the shard is RESOURCE_EXHAUSTED, naming it.
    return StatusFromTorchError(e, absl::StrCat("loading rank ", rank, " on ", options.device.str()));
  }
}

GemmChoice PickGemmPathForPlan(const v1::ShardPlan& plan) {
  constexpr int64_t kRows = 8 * 128;
  const int64_t tp = std::max(1, plan.shard_config().tensor_parallel_size());
  const at::ScalarType dtype = ScalarTypeOf(plan.dtype());
  // fp16 has no CPU products to time (LibTorch 1.13): the float32 figures stand in.
  return PickGemmPath(kRows, plan.config().hidden_size(), plan.config().intermediate_size() / tp,
                      dtype == at::kHalf ? at::kFloat : dtype);
}

absl::StatusOr<std::map<std::string, at::Tensor>> BertShard::Forward(const ModelInputs& inputs, int micro_batches,
                                                                     Collectives* collectives) {
  absl::StatusOr<std::map<std::string, at::Tensor>> outputs;
  try {
    outputs = impl_->Forward(inputs, micro_batches, collectives);
  } catch (const std::exception& e) {
    // Shapes and ids are validated first, so an escaped torch error is our bug, or the device's
    // memory running out (RESOURCE_EXHAUSTED).
    outputs = StatusFromTorchError(e, "forward");
  }
  // Pipeline sends overlap the next micro-batch; the forward ends when they are all through.
  if (collectives != nullptr) {
    absl::Status sent = collectives->WaitForSends();
    if (outputs.ok() && !sent.ok()) return sent;
  }
  return outputs;
}

}  // namespace bertshard::model
