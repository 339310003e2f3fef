#include "planner/planner.h"

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "planner/model_config.h"
#include "planner/stage_layout.h"
#include "planner/token_check.h"

namespace bertshard::planner {
namespace {

v1::PlanRequest Request(v1::ModelVariant variant, int64_t tp = 1, int64_t pp = 1) {
  v1::PlanRequest r;
  r.set_variant(variant);
  r.mutable_parallel()->set_tp_size(tp);
  r.mutable_parallel()->set_pp_size(pp);
  return r;
}

std::vector<std::string> Held(const v1::ShardPlan& plan, int stage) {
  const auto& m = plan.stages(stage).held_modules();
  return {m.begin(), m.end()};
}

const v1::TensorShard* FindTensor(const v1::RankShard& rank, const std::string& name) {
  for (const auto& t : rank.tensors()) {
    if (t.name() == name) return &t;
  }
  return nullptr;
}

void ExpectInvalid(const v1::PlanRequest& r, const std::string& fragment) {
  absl::StatusOr<v1::ShardPlan> plan = Plan(r);
  ASSERT_FALSE(plan.ok()) << "expected an error containing: " << fragment;
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(plan.status().message(), fragment)) << plan.status();
}

// ---- The contract's deliberate differences from the seed, one test each. ----

TEST(ContractDifference1, ZbvPutsPoolerAndHeadsOnStageZero) {
  v1::PlanRequest r = Request(v1::BERT_FOR_PRE_TRAINING, 1, 2);
  r.mutable_config()->set_num_hidden_layers(7);
  r.mutable_parallel()->set_pp_style(v1::ZBV);
  r.mutable_parallel()->set_num_model_chunks(2);
  auto plan = Plan(r);
  ASSERT_TRUE(plan.ok()) << plan.status();
  // The seed holds bert.pooler and cls on stage 1 although layers 5-6 end the V on stage 0.
  EXPECT_EQ(Held(*plan, 0), (std::vector<std::string>{"bert.embeddings", "bert.encoder.layer.0", "bert.encoder.layer.5",
                                                      "bert.encoder.layer.6", "bert.pooler", "cls"}));
  EXPECT_EQ(Held(*plan, 1), (std::vector<std::string>{"bert.encoder.layer.1", "bert.encoder.layer.2",
                                                      "bert.encoder.layer.3", "bert.encoder.layer.4"}));
  EXPECT_TRUE(plan->stages(0).is_first());
  EXPECT_TRUE(plan->stages(0).is_last());
  EXPECT_FALSE(plan->stages(1).is_last());
  // Both ends of the tie are on stage 0: no cross-stage sharing, one tensor with an alias.
  EXPECT_EQ(plan->shared_params_size(), 0);
  const v1::TensorShard* word = FindTensor(plan->ranks(0), "bert.embeddings.word_embeddings.weight");
  ASSERT_NE(word, nullptr);
  EXPECT_EQ(word->aliases(0), "cls.predictions.decoder.weight");
  EXPECT_EQ(FindTensor(plan->ranks(0), "cls.predictions.decoder.weight"), nullptr);
}

TEST(ContractDifference2, WordEmbeddingAndLmHeadPadWithTheSameMultiple) {
  v1::PlanRequest r = Request(v1::BERT_FOR_MASKED_LM, 2, 2);
  r.mutable_config()->set_vocab_size(100);
  r.mutable_config()->set_hidden_size(64);
  r.mutable_config()->set_num_attention_heads(4);
  r.mutable_config()->set_intermediate_size(128);
  r.mutable_config()->set_num_hidden_layers(2);
  r.mutable_parallel()->set_make_vocab_size_divisible_by(128);
  auto plan = Plan(r);
  ASSERT_TRUE(plan.ok()) << plan.status();
  // 100 rows padded to a multiple of 128 x tp 2 = 256; 128 rows per rank on both stages (the seed
  // pads the embedding with 64 -> 64 rows, and the decoder with 128 -> 128 rows).
  const v1::TensorShard* word = FindTensor(plan->ranks(1), "bert.embeddings.word_embeddings.weight");
  const v1::TensorShard* decoder = FindTensor(plan->ranks(3), "cls.predictions.decoder.weight");
  const v1::TensorShard* bias = FindTensor(plan->ranks(3), "cls.predictions.bias");
  ASSERT_TRUE(word && decoder && bias);
  EXPECT_EQ(word->local_shape(0), 128);
  EXPECT_EQ(decoder->local_shape(0), 128);
  EXPECT_EQ(bias->local_shape(0), 128);
  EXPECT_EQ(word->start(), 128);
  EXPECT_EQ(word->padding(), 128);  // rank 1 holds only padding
  EXPECT_EQ(FindTensor(plan->ranks(0), "bert.embeddings.word_embeddings.weight")->padding(), 28);

  r.mutable_parallel()->set_tp_size(1);  // TP off, tied: PaddingEmbedding and PaddingLMHead alike
  plan = Plan(r);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(FindTensor(plan->ranks(0), "bert.embeddings.word_embeddings.weight")->local_shape(0), 128);
  EXPECT_EQ(FindTensor(plan->ranks(1), "cls.predictions.decoder.weight")->local_shape(0), 128);
}

TEST(ContractDifference3, RingAttnAndAllToAllRefusedRingRunsAsSplitGather) {
  v1::PlanRequest r = Request(v1::BERT_MODEL, 2);
  r.mutable_parallel()->set_sp_mode(v1::RING_ATTN);
  ExpectInvalid(r, "ring_attn sequence parallelism is not supported for Bert");
  r.mutable_parallel()->set_sp_mode(v1::ALL_TO_ALL);
  ExpectInvalid(r, "all_to_all sequence parallelism is not supported for Bert");
  r.mutable_parallel()->set_sp_mode(v1::RING);
  r.mutable_parallel()->set_pp_size(2);
  auto plan = Plan(r);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->shard_config().sp_mode(), v1::SPLIT_GATHER);  // the pipeline forward reads this
  EXPECT_TRUE(plan->shard_config().enable_sequence_parallelism());
  ASSERT_EQ(plan->warnings_size(), 1);
  EXPECT_TRUE(absl::StrContains(plan->warnings(0), "will set to be split_gather"));
  const auto& query = plan->module_policy(0).submodule_replacements(0);
  EXPECT_EQ(query.kwargs().fields().at("seq_parallel_mode").string_value(), "split_gather");
}

TEST(ContractDifference4, CrossAttentionWithTensorParallelismRefused) {
  v1::PlanRequest r = Request(v1::BERT_LM_HEAD_MODEL, 2);
  r.mutable_config()->set_is_decoder(true);
  r.mutable_config()->set_add_cross_attention(true);
  ExpectInvalid(r, "add_cross_attention with tensor parallelism is not supported");
  r.mutable_parallel()->set_tp_size(1);
  auto plan = Plan(r);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_NE(FindTensor(plan->ranks(0), "bert.encoder.layer.0.crossattention.self.key.weight"), nullptr);
}

TEST(ContractDifference5, HeldModulesNeverListAMissingPooler) {
  for (v1::ModelVariant v : {v1::BERT_LM_HEAD_MODEL, v1::BERT_FOR_MASKED_LM, v1::BERT_FOR_TOKEN_CLASSIFICATION,
                             v1::BERT_FOR_QUESTION_ANSWERING}) {
    auto plan = Plan(Request(v, 1, 2));
    ASSERT_TRUE(plan.ok());
    for (const auto& stage : plan->stages()) {
      for (const auto& m : stage.held_modules()) EXPECT_FALSE(absl::StrContains(m, "pooler")) << m;
    }
    for (const auto& rank : plan->ranks()) {
      for (const auto& t : rank.tensors()) EXPECT_FALSE(absl::StrContains(t.name(), "pooler"));
    }
  }
  auto with_pooler = Plan(Request(v1::BERT_FOR_SEQUENCE_CLASSIFICATION, 1, 2));
  EXPECT_EQ(Held(*with_pooler, 1).back(), "classifier");
  EXPECT_EQ(Held(*with_pooler, 1)[6], "bert.pooler");
}

TEST(ContractDifference6, ExplicitLayerCountsAreOnePerSlot) {
  v1::PlanRequest r = Request(v1::BERT_MODEL, 1, 2);
  r.mutable_parallel()->set_pp_style(v1::INTERLEAVED);
  r.mutable_parallel()->set_num_model_chunks(2);
  for (int n : {1, 2, 3, 6}) r.mutable_parallel()->add_num_layers_per_stage(n);
  auto plan = Plan(r);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->stages(0).layer_ranges(1).start(), 3);  // slot 2
  EXPECT_EQ(plan->stages(0).layer_ranges(1).end(), 6);
  EXPECT_EQ(plan->stages(1).layer_ranges(1).end(), 12);  // slot 3
  r.mutable_parallel()->clear_num_layers_per_stage();
  for (int n : {6, 6}) r.mutable_parallel()->add_num_layers_per_stage(n);
  ExpectInvalid(r, "has 2 entries; it needs one per pipeline slot (pp_size x num_model_chunks = 4)");
  r.mutable_parallel()->clear_num_layers_per_stage();
  for (int n : {3, 3, 3, 2}) r.mutable_parallel()->add_num_layers_per_stage(n);
  ExpectInvalid(r, "sums to 11; it must sum to num_hidden_layers 12");
  r.mutable_parallel()->clear_num_layers_per_stage();
  r.mutable_parallel()->set_num_model_chunks(1);
  ExpectInvalid(r, "pp_style INTERLEAVED needs num_model_chunks > 1");
  r.mutable_parallel()->set_pp_style(v1::ZBV);
  r.mutable_parallel()->set_num_model_chunks(3);
  ExpectInvalid(r, "pp_style ZBV needs num_model_chunks == 2");
  r.mutable_parallel()->set_pp_style(v1::ONE_F_ONE_B);
  r.mutable_parallel()->set_num_model_chunks(2);
  ExpectInvalid(r, "pp_style ONE_F_ONE_B needs num_model_chunks 1");
}

TEST(ContractDifference7, TpMustDivideHiddenAndIntermediateAtPlanTime) {
  v1::PlanRequest r = Request(v1::BERT_MODEL, 2);
  r.mutable_config()->set_intermediate_size(3071);
  ExpectInvalid(r, "tp_size 2 does not divide intermediate_size 3071; valid tp_size values: 1");
  r.mutable_config()->set_intermediate_size(3072);
  r.mutable_parallel()->set_tp_size(8);
  ExpectInvalid(r, "tp_size 8 does not divide num_attention_heads 12; valid tp_size values: 1, 2, 3, 4, 6, 12");
}

TEST(ContractDifference8, AllOptimizationTurnsOnFusedNormWithoutApex) {
  v1::PlanRequest r = Request(v1::BERT_FOR_MASKED_LM, 2);
  r.mutable_parallel()->set_enable_all_optimization(true);
  auto plan = Plan(r);
  ASSERT_TRUE(plan.ok());
  EXPECT_TRUE(plan->shard_config().enable_fused_normalization());
  EXPECT_TRUE(plan->shard_config().enable_jit_fused());
  EXPECT_TRUE(plan->shard_config().enable_flash_attention());
  EXPECT_TRUE(plan->enable_bias_gelu_fused());
  EXPECT_EQ(plan->warnings_size(), 0);  // no "apex is not installed"
  const auto& layer = plan->module_policy(0);
  EXPECT_EQ(layer.submodule_replacements(layer.submodule_replacements_size() - 1).layer(), "FusedLayerNorm");
}

// ---- Validation errors, by name. ----

TEST(PlanValidator, RejectsMissingOrUnknownVariant) {
  ExpectInvalid(Request(v1::MODEL_VARIANT_UNSPECIFIED), "variant is required");
  ExpectInvalid(Request(static_cast<v1::ModelVariant>(42)), "unknown variant value 42");
}

TEST(PlanValidator, RejectsNonPositiveSizes) {
  struct Field {
    const char* name;
    void (v1::BertConfig::*set)(int64_t);
  };
  const Field fields[] = {{"vocab_size", &v1::BertConfig::set_vocab_size},
                          {"hidden_size", &v1::BertConfig::set_hidden_size},
                          {"num_hidden_layers", &v1::BertConfig::set_num_hidden_layers},
                          {"num_attention_heads", &v1::BertConfig::set_num_attention_heads},
                          {"intermediate_size", &v1::BertConfig::set_intermediate_size},
                          {"max_position_embeddings", &v1::BertConfig::set_max_position_embeddings},
                          {"type_vocab_size", &v1::BertConfig::set_type_vocab_size},
                          {"num_labels", &v1::BertConfig::set_num_labels}};
  for (const Field& f : fields) {
    for (int64_t bad : {int64_t{0}, int64_t{-3}}) {
      v1::PlanRequest r = Request(v1::BERT_FOR_SEQUENCE_CLASSIFICATION);
      (r.mutable_config()->*f.set)(bad);
      ExpectInvalid(r,
                    std::string("config.") + f.name + " is " + std::to_string(bad) + "; it must be a positive integer");
    }
  }
  v1::PlanRequest r = Request(v1::BERT_MODEL);
  r.mutable_parallel()->set_tp_size(-1);
  ExpectInvalid(r, "parallel.tp_size is -1");
  r = Request(v1::BERT_MODEL);
  r.mutable_parallel()->set_pp_size(-2);
  ExpectInvalid(r, "parallel.pp_size is -2");
  r = Request(v1::BERT_MODEL);
  r.mutable_parallel()->set_num_model_chunks(-1);
  ExpectInvalid(r, "parallel.num_model_chunks is -1");
  r = Request(v1::BERT_MODEL);
  r.mutable_parallel()->set_make_vocab_size_divisible_by(-64);
  ExpectInvalid(r, "make_vocab_size_divisible_by is -64");
  r = Request(v1::BERT_MODEL, 1, 2);
  r.mutable_parallel()->add_num_layers_per_stage(-1);
  r.mutable_parallel()->add_num_layers_per_stage(13);
  ExpectInvalid(r, "num_layers_per_stage has -1");
}

TEST(PlanValidator, RejectsAbsurdSizes) {
  ExpectInvalid(Request(v1::BERT_MODEL, 5000), "parallel.tp_size is 5000; it must be in 0..4096");
  ExpectInvalid(Request(v1::BERT_MODEL, 1, 4097), "parallel.pp_size is 4097");
  v1::PlanRequest r = Request(v1::BERT_MODEL);
  r.mutable_config()->set_num_hidden_layers(100000);
  ExpectInvalid(r, "config.num_hidden_layers is 100000; at most 4096");
  r = Request(v1::BERT_MODEL);
  r.mutable_config()->set_hidden_size(65536);
  r.mutable_config()->set_num_attention_heads(64);
  r.mutable_config()->set_vocab_size(65536);  // 2^32 elements in the word embedding
  ExpectInvalid(r, "more than 2^31 elements");
  r = Request(v1::BERT_MODEL, 4);
  r.mutable_config()->set_hidden_size(32768);
  r.mutable_config()->set_num_attention_heads(4);
  r.mutable_config()->set_intermediate_size(4);
  r.mutable_config()->set_vocab_size(65000);  // fits unpadded; padded to 65536 x 4 = 2^18 rows it does not
  r.mutable_parallel()->set_make_vocab_size_divisible_by(65536);
  ExpectInvalid(r, "padded to a multiple of make_vocab_size_divisible_by 65536 x tp_size 4");
  r = Request(v1::BERT_MODEL, 64, 128);
  r.mutable_config()->set_num_attention_heads(64);
  r.mutable_config()->set_hidden_size(4096);
  r.mutable_config()->set_intermediate_size(16384);
  ExpectInvalid(r, "tp_size x pp_size is 8192; at most 4096 ranks");
  r = Request(v1::BERT_MODEL);
  r.mutable_config()->set_vocab_size(int64_t{1} << 40);
  ExpectInvalid(r, "config.vocab_size is 1099511627776; at most 2147483648");
}

TEST(PlanValidator, RejectsUnknownHiddenActAndBadEps) {
  v1::PlanRequest r = Request(v1::BERT_MODEL);
  r.mutable_config()->set_hidden_act("swiglu");
  ExpectInvalid(r, "config.hidden_act 'swiglu' is not supported; valid: gelu, gelu_new, gelu_pytorch_tanh, relu");
  r = Request(v1::BERT_MODEL);
  r.mutable_config()->set_layer_norm_eps(0);
  ExpectInvalid(r, "layer_norm_eps");
  r.mutable_config()->set_layer_norm_eps(std::numeric_limits<double>::quiet_NaN());
  ExpectInvalid(r, "layer_norm_eps");
}

TEST(PlanValidator, RejectsUnknownEnumValues) {
  v1::PlanRequest r = Request(v1::BERT_MODEL, 1, 2);
  r.mutable_parallel()->set_pp_style(static_cast<v1::PipelineStyle>(9));
  ExpectInvalid(r, "unknown parallel.pp_style value 9");
  r = Request(v1::BERT_MODEL, 2);
  r.mutable_parallel()->set_sp_mode(static_cast<v1::SequenceParallelMode>(17));
  ExpectInvalid(r, "unknown parallel.sp_mode value 17");
}

TEST(PlanValidator, RejectsHiddenSizeNotMultipleOfHeads) {
  v1::PlanRequest r = Request(v1::BERT_MODEL);
  r.mutable_config()->set_hidden_size(770);
  ExpectInvalid(r, "config.hidden_size 770 is not a multiple of num_attention_heads 12");
}

TEST(PlanValidator, RejectsSequenceParallelWithoutTensorParallel) {
  v1::PlanRequest r = Request(v1::BERT_MODEL, 1);
  r.mutable_parallel()->set_sp_mode(v1::SPLIT_GATHER);
  ExpectInvalid(r, "sequence parallelism mode split_gather can only be used when enable_tensor_parallelism is True");
  r.mutable_parallel()->set_sp_mode(v1::RING);
  ExpectInvalid(r, "valid: 1, 2, 3, 4, 6, 12");
}

TEST(PlanValidator, RejectsChunksWithoutPipelineAndCrossAttentionWithoutDecoder) {
  v1::PlanRequest r = Request(v1::BERT_MODEL);
  r.mutable_parallel()->set_num_model_chunks(2);
  ExpectInvalid(r, "needs a pipeline");
  r = Request(v1::BERT_MODEL);
  r.mutable_config()->set_add_cross_attention(true);
  ExpectInvalid(r, "add_cross_attention needs config.is_decoder");
  r = Request(v1::BERT_FOR_QUESTION_ANSWERING);
  r.mutable_config()->set_num_labels(3);
  ExpectInvalid(r, "BertForQuestionAnswering needs config.num_labels 2");
  r = Request(v1::BERT_MODEL);
  r.mutable_config()->set_pad_token_id(30522);
  ExpectInvalid(r, "pad_token_id 30522 is outside the vocabulary");
}

// ---- The tensor table. ----

TEST(TensorTable, UnshardedBertBaseHoldsItsKnownParameterCount) {
  // bert-base-uncased BertModel (with pooler) has 109,482,240 parameters.
  auto plan = Plan(Request(v1::BERT_MODEL));
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->ranks_size(), 1);
  EXPECT_EQ(plan->ranks(0).param_bytes(), int64_t{109482240} * 4);
  EXPECT_EQ(plan->ranks(0).tensors_size(), 5 + 12 * 16 + 2);
}

// Bytes follow the dtype: every tensor of every rank is half its fp32 size in bf16 and fp16, and
// the plan says which it is (fp32 when the request leaves it unset).
TEST(PlanDtype, BytesFollowTheDtype) {
  v1::PlanRequest request = Request(v1::BERT_FOR_PRE_TRAINING, 2, 2);
  auto fp32 = Plan(request);
  ASSERT_TRUE(fp32.ok()) << fp32.status();
  EXPECT_EQ(fp32->dtype(), v1::FP32);
  for (v1::Dtype dtype : {v1::BF16, v1::FP16}) {
    request.set_dtype(dtype);
    auto plan = Plan(request);
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_EQ(plan->dtype(), dtype);
    ASSERT_EQ(plan->ranks_size(), fp32->ranks_size());
    for (int r = 0; r < plan->ranks_size(); ++r) {
      const v1::RankShard& narrow = plan->ranks(r);
      const v1::RankShard& wide = fp32->ranks(r);
      EXPECT_EQ(narrow.param_bytes() * 2, wide.param_bytes());
      int64_t sum = 0;
      ASSERT_EQ(narrow.tensors_size(), wide.tensors_size());
      for (int t = 0; t < narrow.tensors_size(); ++t) {
        int64_t elements = 1;
        for (int64_t d : narrow.tensors(t).local_shape()) elements *= d;
        EXPECT_EQ(narrow.tensors(t).bytes(), elements * 2) << narrow.tensors(t).name();
        sum += narrow.tensors(t).bytes();
      }
      EXPECT_EQ(sum, narrow.param_bytes());
    }
  }
  request.set_dtype(static_cast<v1::Dtype>(9));
  ExpectInvalid(request, "unknown dtype value 9; valid: fp32, bf16, fp16");
}

TEST(PlanDtype, ParsesFriendlyAndEnumNames) {
  EXPECT_EQ(*ParseDtype("bf16"), v1::BF16);
  EXPECT_EQ(*ParseDtype("BFloat16"), v1::BF16);
  EXPECT_EQ(*ParseDtype("FP16"), v1::FP16);
  EXPECT_EQ(*ParseDtype("half"), v1::FP16);
  EXPECT_EQ(*ParseDtype("float32"), v1::FP32);
  const auto bad = ParseDtype("fp8");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(bad.status().message(), "unknown dtype 'fp8'; valid: fp32, bf16, fp16"))
      << bad.status();
  EXPECT_EQ(DtypeName(v1::DTYPE_UNSPECIFIED), "fp32");
  EXPECT_EQ(DtypeBytes(v1::BF16), 2);
}

TEST(TensorTable, TpSlicesPartitionEverySplitTensor) {
  auto plan = Plan(Request(v1::BERT_FOR_PRE_TRAINING, 4));
  ASSERT_TRUE(plan.ok());
  const int n = plan->ranks(0).tensors_size();
  for (int i = 0; i < n; ++i) {
    const auto& first = plan->ranks(0).tensors(i);
    SCOPED_TRACE(first.name());
    int64_t next = 0, real_rows = 0;
    for (int t = 0; t < 4; ++t) {
      const auto& tensor = plan->ranks(t).tensors(i);
      ASSERT_EQ(tensor.name(), first.name());
      if (first.split_dim() < 0) {
        EXPECT_EQ(tensor.split_dim(), -1);
        EXPECT_EQ(std::vector<int64_t>(tensor.local_shape().begin(), tensor.local_shape().end()),
                  std::vector<int64_t>(tensor.global_shape().begin(), tensor.global_shape().end()));
        continue;
      }
      EXPECT_EQ(tensor.start(), next);
      EXPECT_EQ(tensor.end() - tensor.start(), tensor.local_shape(tensor.split_dim()));
      real_rows += tensor.end() - tensor.start() - tensor.padding();
      next = tensor.end();
    }
    if (first.split_dim() >= 0) {
      EXPECT_EQ(real_rows, first.global_shape(first.split_dim()));
    }
  }
  // Attention heads: rank 1 owns query rows 192..383 = heads 3..5, and the matching columns of
  // attention.output.dense.
  const auto* q = FindTensor(plan->ranks(1), "bert.encoder.layer.0.attention.self.query.weight");
  const auto* o = FindTensor(plan->ranks(1), "bert.encoder.layer.0.attention.output.dense.weight");
  const auto* ob = FindTensor(plan->ranks(1), "bert.encoder.layer.0.attention.output.dense.bias");
  EXPECT_EQ(q->start(), 192);
  EXPECT_EQ(o->split_dim(), 1);
  EXPECT_EQ(o->start(), 192);
  EXPECT_EQ(ob->split_dim(), -1);  // Linear1D_Row keeps the whole bias
}

TEST(TensorTable, UntiedHeadOnLastStageAndTiedAliases) {
  v1::PlanRequest r = Request(v1::BERT_FOR_MASKED_LM, 1, 2);
  r.mutable_config()->set_tie_word_embeddings(false);
  auto plan = Plan(r);
  ASSERT_TRUE(plan.ok());
  EXPECT_FALSE(plan->tie_weight());
  EXPECT_EQ(plan->shared_params_size(), 0);
  // TP off, untied: the embedding stays unpadded, the decoder is padded (PaddingLMHead).
  EXPECT_EQ(FindTensor(plan->ranks(0), "bert.embeddings.word_embeddings.weight")->split_dim(), -1);
  const auto* decoder = FindTensor(plan->ranks(1), "cls.predictions.decoder.weight");
  EXPECT_EQ(decoder->local_shape(0), 30528);
  EXPECT_EQ(decoder->padding(), 6);
  EXPECT_EQ(decoder->aliases_size(), 0);
  EXPECT_EQ(FindTensor(plan->ranks(1), "cls.predictions.bias")->aliases(0), "cls.predictions.decoder.bias");

  r.mutable_config()->set_tie_word_embeddings(true);
  plan = Plan(r);
  EXPECT_EQ(FindTensor(plan->ranks(1), "cls.predictions.decoder.weight")->aliases(0),
            "bert.embeddings.word_embeddings.weight");
  EXPECT_EQ(plan->shared_params(0).members(1).stage(), 1);
}

TEST(StageLayout, DistributeLayersCentresTheRemainder) {
  EXPECT_EQ(DistributeLayers(12, 5, 1), (std::vector<int64_t>{2, 3, 3, 2, 2}));
  EXPECT_EQ(DistributeLayers(7, 2, 2), (std::vector<int64_t>{1, 2, 2, 2}));
  EXPECT_EQ(DistributeLayers(5, 8, 1), (std::vector<int64_t>{0, 0, 1, 1, 1, 1, 1, 0}));
  EXPECT_EQ(StageLayerRanges({2, 2, 2, 3, 2, 2}, 2, 3, 2, true), (std::vector<LayerSpan>{{4, 6}, {6, 9}}));
}

TEST(PlanOutput, ShardConfigIsEffectiveValues) {
  auto plan = Plan(Request(v1::BERT_MODEL, 1, 0));
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->shard_config().tensor_parallel_size(), 1);
  EXPECT_EQ(plan->shard_config().pp_size(), 1);
  EXPECT_EQ(plan->shard_config().num_model_chunks(), 1);
  EXPECT_EQ(plan->shard_config().make_vocab_size_divisible_by(), 64);
  EXPECT_EQ(plan->world_size(), 1);
  EXPECT_EQ(plan->layers_per_stage_size(), 1);
  EXPECT_TRUE(plan->stages(0).is_first() && plan->stages(0).is_last());
  EXPECT_EQ(plan->module_policy_size(), 2);  // BertLayer, BertEmbeddings LayerNorms only
}

}  // namespace
}  // namespace bertshard::planner

namespace bertshard::planner {
namespace {

TEST(TokenCheck, RefusesWhatNoRankCouldRun) {
  v1::PlanRequest r;
  r.set_variant(v1::BERT_MODEL);
  r.mutable_config()->set_vocab_size(10);
  r.mutable_config()->set_max_position_embeddings(4);
  r.mutable_parallel()->set_tp_size(2);
  r.mutable_parallel()->set_sp_mode(v1::SPLIT_GATHER);
  const v1::ShardPlan plan = *Plan(r);
  const std::vector<int64_t> ids = {1, 2, 3, 4}, mask = {1, 1, 1, 0}, types = {0, 0, 1, 1};
  EXPECT_TRUE(CheckInputsAgainstPlan({1, 4, 1, ids, mask, types}, plan).ok());
  auto message = [&](TokenView t) { return std::string(CheckInputsAgainstPlan(t, plan).message()); };
  const std::vector<int64_t> big = {1, 2, 3, 10}, bad_mask = {1, 2, 1, 1}, bad_types = {0, 0, 2, 0};
  EXPECT_TRUE(absl::StrContains(message({1, 4, 1, big, mask, types}), "ids must be in [0, vocab_size 10)"));
  EXPECT_TRUE(absl::StrContains(message({1, 4, 1, ids, bad_mask, types}), "must be 0 or 1"));
  EXPECT_TRUE(absl::StrContains(message({1, 4, 1, ids, mask, bad_types}), "type_vocab_size 2"));
  EXPECT_TRUE(absl::StrContains(message({1, 3, 1, {1, 2, 3}, {1, 1, 1}, {0, 0, 0}}), "multiple of tp_size 2"));
  EXPECT_TRUE(absl::StrContains(message({2, 2, 2, ids, mask, types}), "choices are only for BertForMultipleChoice"));
  EXPECT_TRUE(absl::StrContains(message({1, 3, 1, ids, mask, types}), "rows x seq values"));
  // Regression (fuzz/corpus/infer_request/crash-rows_times_seq_overflow.bin): rows x seq past
  // int64 was undefined behaviour; now a plain refusal.
  EXPECT_TRUE(absl::StrContains(message({18, 1224979098644774911, 1, ids, mask, types}), "rows x seq values"));
  EXPECT_TRUE(absl::StrContains(message({INT64_MAX, INT64_MAX, 1, ids, mask, types}), "rows x seq values"));
  const std::vector<int64_t> six(6, 1);
  EXPECT_TRUE(
      absl::StrContains(message({1, 6, 1, six, six, std::vector<int64_t>(6, 0)}), "exceeds max_position_embeddings 4"));
}

}  // namespace
}  // namespace bertshard::planner
