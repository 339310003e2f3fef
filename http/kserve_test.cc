// KServe v2's protocol core (kserve.h) against a canned backend (fake_backend.h): tensors to the
// request path's InferRequest and back, raw contents, model resolution and the refusals of bad
// input.
#include "http/kserve.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "http/fake_backend.h"

namespace bertshard::http::kserve {
namespace {

Tensor Ids(std::string name, std::vector<int64_t> shape, std::vector<int64_t> values, std::string datatype = "INT64") {
  return {std::move(name), std::move(datatype), std::move(shape), std::move(values), {}, {}};
}

Tensor Texts(std::string name, std::vector<std::string> texts) {
  const int64_t n = static_cast<int64_t>(texts.size());
  return {std::move(name), "BYTES", {n}, {}, std::move(texts), {}};
}

TEST(KServeToInferRequest, TokenInputsKeepShapeAndValues) {
  InferRequest request;
  request.inputs = {Ids("input_ids", {2, 3}, {101, 7, 102, 101, 8, 102}),
                    Ids("attention_mask", {2, 3}, {1, 1, 1, 1, 1, 0}, "INT32"),
                    Ids("token_type_ids", {2, 3}, {0, 0, 0, 0, 1, 1})};
  request.truncate = true;
  absl::StatusOr<v1::InferRequest> out = ToInferRequest(request, "job-1", 0);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->job_id(), "job-1");
  EXPECT_TRUE(out->truncate());
  const v1::TokenInputs& t = out->tokens();
  EXPECT_EQ(t.rows(), 2);
  EXPECT_EQ(t.seq(), 3);
  EXPECT_EQ(t.choices(), 0);
  EXPECT_EQ(std::vector<int64_t>(t.input_ids().begin(), t.input_ids().end()),
            (std::vector<int64_t>{101, 7, 102, 101, 8, 102}));
  EXPECT_EQ(t.attention_mask(5), 0);
  EXPECT_EQ(t.token_type_ids(4), 1);
}

TEST(KServeToInferRequest, MaskAndTypesMayBeLeftOut) {
  InferRequest request;
  request.inputs = {Ids("input_ids", {1, 2}, {101, 102})};
  absl::StatusOr<v1::InferRequest> out = ToInferRequest(request, "job-1", 0);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->tokens().attention_mask_size(), 0);  // the request path fills ones and zeros
  EXPECT_EQ(out->tokens().token_type_ids_size(), 0);
}

TEST(KServeToInferRequest, ChoicesFromARankThreeShape) {
  InferRequest request;
  request.inputs = {Ids("input_ids", {1, 2, 2}, {101, 102, 101, 102})};
  absl::StatusOr<v1::InferRequest> out = ToInferRequest(request, "job-1", 0);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->tokens().rows(), 2);
  EXPECT_EQ(out->tokens().choices(), 2);
  EXPECT_EQ(out->tokens().seq(), 2);
}

TEST(KServeToInferRequest, TextAndPairs) {
  InferRequest request;
  request.inputs = {Texts("text", {"a question", "another"}), Texts("text_pair", {"its passage", "p"})};
  request.inputs[0].shape = {2, 1};  // [batch, 1], as tritonclient users often shape it
  request.inputs[1].shape = {2, 1};
  absl::StatusOr<v1::InferRequest> out = ToInferRequest(request, "job-2", 0);
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_TRUE(out->has_text());
  EXPECT_EQ(out->text().texts(1), "another");
  EXPECT_EQ(out->text().text_pairs(0), "its passage");
}

TEST(KServeToInferRequest, RefusesWhatTheModelDoesNotTake) {
  const struct {
    const char* what;
    std::vector<Tensor> inputs;
    int64_t max_padded_ids;
    const char* message;
  } cases[] = {
      {"unknown name", {Ids("pixel_values", {1, 1}, {0})}, 0, "unknown input 'pixel_values'"},
      {"nothing", {}, 0, "no input"},
      {"ids and text", {Ids("input_ids", {1, 1}, {1}), Texts("text", {"a"})}, 0, "both input_ids and text"},
      {"twice", {Ids("input_ids", {1, 1}, {1}), Ids("input_ids", {1, 1}, {1})}, 0, "twice"},
      {"float ids", {Ids("input_ids", {1, 1}, {1}, "FP32")}, 0, "must be INT64 or INT32"},
      {"rank 1 ids", {Ids("input_ids", {3}, {1, 2, 3})}, 0, "[batch, seq]"},
      {"too few values", {Ids("input_ids", {2, 2}, {1, 2, 3})}, 0, "3 values for shape [2, 2]"},
      {"negative dim", {Ids("input_ids", {-1, 2}, {})}, 0, "negative dimension"},
      {"zero batch", {Ids("input_ids", {0, 2}, {})}, 0, "at least 1"},
      {"mask shape", {Ids("input_ids", {1, 2}, {1, 2}), Ids("attention_mask", {2, 1}, {1, 1})}, 0, "must match"},
      {"over the batch", {Ids("input_ids", {2, 3}, {1, 2, 3, 4, 5, 6})}, 5, "more than the 5"},
      {"text as ints", {Ids("text", {1}, {1})}, 0, "must be BYTES"},
      {"text rank", {{"text", "BYTES", {1, 2}, {}, {"a", "b"}, {}}}, 0, "[batch] or [batch, 1]"},
      {"empty text batch", {{"text", "BYTES", {0}, {}, {}, {}}}, 0, "no elements"},
      {"pair shape", {Texts("text", {"a"}), Texts("text_pair", {"b", "c"})}, 0, "must match"},
      {"mask with text", {Texts("text", {"a"}), Ids("attention_mask", {1, 1}, {1})}, 0, "go with input_ids"},
      {"pair with ids", {Ids("input_ids", {1, 1}, {1}), Texts("text_pair", {"b"})}, 0, "goes with text"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    InferRequest request;
    request.inputs = c.inputs;
    absl::StatusOr<v1::InferRequest> out = ToInferRequest(request, "job-1", c.max_padded_ids);
    ASSERT_FALSE(out.ok());
    EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(out.status().message().find(c.message), absl::string_view::npos) << out.status();
  }
}

TEST(KServeRaw, DecodesLittleEndianIntsAndLengthPrefixedBytes) {
  Tensor ids{"input_ids", "INT64", {1, 2}, {}, {}, {}};
  ASSERT_TRUE(DecodeRaw(std::string("\x65\0\0\0\0\0\0\0\xff\xff\xff\xff\xff\xff\xff\xff", 16), &ids).ok());
  EXPECT_EQ(ids.ints, (std::vector<int64_t>{101, -1}));
  Tensor small{"input_ids", "INT32", {2}, {}, {}, {}};
  ASSERT_TRUE(DecodeRaw(std::string("\x02\x01\0\0\xfe\xff\xff\xff", 8), &small).ok());
  EXPECT_EQ(small.ints, (std::vector<int64_t>{258, -2}));
  Tensor text{"text", "BYTES", {2}, {}, {}, {}};
  ASSERT_TRUE(DecodeRaw(std::string("\x02\0\0\0hi\0\0\0\0", 10), &text).ok());
  EXPECT_EQ(text.bytes, (std::vector<std::string>{"hi", ""}));
}

TEST(KServeRaw, RefusesContentsThatDoNotFitTheShape) {
  const struct {
    const char* what;
    Tensor tensor;
    std::string raw;
    const char* message;
  } cases[] = {
      {"short ints", {"input_ids", "INT64", {1, 2}, {}, {}, {}}, std::string(15, '\0'), "15 raw bytes"},
      {"long ints", {"input_ids", "INT32", {1}, {}, {}, {}}, std::string(8, '\0'), "8 raw bytes"},
      {"float", {"input_ids", "FP32", {1}, {}, {}, {}}, std::string(4, '\0'), "datatype FP32 is not taken"},
      {"cut length", {"text", "BYTES", {1}, {}, {}, {}}, std::string("\x01\0", 2), "4-byte length"},
      {"past the end", {"text", "BYTES", {1}, {}, {}, {}}, std::string("\x09\0\0\0ab", 6), "runs past the end"},
      {"too many", {"text", "BYTES", {1}, {}, {}, {}}, std::string("\x01\0\0\0a\x01\0\0\0b", 10), "more than the 1"},
      {"too few", {"text", "BYTES", {2}, {}, {}, {}}, std::string("\x01\0\0\0a", 5), "hold 1 elements"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    Tensor t = c.tensor;
    const absl::Status s = DecodeRaw(c.raw, &t);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find(c.message), absl::string_view::npos) << s;
  }
}

TEST(KServeRaw, EncodesFloatsIntsAndBytes) {
  EXPECT_EQ(EncodeRaw({"o", "FP32", {2}, {}, {}, {1.0f, -2.0f}}), std::string("\0\0\x80\x3f\0\0\0\xc0", 8));
  EXPECT_EQ(EncodeRaw({"o", "INT64", {1}, {258}, {}, {}}), std::string("\x02\x01\0\0\0\0\0\0", 8));
  EXPECT_EQ(EncodeRaw({"o", "BYTES", {1}, {}, {"ab"}, {}}), std::string("\x02\0\0\0ab", 6));
}

v1::InferResponse TwoOutputs() {
  v1::InferResponse response;
  v1::NamedTensor* hidden = response.add_outputs();
  hidden->set_name("last_hidden_state");
  for (const int64_t d : {1, 2, 2}) hidden->add_shape(d);
  for (const float v : {1.f, 2.f, 3.f, 4.f}) hidden->add_values(v);
  v1::NamedTensor* pooled = response.add_outputs();
  pooled->set_name("pooler_output");
  pooled->add_shape(1);
  pooled->add_shape(2);
  pooled->add_values(0.5f);
  pooled->add_values(-0.5f);
  v1::TokenInputs* tokens = response.mutable_tokens();
  tokens->set_rows(1);
  tokens->set_seq(2);
  for (const int64_t id : {101, 102}) tokens->add_input_ids(id);
  for (const int64_t m : {1, 1}) tokens->add_attention_mask(m);
  return response;
}

TEST(KServeOutputs, AllOrTheNamedOnesInTheirOrder) {
  absl::StatusOr<std::vector<Tensor>> all = OutputsOf(TwoOutputs(), {});
  ASSERT_TRUE(all.ok()) << all.status();
  ASSERT_EQ(all->size(), 2u);
  EXPECT_EQ((*all)[0].name, "last_hidden_state");
  EXPECT_EQ((*all)[0].datatype, "FP32");
  EXPECT_EQ((*all)[0].shape, (std::vector<int64_t>{1, 2, 2}));
  EXPECT_EQ((*all)[0].floats, (std::vector<float>{1, 2, 3, 4}));
  absl::StatusOr<std::vector<Tensor>> chosen = OutputsOf(TwoOutputs(), {"pooler_output", "input_ids"});
  ASSERT_TRUE(chosen.ok()) << chosen.status();
  ASSERT_EQ(chosen->size(), 2u);
  EXPECT_EQ((*chosen)[0].name, "pooler_output");
  EXPECT_EQ((*chosen)[1].datatype, "INT64");
  EXPECT_EQ((*chosen)[1].shape, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ((*chosen)[1].ints, (std::vector<int64_t>{101, 102}));
}

TEST(KServeOutputs, RefusesUnknownAndRepeatedNames) {
  absl::StatusOr<std::vector<Tensor>> unknown = OutputsOf(TwoOutputs(), {"logits"});
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(unknown.status().message().find("last_hidden_state, pooler_output"), absl::string_view::npos)
      << unknown.status();
  EXPECT_EQ(OutputsOf(TwoOutputs(), {"pooler_output", "pooler_output"}).status().code(),
            absl::StatusCode::kInvalidArgument);
  v1::InferResponse broken = TwoOutputs();
  broken.mutable_outputs(1)->add_values(1.f);  // 3 values for [1, 2]
  EXPECT_EQ(OutputsOf(broken, {}).status().code(), absl::StatusCode::kInternal);
}

TEST(KServeServingModel, ResolvesNamesVersionsAndReadiness) {
  FakeBackend backend;
  absl::StatusOr<ModelInfo> by_name = ServingModel(&backend, "sentiment", "1", "");
  ASSERT_TRUE(by_name.ok()) << by_name.status();
  EXPECT_EQ(by_name->job_id, "job-2");
  absl::StatusOr<ModelInfo> by_default = ServingModel(&backend, "", "", "sentiment");
  ASSERT_TRUE(by_default.ok()) << by_default.status();
  EXPECT_EQ(by_default->job_id, "job-2");
  EXPECT_EQ(ServingModel(&backend, "gpt-4", "", "").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(ServingModel(&backend, "minilm", "2", "").status().code(), absl::StatusCode::kNotFound);
  // Ended: never again (400); still loading: not ready, retry (503).
  const absl::Status ended = ServingModel(&backend, "ended", "", "").status();
  EXPECT_EQ(ended.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(ended.message().find("will not serve again"), absl::string_view::npos) << ended;
  const absl::Status loading = ServingModel(&backend, "loading", "", "").status();
  EXPECT_EQ(loading.code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(loading.message().find("not ready"), absl::string_view::npos) << loading;
  EXPECT_FALSE(ServerReady(&backend, "loading"));
  EXPECT_TRUE(ServerReady(&backend, ""));
  EXPECT_TRUE(ServerReady(&backend, "minilm"));
  EXPECT_FALSE(ServerReady(&backend, "ended"));
}

TEST(KServeMetadata, InputsAndTheArchitecturesOutputs) {
  FakeBackend backend;
  const ModelMetadata embedding = MetadataOf(backend.embedding);
  EXPECT_EQ(embedding.name, "minilm");
  EXPECT_EQ(embedding.platform, "bertshard_BertModel");
  ASSERT_EQ(embedding.inputs.size(), 5u);
  EXPECT_EQ(embedding.inputs[0].name, "input_ids");
  EXPECT_EQ(embedding.inputs[0].shape, (std::vector<int64_t>{-1, -1}));
  EXPECT_EQ(embedding.inputs[3].datatype, "BYTES");
  ASSERT_EQ(embedding.outputs.size(), 2u);
  EXPECT_EQ(embedding.outputs[0].name, "last_hidden_state");
  EXPECT_EQ(embedding.outputs[0].shape, (std::vector<int64_t>{-1, -1, 4}));
  const ModelMetadata classifier = MetadataOf(backend.classifier);
  ASSERT_EQ(classifier.outputs.size(), 1u);
  EXPECT_EQ(classifier.outputs[0].shape, (std::vector<int64_t>{-1, 2}));
}

TEST(KServeInfer, RunsTheRequestPathAndAnswersItsTensors) {
  FakeBackend backend;
  InferRequest request;
  request.model = "minilm";
  request.id = "req-7";
  request.inputs = {Ids("input_ids", {1, 4}, {101, 7, 102, 0})};
  CallContext call;
  absl::StatusOr<InferResult> result = Infer(&backend, request, "", call);
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_EQ(backend.infers.size(), 1u);
  EXPECT_EQ(backend.infers[0].job_id(), "job-1");
  EXPECT_EQ(backend.infers[0].tokens().input_ids(1), 7);
  EXPECT_EQ(result->model_name, "minilm");
  EXPECT_EQ(result->model_version, "1");
  EXPECT_EQ(result->id, "req-7");
  ASSERT_EQ(result->outputs.size(), 1u);
  EXPECT_EQ(result->outputs[0].shape, (std::vector<int64_t>{1, 4, 2}));
  // The request path's refusal comes back as it is; bad input never reaches it.
  backend.infer_error = absl::ResourceExhaustedError("queued tokens over the share");
  EXPECT_EQ(Infer(&backend, request, "", call).status().code(), absl::StatusCode::kResourceExhausted);
  request.inputs[0].datatype = "FP32";
  EXPECT_EQ(Infer(&backend, request, "", call).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(backend.infers.size(), 2u);
}

TEST(KServeHttpStatus, MapsCodesAsKServeAnswers) {
  EXPECT_EQ(HttpStatusOf(absl::InvalidArgumentError("")), 400);
  EXPECT_EQ(HttpStatusOf(absl::FailedPreconditionError("")), 400);
  EXPECT_EQ(HttpStatusOf(absl::NotFoundError("")), 404);
  EXPECT_EQ(HttpStatusOf(absl::ResourceExhaustedError("")), 429);
  EXPECT_EQ(HttpStatusOf(absl::UnavailableError("")), 503);
  EXPECT_EQ(HttpStatusOf(absl::DeadlineExceededError("")), 504);
  EXPECT_EQ(HttpStatusOf(absl::InternalError("")), 500);
}

}  // namespace
}  // namespace bertshard::http::kserve
