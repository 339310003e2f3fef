#include "common/proto_json.h"

#include "bertshard/v1/plan.pb.h"
#include "google/protobuf/struct.pb.h"
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

// Found by the http_api fuzzer: an error message quoting a client's invalid UTF-8 made the answer
// invalid JSON. Well-formed sequences (2, 3 and 4 bytes) pass as they are; every byte of an
// ill-formed one (stray continuation, overlong, surrogate, past U+10FFFF, cut short) is U+FFFD.
TEST(ProtoJson, StringsAreValidUtf8WhateverTheBytes) {
  const auto json = [](absl::string_view text) {
    std::string out;
    AppendJsonString(text, &out);
    return out;
  };
  EXPECT_EQ(json("caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80"), "\"caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80\"");
  EXPECT_EQ(json("a\xd9\xd9"
                 "b"),
            "\"a\\ufffd\\ufffdb\"");
  EXPECT_EQ(json("\x80"), "\"\\ufffd\"");
  EXPECT_EQ(json("\xc0\xaf"), "\"\\ufffd\\ufffd\"");                        // overlong '/'
  EXPECT_EQ(json("\xed\xa0\x80"), "\"\\ufffd\\ufffd\\ufffd\"");             // a surrogate
  EXPECT_EQ(json("\xf4\x90\x80\x80"), "\"\\ufffd\\ufffd\\ufffd\\ufffd\"");  // past U+10FFFF
  EXPECT_EQ(json("\xe2\x82"), "\"\\ufffd\\ufffd\"");                        // cut short at the end
  EXPECT_EQ(json("\"\\\n\x01"), "\"\\\"\\\\\\n\\u0001\"");
  // And the parser takes it back.
  google::protobuf::Value parsed;
  EXPECT_TRUE(JsonToProto(json("x\xd9\xff\xc3\xa9"), &parsed).ok());
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
