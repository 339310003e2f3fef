// File: model/bert_shard_impl.h
// -----------------------------------------------------------------------------
// Internal to //model:bert_shard. BertShard::Impl, the rank's state and work behind BertShard
// (bert_shard.h), declared once and defined in three files by concern:
//   bert_shard.cc          the public class, construction (the plan's route) and the forward's
//                          pipeline schedule over micro-batches and slots;
//   bert_shard_loading.cc  reading the rank's tensors from the checkpoint (slices, padding,
//                          aliases, the fused QKV, the oneDNN-packed weights);
//   bert_shard_layers.cc   the layer math: embeddings, encoder layers, attention, heads.
//
// Example (what BertShard::Load and BertShard::Forward do):
//   auto impl = std::make_unique<BertShard::Impl>(plan, rank, device, GemmPath::kBlas);
//   RETURN_IF_ERROR(impl->LoadTensors(checkpoint, /*progress=*/nullptr, &param_bytes));
//   ASSIGN_OR_RETURN(auto outputs, impl->Forward(inputs, /*micro_batches=*/2, &collectives, {}));
//
// Failure model: statuses for bad input (a rank outside the plan, a missing or misshaped tensor,
// inputs the plan cannot run, a failed collective); LibTorch errors escape as exceptions, which
// BertShard turns into statuses (model/torch_status.h).
// Thread safety: thread-compatible, as BertShard.
#ifndef BERTSHARD_MODEL_BERT_SHARD_IMPL_H_
#define BERTSHARD_MODEL_BERT_SHARD_IMPL_H_

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "bertshard/v1/plan.pb.h"
#include "checkpoint/checkpoint.h"
#include "model/bert_shard.h"
#include "model/collectives.h"
#include "model/gemm.h"

namespace bertshard::model {

class BertShard::Impl {
 public:
  Impl(const v1::ShardPlan& plan, int rank, c10::Device device, GemmPath gemm);

  // Loading (bert_shard_loading.cc): reads this rank's tensors of the plan from `ckpt`, taking
  // those `donor` (may be null) holds alike instead (BertShard::LoadOptions::donor).
  absl::Status LoadTensors(const checkpoint::Checkpoint& ckpt, const BertShard::Progress& progress,
                           int64_t* param_bytes, const Impl* donor);
  int64_t kept_bytes() const { return kept_bytes_; }

  bool holds_heads() const { return stage_ == head_stage_; }
  int64_t padding_bytes() const { return padding_bytes_; }
  GemmPath gemm_path() const { return gemm_; }
  at::ScalarType dtype() const { return dtype_; }
  // This rank's slice of the LM head's vocabulary (BertShard::lm_vocab_slice).
  VocabSlice LmVocabSlice() const;

  // The forward (bert_shard.cc).
  absl::StatusOr<std::map<std::string, at::Tensor>> Forward(const ModelInputs& in, int micro_batches, Collectives* comm,
                                                            const ForwardOptions& options);

 private:
  // One pipeline slot in route order: which stage runs it and the layers it covers.
  struct Slot {
    int stage = 0;
    int64_t start = 0, end = 0;
  };
  // The mapping the packed linear weights are carved from (bert_shard_loading.cc).
  class WeightArena;

  // --- Loading (bert_shard_loading.cc) ---

  // Reads `t` into a dense tensor in the shard's dtype and device, and keeps it under its names
  // (and packed, where a linear reads it on the oneDNN path).
  absl::Status ReadDense(const v1::TensorShard& t, const checkpoint::SafetensorsFile& file,
                         const checkpoint::TensorInfo& info, const checkpoint::Slice& slice,
                         const std::vector<int64_t>& global);

  // Whether tensor `t` goes from the file straight into the transposed form the oneDNN sgemm path
  // multiplies (PackOneDnnWeight's), with no dense copy of it ever made: a float32 CPU weight that
  // only linears read, with no padding rows to fill. The dense-then-pack route held both copies of
  // a weight at once (the load's RSS high-water mark) and transposed at 2-4 GB/s.
  bool TransposesAtLoad(const v1::TensorShard& t) const;

  // The load's scratch buffer, grown to at least `elements` floats and reused across tensors.
  float* Scratch(int64_t elements);

  // Reads `t` into a scratch buffer reused across tensors and transposes it into its packed
  // tensor: a query, key or value weight into its third of the layer's fused [in, 3 x width] one,
  // anything else into its own [in, out].
  absl::Status ReadTransposed(const v1::TensorShard& t, const checkpoint::SafetensorsFile& file,
                              const checkpoint::TensorInfo& info, const checkpoint::Slice& slice);

  // A layer's query, key and value weights (this rank's heads of each) become one [3 x local
  // width, hidden] weight and one bias, in that order: one product with three times the columns
  // instead of three, which keeps the GEMM's cores busier. Done as soon as the layer's six tensors
  // are in (`part_name` is one of them), so that the parts and the concatenation are freed while
  // the load goes on and their memory serves the next layer's: fused all at the end, they left
  // ~170 MiB of freed holes in the heap of a BERT-base rank. The bytes held are unchanged.
  void FuseQkvOnceWhole(const std::string& part_name);

  // On the oneDNN path, packs `local` (tensor `t` of the plan) once if a linear reads it, under
  // each of its names. Returns whether the dense copy is still needed: always on the BLAS path;
  // on the oneDNN path for everything but linear weights, and for the word embeddings tied to the
  // LM decoder where this rank looks them up (a decoder on a later stage has them as an alias it
  // never looks up).
  bool PackIfLinearWeight(const v1::TensorShard& t, const at::Tensor& local);

  // How this rank reads a 2-D tensor under its names: as a linear's weight, and as an embedding
  // table it looks rows up in (the word embeddings tied to the LM decoder can be both).
  struct LinearUse {
    bool read_by_linear = false, looked_up = false;
  };
  LinearUse UseOf(const v1::TensorShard& t) const;

  // Whether `donor` holds tensor `t` of this rank's table as this load would make it: the same
  // slice of the same tensor under the same names, in the same dtype, device and GEMM path, read
  // the same way (a linear's weight, an embedding table, transposed at load or not).
  bool HeldAlikeBy(const Impl& donor, const v1::TensorShard& t) const;
  // The names of this rank's tensors a load takes from `donor`: those it holds alike, a layer's
  // query, key and value only when all six are (it holds them fused).
  std::vector<std::string> TakenFrom(const Impl& donor, const v1::RankShard& mine) const;
  // Takes `t` from `donor` under each of its names (a QKV part: the layer's fused weight and bias,
  // once). With `share` the tensors are the donor's own; else those in its weight arena are
  // copied, so that the arena is freed with the donor (the rest are shared: each frees alone).
  void TakeFromDonor(const Impl& donor, const v1::TensorShard& t, bool share);
  // The bytes of `t`'s zero padding rows in the shard's dtype.
  int64_t PaddingBytes(const v1::TensorShard& t) const;

  // --- The forward's schedule (bert_shard.cc) ---

  // INVALID_ARGUMENT for inputs the plan cannot run (shapes, ids, lengths, micro-batches) and for
  // options its variant has no head for; INTERNAL for collectives of another tensor-parallel group.
  absl::Status Validate(const ModelInputs& in, int micro_batches, Collectives* comm,
                        const ForwardOptions& options) const;

  // Inputs reach a GPU from pinned (page-locked) host memory, copied asynchronously: the host goes
  // on queueing kernels instead of staging a pageable copy. On CPU: the tensor itself.
  at::Tensor ToDevice(const at::Tensor& host) const;

  // An output on the host: from a GPU, copied into pinned memory (about twice the bandwidth of a
  // pageable copy). Blocking, and so complete on return whatever the collectives are; called once
  // the device work is done, so it cannot wait on a stuck GPU.
  at::Tensor ToHost(const at::Tensor& t) const;

  // The layers of one slot on a full-sequence hidden state; split and gathered around them under
  // split_gather (tensors between stages are full-sequence).
  absl::StatusOr<at::Tensor> RunSlot(const Slot& slot, at::Tensor hidden, const at::Tensor& ext_mask);

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
  absl::StatusOr<std::map<std::string, std::vector<at::Tensor>>> RunMicroBatches(const std::vector<ModelInputs>& mbs);

  // --- The layer math (bert_shard_layers.cc) ---

  const at::Tensor& P(const std::string& name) const { return params_.at(name); }

  // The dtype's lowest finite value (HF's torch.finfo(dtype).min).
  double Lowest() const;

  // In place: `x` is always a product's fresh output, so no second buffer of its size is needed.
  at::Tensor Act(at::Tensor x) const;

  // The residual stream -- every LayerNorm and the hidden states between layers and stages -- is
  // float32 whatever the dtype; only the products (and the attention between them) run in it, as
  // autocast runs a model. All-bf16 residuals lose ~3x more: 1.6% against 0.5% relative L2 error
  // over 12 random BERT-base layers (measured with Debian's torch). The norm's parameters are
  // held in the dtype and widened per call (2 x hidden elements).
  at::Tensor Norm(const at::Tensor& x, const std::string& module) const;

  // In the dtype: float32 hidden states are narrowed on the way in.
  at::Tensor Linear(const at::Tensor& x, const std::string& module) const;

  // Linear1D_Row: this rank's input features times its weight columns, summed over the group
  // (or reduce-scattered along the sequence under split_gather), then the whole bias once; plus
  // `residual`. The sums are in place: the product is a fresh buffer.
  absl::StatusOr<at::Tensor> RowLinear(const at::Tensor& x, const std::string& module, const at::Tensor& residual);

  // [mb, seq] ids -> [mb, seq, H] (full sequence on every TP rank).
  absl::StatusOr<at::Tensor> Embeddings(const ModelInputs& in);

  // HF's extended mask: 0 where attended, the dtype's lowest value where masked (finfo(dtype).min,
  // made in the dtype: float's lowest would round to -inf in bf16); decoders also mask future
  // positions. [mb, 1, 1 or seq, seq].
  at::Tensor ExtendedMask(const at::Tensor& attention_mask) const;

  // One encoder layer on this rank's heads. `x` is [mb, seq or seq/tp (split_gather), H].
  absl::StatusOr<at::Tensor> Layer(const at::Tensor& x, int64_t index, const at::Tensor& ext_mask);

  // Scaled dot-product attention of `heads` heads from the fused projection `qkv` ([mb, seq, 3 x
  // heads x head_dim]: all queries, then keys, then values), into [mb, seq, heads x head_dim]:
  // softmax(q k^T / sqrt(head_dim) + mask) v per head, as HF's BertSelfAttention.
  at::Tensor Attention(const at::Tensor& qkv, const at::Tensor& ext_mask, int64_t heads, int64_t head_dim) const;

  // The LM head's transform and this rank's rows of the decoder: [mb, seq, padded vocab / tp]
  // logits in the dtype, ungathered.
  at::Tensor LocalLmLogits(const at::Tensor& hidden) const;

  // The LM head's logits over the real vocabulary (the padding rows cut off after the gather).
  absl::StatusOr<at::Tensor> LmLogits(const at::Tensor& hidden);

  // ForwardOptions::splade on this rank's vocabulary slice: [mb, lm_vocab_slice().size].
  at::Tensor SpladeSlice(const at::Tensor& hidden, const at::Tensor& attention_mask) const;

  // The variant's outputs by HF name, from the last slot's hidden state of micro-batch `mb`
  // (its choices regroup BertForMultipleChoice's rows; its mask pools SPLADE's maximum).
  absl::StatusOr<std::map<std::string, at::Tensor>> Heads(const at::Tensor& hidden, const ModelInputs& mb);

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
  ForwardOptions options_;              // the running Forward's
  int64_t padding_bytes_ = 0;
  int64_t kept_bytes_ = 0;  // of param bytes: taken from a donor, not read
};

}  // namespace bertshard::model

#endif  // BERTSHARD_MODEL_BERT_SHARD_IMPL_H_
