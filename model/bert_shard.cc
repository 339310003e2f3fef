// File: model/bert_shard.cc
// -----------------------------------------------------------------------------
// BertShard (bert_shard.h): loading checked and run (the GEMM path, the dtype's kernels, torch
// errors as statuses), and BertShard::Impl's construction and forward schedule
// (bert_shard_impl.h): the inputs validated and split into micro-batches, each slot of the
// plan's route run for each micro-batch, with the pipeline's receives and sends between stages.
// The loading and the layer math are in bert_shard_loading.cc and bert_shard_layers.cc.
//
// Thread safety: thread-compatible, as BertShard.
#include "model/bert_shard.h"

#include <ATen/ATen.h>
#include <malloc.h>
#include <torch/version.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "model/bert_shard_impl.h"
#include "model/gemm.h"
#include "model/torch_status.h"
#include "planner/model_config.h"
#include "planner/stage_layout.h"

namespace bertshard::model {
namespace {

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
}  // namespace

BertShard::Impl::Impl(const v1::ShardPlan& plan, int rank, c10::Device device, GemmPath gemm)
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

absl::StatusOr<std::map<std::string, at::Tensor>> BertShard::Impl::Forward(const ModelInputs& in, int micro_batches,
                                                                           Collectives* comm,
                                                                           const ForwardOptions& options) {
  RETURN_IF_ERROR(Validate(in, micro_batches, comm, options));
  comm_ = comm;
  options_ = options;
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

absl::Status BertShard::Impl::Validate(const ModelInputs& in, int micro_batches, Collectives* comm,
                                       const ForwardOptions& options) const {
  const v1::BertConfig& c = plan_.config();
  if (comm == nullptr || comm->tp_size() != tp_ || comm->tp_rank() != tp_rank_) {
    return absl::InternalError("collectives do not match the plan's tensor-parallel group");
  }
  if (options.splade && !planner::IsLmVariant(plan_.variant())) {
    return absl::InvalidArgumentError(
        absl::StrCat("SPLADE sparse embeddings need an LM head; ", planner::HfClassName(plan_.variant()), " has none"));
  }
  if (in.input_ids.dim() != 2 || in.input_ids.sizes() != in.attention_mask.sizes() ||
      in.input_ids.sizes() != in.token_type_ids.sizes()) {
    return absl::InvalidArgumentError("input_ids, attention_mask and token_type_ids must share one [rows, seq] shape");
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
    return absl::InvalidArgumentError(absl::StrCat("split_gather sequence parallelism needs the sequence length (", seq,
                                                   ") to be a multiple of tp_size ", tp_));
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

at::Tensor BertShard::Impl::ToDevice(const at::Tensor& host) const {
  if (!device_.is_cuda()) return host.to(device_);
  return host.pin_memory().to(at::TensorOptions().device(device_), /*non_blocking=*/true);
}

at::Tensor BertShard::Impl::ToHost(const at::Tensor& t) const {
  if (!t.is_cuda()) return t;
  at::Tensor host = at::empty(t.sizes(), at::TensorOptions().dtype(t.scalar_type()).pinned_memory(true));
  host.copy_(t);
  return host;
}

absl::StatusOr<at::Tensor> BertShard::Impl::RunSlot(const Slot& slot, at::Tensor hidden, const at::Tensor& ext_mask) {
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

absl::StatusOr<std::map<std::string, std::vector<at::Tensor>>> BertShard::Impl::RunMicroBatches(
    const std::vector<ModelInputs>& mbs) {
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
        ASSIGN_OR_RETURN(outputs, Heads(h, mb));
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

BertShard::BertShard(std::unique_ptr<Impl> impl, int stage, int64_t param_bytes)
    : impl_(std::move(impl)), stage_(stage), param_bytes_(param_bytes) {}

BertShard::~BertShard() = default;

bool BertShard::holds_heads() const { return impl_->holds_heads(); }
int64_t BertShard::padding_bytes() const { return impl_->padding_bytes(); }
int64_t BertShard::kept_bytes() const { return impl_->kept_bytes(); }
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
    RETURN_IF_ERROR(GemmPathAvailable(
        impl->gemm_path(), options.device.is_cpu() ? impl->dtype() : at::kFloat));  // before reading anything
    RETURN_IF_ERROR(ProbeKernels(impl->dtype(), options.device, planner::DtypeName(plan.dtype())));
    int64_t bytes = 0;
    RETURN_IF_ERROR(impl->LoadTensors(checkpoint, options.progress, &bytes,
                                      options.donor != nullptr ? options.donor->impl_.get() : nullptr));
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
  return Forward(inputs, micro_batches, collectives, ForwardOptions());
}

VocabSlice BertShard::lm_vocab_slice() const { return impl_->LmVocabSlice(); }

absl::StatusOr<std::map<std::string, at::Tensor>> BertShard::Forward(const ModelInputs& inputs, int micro_batches,
                                                                     Collectives* collectives,
                                                                     const ForwardOptions& options) {
  absl::StatusOr<std::map<std::string, at::Tensor>> outputs;
  try {
    outputs = impl_->Forward(inputs, micro_batches, collectives, options);
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
