// File: model/bert_shard.h
// -----------------------------------------------------------------------------
// One rank's part of a sharded HuggingFace BERT (eval mode), built exactly from its ShardPlan:
// the rank loads the tensors its plan lists (slices, padding, aliases) and runs the modules its
// stage holds, with the collectives the plan's layers imply -- column/row-parallel linears over
// its attention heads, vocabulary-parallel embedding and LM head, split_gather sequence
// parallelism, and pipeline transfers along the plan's route (1F1B, interleaved chunks, ZBV).
// It never re-derives sharding: every slice comes from the plan.
//
// Example (one rank of a TP 2 x PP 2 plan):
//   ASSIGN_OR_RETURN(auto shard, BertShard::Load(plan, /*rank=*/3, *checkpoint));
//   ASSIGN_OR_RETURN(auto outputs, shard->Forward(inputs, /*micro_batches=*/2, &collectives));
//   // On the ranks of the stage that holds the heads: {"logits": [batch, seq, vocab]}; else {}.
//
// Thread safety: thread-compatible; Forward uses the intra-op thread pool of LibTorch.
#ifndef BERTSHARD_MODEL_BERT_SHARD_H_
#define BERTSHARD_MODEL_BERT_SHARD_H_

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "bertshard/v1/plan.pb.h"
#include "checkpoint/checkpoint.h"
#include "model/collectives.h"
#include "model/gemm.h"

namespace bertshard::model {

// Token inputs, int64 tensors of shape [rows, seq]; rows = batch, or batch x choices for
// BertForMultipleChoice (then `choices` > 1).
struct ModelInputs {
  at::Tensor input_ids;
  at::Tensor attention_mask;  // 1 = attend, 0 = padding
  at::Tensor token_type_ids;
  int64_t choices = 1;
};

// What a forward returns besides (or instead of) the variant's outputs.
struct ForwardOptions {
  // LM heads (BertForMaskedLM, BertLMHeadModel, BertForPreTraining) only: instead of the head's
  // outputs, every tensor-parallel rank of the head stage returns "sparse_embedding" [rows, n] for
  // its own slice of the vocabulary (BertShard::lm_vocab_slice: n ids from `first`), never
  // gathered: SPLADE's max over a row's attended positions of log(1 + relu(logit)), in float32.
  // INVALID_ARGUMENT, before any compute, for other variants.
  bool splade = false;
};

// The ids of the vocabulary whose LM logits a rank computes: [first, first + size), padding rows
// excluded (size may be 0 on a rank that holds only padding).
struct VocabSlice {
  int64_t first = 0;
  int64_t size = 0;
};

class BertShard {
 public:
  // Reads the tensors rank `rank` holds in `plan` from `checkpoint` (only the byte ranges of its
  // slices). Errors: INVALID_ARGUMENT for a rank outside the plan, NOT_FOUND / INVALID_ARGUMENT
  // naming a tensor that is missing or misshaped in the checkpoint.
  // `device` is where the parameters live and the forward runs (CPU, or a CUDA device with a
  // CUDA-enabled LibTorch).
  //
  // The parameters are converted to the plan's dtype; FAILED_PRECONDITION, before reading any
  // tensor, when this LibTorch has no kernels for it on `device` (fp16 on CPU with LibTorch 1.13).
  //
  // `progress`, if set, is called after each tensor with (tensors loaded, tensors in total, bytes
  // loaded in the plan's dtype, param_bytes); returning false stops the load with CANCELLED.
  using Progress = std::function<bool(int loaded, int total, int64_t bytes, int64_t total_bytes)>;
  static absl::StatusOr<std::unique_ptr<BertShard>> Load(const v1::ShardPlan& plan, int rank,
                                                         const checkpoint::Checkpoint& checkpoint,
                                                         c10::Device device = c10::Device(c10::kCPU),
                                                         const Progress& progress = nullptr);

  struct LoadOptions {
    c10::Device device = c10::Device(c10::kCPU);
    // How the linears multiply (model/gemm.h). kOneDnn prepacks every linear weight at load and
    // needs a LibTorch with MKL-DNN (else FAILED_PRECONDITION). CUDA devices always take
    // at::linear, whatever this says.
    GemmPath gemm = GemmPath::kBlas;
    Progress progress;
    // An earlier shard of the same checkpoint on this process (the rank's shard before its replica
    // changed shape), or null: the tensors it holds as this load would make them (the same slice
    // of the same tensor, dtype, device and GEMM path) are taken from it instead of read. When this
    // load takes all of the donor's tensors it shares them; else it copies those the donor holds
    // in its weight arena, so that destroying the donor frees what was not taken. The donor must
    // not run a forward during the load, and may be destroyed after it.
    const BertShard* donor = nullptr;
  };
  // As above, with the GEMM path.
  static absl::StatusOr<std::unique_ptr<BertShard>> Load(const v1::ShardPlan& plan, int rank,
                                                         const checkpoint::Checkpoint& checkpoint,
                                                         const LoadOptions& options);

  ~BertShard();

  // Bytes of the tensors this rank holds, in the plan's dtype.
  int64_t param_bytes() const { return param_bytes_; }
  // Of those, the zero rows that pad the vocabulary (never read from the checkpoint).
  int64_t padding_bytes() const;
  // Of those, the bytes taken from LoadOptions::donor instead of read.
  int64_t kept_bytes() const;
  int stage() const { return stage_; }
  // The path the linears take: LoadOptions::gemm on CPU, kBlas on CUDA.
  GemmPath gemm_path() const;
  // What the parameters are held and the forward computes in: the plan's dtype (float32 when the
  // plan leaves it unset). Outputs are float32 whatever it is.
  at::ScalarType dtype() const;
  // Whether this rank's stage ends the pipeline route (and so returns the outputs).
  bool holds_heads() const;

  // Runs the forward over `micro_batches` slices of the batch (1 <= micro_batches <= rows), taking
  // part in every pipeline slot of this rank's stage. Inputs are CPU tensors. Returns the outputs
  // (CPU, float32; pinned memory when the shard is on a GPU) with HF names on ranks of the head
  // stage, {} elsewhere. Returns once the rank's device work is done (Collectives::Synchronize).
  // INVALID_ARGUMENT for inputs the plan cannot run (shapes, ids, lengths); a collective failure
  // is UNAVAILABLE; the device's memory running out is RESOURCE_EXHAUSTED.
  absl::StatusOr<std::map<std::string, at::Tensor>> Forward(const ModelInputs& inputs, int micro_batches,
                                                            Collectives* collectives);
  // As above, with `options` (ForwardOptions::splade: "sparse_embedding" on every rank of the head
  // stage, each for its lm_vocab_slice()).
  absl::StatusOr<std::map<std::string, at::Tensor>> Forward(const ModelInputs& inputs, int micro_batches,
                                                            Collectives* collectives, const ForwardOptions& options);

  // This rank's slice of the LM head's vocabulary; {0, 0} for variants without an LM head and on
  // ranks of other stages.
  VocabSlice lm_vocab_slice() const;

 private:
  class Impl;
  explicit BertShard(std::unique_ptr<Impl> impl, int stage, int64_t param_bytes);

  std::unique_ptr<Impl> impl_;
  const int stage_;
  const int64_t param_bytes_;
};

// "--gemm=auto" for a rank of `plan`: PickGemmPath (model/gemm.h) on its largest product, the
// intermediate linear as this rank holds it (hidden -> intermediate / tp), at a typical batch of
// 8 sequences of 128 tokens. Call after setting the LibTorch threads the forwards will use.
GemmChoice PickGemmPathForPlan(const v1::ShardPlan& plan);

}  // namespace bertshard::model

#endif  // BERTSHARD_MODEL_BERT_SHARD_H_
