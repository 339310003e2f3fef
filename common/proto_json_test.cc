#include "common/proto_json.h"

#include "bertshard/v1/plan.pb.h"
#include "gtest/gtest.h"

namespace bertshard::common {
namespace {

TEST(ProtoJson, WritesInt64AsNumbersAndOmitsDefaultsWhenAsked) {
  v1::RankShard rank;
  rank.set_rank(3);
  rank.set_param_bytes(int64_t{5000000000});
  auto* t = rank.add_tensors();
  t->set_name("a.weight");
  t->add_global_shape(10);
  t->set_split_dim(-1);
  EXPECT_EQ(ProtoToJson(rank, {.indent = 0, .emit_defaults = false}),
            R"({"rank":3,"param_bytes":5000000000,"tensors":[{"name":"a.weight",)"
            R"("global_shape":[10],"split_dim":-1}]})");
  EXPECT_EQ(ProtoToJson(rank, {.indent = 0}),
            R"({"rank":3,"stage":0,"tp_rank":0,"param_bytes":5000000000,"tensors":[{"name":"a.weight",)"
            R"("global_shape":[10],"local_shape":[],"split_dim":-1,"start":0,"end":0,"padding":0,)"
            R"("bytes":0,"aliases":[]}]})");
}

TEST(ProtoJson, WritesOptionalFieldsSetToZeroAndEnumsByName) {
  v1::PlanRequest request;
  request.set_variant(v1::BERT_FOR_MASKED_LM);
  request.mutable_config()->set_vocab_size(0);
  request.mutable_config()->set_layer_norm_eps(1e-12);
  request.mutable_config()->set_hidden_act("ge\"lu");
  // Unset optional fields stay absent; unset messages (parallel) too; an unset enum is written by
  // name, as any other default.
  EXPECT_EQ(ProtoToJson(request, {.indent = 0}),
            R"({"variant":"BERT_FOR_MASKED_LM","config":{"vocab_size":0,"hidden_act":"ge\"lu",)"
            R"("layer_norm_eps":1e-12},"checkpoint":"","dtype":"DTYPE_UNSPECIFIED"})");
}

TEST(ProtoJson, StructKeysSortedAndNullKept) {
  v1::SubmoduleReplacement r;
  auto& fields = *r.mutable_kwargs()->mutable_fields();
  fields["use_zbv"].set_bool_value(false);
  fields["seq_parallel_mode"].set_null_value(google::protobuf::NULL_VALUE);
  fields["make_vocab_size_divisible_by"].set_number_value(64);
  EXPECT_EQ(ProtoToJson(r, {.indent = 0, .emit_defaults = false}),
            R"({"kwargs":{"make_vocab_size_divisible_by":64,"seq_parallel_mode":null,)"
            R"("use_zbv":false}})");
}

TEST(ProtoJson, RoundTripsThroughParser) {
  v1::PlanRequest request;
  request.set_variant(v1::BERT_MODEL);
  request.mutable_parallel()->set_tp_size(4);
  request.mutable_parallel()->add_num_layers_per_stage(3);
  request.mutable_config()->set_layer_norm_eps(1e-5);
  v1::PlanRequest parsed;
  ASSERT_TRUE(JsonToProto(ProtoToJson(request), &parsed).ok());
  EXPECT_EQ(parsed.SerializeAsString(), request.SerializeAsString());
}

TEST(ProtoJson, RejectsUnknownFieldsAndBadJson) {
  v1::PlanRequest request;
  absl::Status s = JsonToProto(R"({"varient": "BERT_MODEL"})", &request);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("varient"), absl::string_view::npos) << s;
  EXPECT_FALSE(JsonToProto("{", &request).ok());
  EXPECT_FALSE(JsonToProto(R"({"variant": "NOT_A_VARIANT"})", &request).ok());
}

}  // namespace
}  // namespace bertshard::common
