// File: model/bert_shard_layers.cc
// -----------------------------------------------------------------------------
// BertShard::Impl's layer math (bert_shard_impl.h), as HF's BERT modules compute it in eval mode
// on this rank's part: the embeddings (vocabulary-parallel under TP), the extended attention
// mask, the encoder layer (fused QKV, attention, column- and row-parallel linears with their
// collectives, split_gather), and the pooler and heads. The residual stream is float32 whatever
// the dtype (see Norm).
//
// Thread safety: thread-compatible; Attention runs on LibTorch's intra-op threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <stdexcept>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "model/bert_shard_impl.h"
#include "model/gemm.h"
#include "model/torch_compat.h"
#include "planner/model_config.h"

namespace bertshard::model {

double BertShard::Impl::Lowest() const {
  switch (dtype_) {
    case at::kBFloat16:
      return static_cast<double>(std::numeric_limits<c10::BFloat16>::lowest());
    case at::kHalf:
      return static_cast<double>(std::numeric_limits<c10::Half>::lowest());
    default:
      return std::numeric_limits<float>::lowest();
  }
}

at::Tensor BertShard::Impl::Act(at::Tensor x) const {
  const std::string& act = plan_.config().hidden_act();
  if (act == "relu") return at::relu_(x);
  if (act == "gelu_new" || act == "gelu_pytorch_tanh") return at::gelu_(x, "tanh");
  return at::gelu_(x);  // "gelu": the exact (erf) form
}

at::Tensor BertShard::Impl::Norm(const at::Tensor& x, const std::string& module) const {
  const at::Tensor& weight = P(module + ".weight");
  const at::Tensor& bias = P(module + ".bias");
  const double eps = plan_.config().layer_norm_eps();
  if (dtype_ == at::kFloat) return at::layer_norm(x, {x.size(-1)}, weight, bias, eps);
  return at::layer_norm(x.to(at::kFloat), {x.size(-1)}, weight.to(at::kFloat), bias.to(at::kFloat), eps);
}

at::Tensor BertShard::Impl::Linear(const at::Tensor& x, const std::string& module) const {
  const at::Tensor in = x.to(dtype_);  // the tensor itself when already in the dtype
  if (gemm_ == GemmPath::kOneDnn) return OneDnnLinear(in, packed_.at(module + ".weight"), P(module + ".bias"));
  return at::linear(in, P(module + ".weight"), P(module + ".bias"));
}

absl::StatusOr<at::Tensor> BertShard::Impl::RowLinear(const at::Tensor& x, const std::string& module,
                                                      const at::Tensor& residual) {
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

absl::StatusOr<at::Tensor> BertShard::Impl::Embeddings(const ModelInputs& in) {
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

at::Tensor BertShard::Impl::ExtendedMask(const at::Tensor& attention_mask) const {
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

absl::StatusOr<at::Tensor> BertShard::Impl::Layer(const at::Tensor& x, int64_t index, const at::Tensor& ext_mask) {
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

at::Tensor BertShard::Impl::Attention(const at::Tensor& qkv, const at::Tensor& ext_mask, int64_t heads,
                                      int64_t head_dim) const {
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

at::Tensor BertShard::Impl::LocalLmLogits(const at::Tensor& hidden) const {
  at::Tensor t = Act(Linear(hidden, "cls.predictions.transform.dense"));
  t = Norm(t, "cls.predictions.transform.LayerNorm").to(dtype_);  // float32 out of the norm
  return gemm_ == GemmPath::kOneDnn
             ? OneDnnLinear(t, packed_.at("cls.predictions.decoder.weight"), P("cls.predictions.bias"))
             : at::linear(t, P("cls.predictions.decoder.weight"), P("cls.predictions.bias"));
}

absl::StatusOr<at::Tensor> BertShard::Impl::LmLogits(const at::Tensor& hidden) {
  // VocabParallelLMHead1D with gather_output (PaddingLMHead without TP): padded rows are zero
  // weights and bias, and are cut off after the gather.
  at::Tensor logits = LocalLmLogits(hidden);
  if (tp_ > 1) {
    ASSIGN_OR_RETURN(logits, comm_->AllGather(logits, logits.dim() - 1));
  }
  return logits.narrow(-1, 0, plan_.config().vocab_size()).contiguous();
}

VocabSlice BertShard::Impl::LmVocabSlice() const {
  // The decoder's bias is sliced as its weight is (which the oneDNN path holds packed only).
  const auto bias = params_.find("cls.predictions.bias");
  if (!holds_heads() || bias == params_.end()) return {};
  // Each rank holds an equal run of the padded vocabulary's rows, in rank order.
  const int64_t rows = bias->second.size(0);
  const int64_t first = tp_rank_ * rows;
  return {first, std::clamp<int64_t>(plan_.config().vocab_size() - first, 0, rows)};
}

at::Tensor BertShard::Impl::SpladeSlice(const at::Tensor& hidden, const at::Tensor& attention_mask) const {
  // Never gathered: each rank pools its own ids, so a forward moves [mb, vocab / tp] floats per
  // rank, not [mb, seq, vocab] to each. Padded positions weigh 0, as SPLADE's mask multiplies them
  // out (log(1 + relu(x)) >= 0, so a row's maximum is unchanged by them).
  const VocabSlice slice = LmVocabSlice();
  const at::Tensor logits = LocalLmLogits(hidden).narrow(-1, 0, slice.size).to(at::kFloat);
  const at::Tensor weights = at::log1p(at::relu(logits)) * attention_mask.unsqueeze(-1).to(at::kFloat);
  return std::get<0>(weights.max(1)).contiguous();
}

absl::StatusOr<std::map<std::string, at::Tensor>> BertShard::Impl::Heads(const at::Tensor& hidden,
                                                                         const ModelInputs& mb) {
  std::map<std::string, at::Tensor> out;
  const v1::ModelVariant v = plan_.variant();
  const int64_t choices = mb.choices;
  if (options_.splade) {  // Validate checked the variant has an LM head
    out["sparse_embedding"] = SpladeSlice(hidden, mb.attention_mask);
    return out;
  }
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

}  // namespace bertshard::model
