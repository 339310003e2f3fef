// TEI's routes of HttpApi against a canned backend (fake_backend.h): what each route asks the
// request path for, and TEI's shapes, statuses and error bodies in return.
#include "http/http_api.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <string>

#include "gtest/gtest.h"
#include "http/fake_backend.h"
#include "nlohmann/json.hpp"

namespace bertshard::http {
namespace {

using nlohmann::json;

class TeiRoutesTest : public ::testing::Test {
 protected:
  HttpResponse Post(const std::string& path, const std::string& body, const std::string& authorization = "") {
    HttpRequest request;
    request.method = "POST";
    request.path = path;
    request.body = body;
    request.authorization = authorization;
    request.client = "host:127.0.0.1";
    request.connection = "127.0.0.1:5000";
    return api().Handle(request);
  }
  HttpResponse Get(const std::string& path, const std::string& authorization = "") {
    HttpRequest request;
    request.method = "GET";
    request.path = path;
    request.authorization = authorization;
    return api().Handle(request);
  }
  HttpApi& api() {
    if (api_ == nullptr) api_ = std::make_unique<HttpApi>(&backend_, options_);
    return *api_;
  }
  static std::map<std::string, std::string> Headers(const HttpResponse& response) {
    std::map<std::string, std::string> headers;
    for (const auto& [name, value] : response.headers) headers[name] = value;
    return headers;
  }
  // TEI's error body, checked for its shape.
  static void ExpectTeiError(const HttpResponse& response, int status, const std::string& type,
                             const std::string& message_part) {
    EXPECT_EQ(response.status, status) << response.body;
    const json body = json::parse(response.body, nullptr, false);
    ASSERT_TRUE(body.is_object()) << response.body;
    EXPECT_EQ(body.size(), 2u) << response.body;
    EXPECT_EQ(body.value("error_type", ""), type) << response.body;
    EXPECT_NE(body.value("error", "").find(message_part), std::string::npos) << response.body;
  }

  FakeBackend backend_;
  HttpApiOptions options_;
  std::unique_ptr<HttpApi> api_;
};

TEST_F(TeiRoutesTest, EmbedsOneTextAsTeiDoesWithTimingHeaders) {
  const HttpResponse response = Post("/embed", R"({"inputs": "What is Deep Learning?"})");
  ASSERT_EQ(response.status, 200) << response.body;
  EXPECT_EQ(response.content_type, "application/json");
  EXPECT_EQ(json::parse(response.body), json::parse("[[1, 0, 0.5, -1]]"));  // a single input still nests
  ASSERT_EQ(backend_.embeds.size(), 1u);
  const v1::EmbedRequest& asked = backend_.embeds[0];
  EXPECT_EQ(asked.job_id(), "job-1");
  ASSERT_EQ(asked.text().texts_size(), 1);
  EXPECT_EQ(asked.text().texts(0), "What is Deep Learning?");
  EXPECT_EQ(asked.normalize(), v1::NORMALIZE_ON);  // TEI's normalize defaults to true
  EXPECT_FALSE(asked.truncate());
  EXPECT_EQ(asked.dimensions(), 0);
  EXPECT_EQ(backend_.contexts[0].client, "host:127.0.0.1");
  EXPECT_EQ(backend_.contexts[0].connection, "127.0.0.1:5000");
  auto headers = Headers(response);
  EXPECT_EQ(headers["x-queue-time"], "250");
  EXPECT_EQ(headers["x-inference-time"], "500");
  EXPECT_EQ(headers["x-tokenization-time"], "125");
  EXPECT_EQ(headers["x-compute-tokens"], "5");
  EXPECT_EQ(headers["x-compute-characters"], "22");
  EXPECT_TRUE(headers.count("x-total-time") == 1 && headers.count("x-compute-time") == 1);
}

TEST_F(TeiRoutesTest, EmbedPassesItsOptionsAndKeepsTheInputsOrder) {
  const HttpResponse response =
      Post("/embed", R"({"inputs": ["a", [101, 102], "b"], "normalize": false, "truncate": true, "dimensions": 2,
                   "truncation_direction": "Right", "model": "minilm"})");
  ASSERT_EQ(response.status, 200) << response.body;
  // Texts in one Embed (call 1: rows 0, 1), token rows in another (call 2: row 0).
  EXPECT_EQ(json::parse(response.body), json::parse("[[1, 0], [2, 0], [1, 1]]"));
  ASSERT_EQ(backend_.embeds.size(), 2u);
  EXPECT_EQ(backend_.embeds[0].text().texts_size(), 2);
  EXPECT_EQ(backend_.embeds[0].normalize(), v1::NORMALIZE_OFF);
  EXPECT_TRUE(backend_.embeds[0].truncate());
  EXPECT_EQ(backend_.embeds[0].dimensions(), 2);
  EXPECT_FALSE(backend_.embeds[0].truncate_from_start());
  const v1::TokenInputs& tokens = backend_.embeds[1].tokens();
  EXPECT_EQ(tokens.rows(), 1);
  EXPECT_EQ(tokens.seq(), 2);
  EXPECT_EQ(tokens.input_ids(0), 101);
  EXPECT_EQ(backend_.resolved.back(), "minilm");
  // TEI's truncation_direction Left: cut from the start (the last tokens kept).
  ASSERT_EQ(Post("/embed", R"({"inputs": "a", "truncate": true, "truncation_direction": "Left"})").status, 200);
  EXPECT_TRUE(backend_.embeds.back().truncate_from_start());
  ASSERT_EQ(Post("/embed_all", R"({"inputs": "a", "truncation_direction": "Left"})").status, 200);
  EXPECT_TRUE(backend_.infers.back().truncate_from_start());
}

// prompt_name goes to the request path (which knows the model's prompts) from /embed and
// /similarity; /embed_all and /tokenize put the prompt's text before each text themselves; the
// routes that take no prompt refuse one before anything runs.
TEST_F(TeiRoutesTest, PromptNameReachesEmbedAndIsRefusedWhereNoRouteTakesIt) {
  ASSERT_EQ(Post("/embed", R"({"inputs": "a", "prompt_name": "query"})").status, 200);
  ASSERT_EQ(backend_.embeds.size(), 1u);
  EXPECT_EQ(backend_.embeds.back().prompt_name(), "query");
  ASSERT_EQ(Post("/similarity",
                 R"({"inputs": {"source_sentence": "a", "sentences": ["b"]}, "parameters": {"prompt_name": "q"}})")
                .status,
            200);
  EXPECT_EQ(backend_.embeds.back().prompt_name(), "q");
  ASSERT_EQ(Post("/embed", R"({"inputs": "a"})").status, 200);
  EXPECT_EQ(backend_.embeds.back().prompt_name(), "");  // the model's default prompt, if any
  const size_t embeds = backend_.embeds.size(), infers = backend_.infers.size();
  ExpectTeiError(Post("/predict", R"({"inputs": "a", "prompt_name": "query", "model": "sentiment"})"), 422,
                 "Validation", "not supported on /predict");
  ExpectTeiError(Post("/rerank", R"({"query": "q", "texts": ["a"], "prompt_name": "query", "model": "reranker"})"), 422,
                 "Validation", "not supported on /rerank");
  EXPECT_EQ(backend_.embeds.size(), embeds);
  EXPECT_EQ(backend_.infers.size(), infers);
}

TEST_F(TeiRoutesTest, EmbedAllAndTokenizePutThePromptBeforeEachText) {
  ASSERT_EQ(Post("/embed_all", R"({"inputs": ["a", [101, 102]], "prompt_name": "query"})").status, 422);
  ASSERT_EQ(Post("/embed_all", R"({"inputs": ["a", "b"], "prompt_name": "query"})").status, 200);
  ASSERT_EQ(backend_.infers.size(), 1u);
  EXPECT_EQ(backend_.infers[0].text().texts(0), "query: a");
  EXPECT_EQ(backend_.infers[0].text().texts(1), "query: b");
  const HttpResponse tokens = Post("/tokenize", R"({"inputs": "hello", "prompt_name": "query"})");
  ASSERT_EQ(tokens.status, 200) << tokens.body;
  EXPECT_EQ(json::parse(tokens.body)[0][1]["text"], "query: hello");  // the fake's one token per text
  // No name: the model's default prompt, as /embed applies it; token ids stay as they are.
  backend_.default_prompt = "passage: ";
  ASSERT_EQ(Post("/embed_all", R"({"inputs": "a"})").status, 200);
  EXPECT_EQ(backend_.infers.back().text().texts(0), "passage: a");
  ASSERT_EQ(Post("/embed_all", R"({"inputs": [[101, 102]]})").status, 200);
  EXPECT_EQ(backend_.infers.back().tokens().input_ids(0), 101);
  EXPECT_EQ(json::parse(Post("/tokenize", R"({"inputs": "x"})").body)[0][1]["text"], "passage: x");
  const size_t infers = backend_.infers.size();
  ExpectTeiError(Post("/embed_all", R"({"inputs": "a", "prompt_name": "doc"})"), 422, "Validation",
                 "no prompt named 'doc'");
  ExpectTeiError(Post("/tokenize", R"({"inputs": "a", "prompt_name": "doc"})"), 422, "Validation",
                 "no prompt named 'doc'");
  ExpectTeiError(Post("/tokenize", R"({"inputs": "a", "prompt_name": ""})"), 422, "Validation", "prompt_name is empty");
  EXPECT_EQ(backend_.infers.size(), infers);
}

TEST_F(TeiRoutesTest, PadsTokenRowsAndMasksThePadding) {
  ASSERT_EQ(Post("/embed", R"({"inputs": [[101, 7, 102], [101, 102]]})").status, 200);
  const v1::TokenInputs& tokens = backend_.embeds[0].tokens();
  EXPECT_EQ(tokens.rows(), 2);
  EXPECT_EQ(tokens.seq(), 3);
  EXPECT_EQ(std::vector<int64_t>(tokens.attention_mask().begin(), tokens.attention_mask().end()),
            (std::vector<int64_t>{1, 1, 1, 1, 1, 0}));
}

// Review of issue 23: one long id list among many short ones was padded into rows x longest ids
// (32 x 1M x 3 int64 from a 2 MB body) before any limit looked at it. Refused first now, on
// /embed, /embed_all and OpenAI's route, and nothing reaches the backend.
TEST_F(TeiRoutesTest, RefusesTokenRowsWhosePaddedRectangleIsOverTheBatchBeforeMakingIt) {
  options_.max_batch_tokens = 64;
  std::string long_row = "[101";
  for (int i = 0; i < 40; ++i) long_row += ", 7";
  long_row += ", 102]";
  const std::string body = R"({"inputs": [)" + long_row + R"(, [101, 102], [101, 102]]})";
  for (const char* path : {"/embed", "/embed_all"}) {
    SCOPED_TRACE(path);
    ExpectTeiError(Post(path, body), 413, "Validation", "3 x 42 = 126 ids, more than the 64");
  }
  const HttpResponse openai = Post("/v1/embeddings", R"({"input": [)" + long_row + R"(, [101, 102], [101, 102]]})");
  EXPECT_EQ(openai.status, 400) << openai.body;
  EXPECT_TRUE(backend_.embeds.empty());
  EXPECT_TRUE(backend_.infers.empty());
  // Within the bound it goes through.
  ASSERT_EQ(Post("/embed", R"({"inputs": [)" + long_row + "]}").status, 200);
}

TEST_F(TeiRoutesTest, RefusesAsTeiDoes) {
  options_.max_client_batch_size = 2;
  ExpectTeiError(Post("/embed", R"({"inputs": []})"), 400, "Empty", "`inputs` cannot be empty");
  ExpectTeiError(Post("/embed", R"({"inputs": ""})"), 400, "Empty", "`inputs` cannot be empty");
  ExpectTeiError(Post("/embed", R"({"inputs": ["a", ""]})"), 400, "Empty", "`inputs` cannot be empty");
  ExpectTeiError(Post("/embed", R"({"inputs": ["a", "b", "c"]})"), 413, "Validation",
                 "batch size 3 > maximum allowed batch size 2");
  ExpectTeiError(Post("/embed", R"({"inputs": 7})"), 422, "Validation", "`inputs` must be");
  ExpectTeiError(Post("/embed", R"({"text": "a"})"), 422, "Validation", "`inputs` is missing");
  ExpectTeiError(Post("/embed", "not json"), 422, "Validation", "not valid JSON");
  ExpectTeiError(Post("/embed", R"({"inputs": "a", "normalize": "yes"})"), 422, "Validation", "`normalize`");
  ExpectTeiError(Post("/embed", R"({"inputs": "a", "truncation_direction": "up"})"), 422, "Validation",
                 "expected `Left` or `Right`");
  ExpectTeiError(Post("/embed", R"({"inputs": "a", "prompt_name": 7})"), 422, "Validation", "prompt_name");
  ExpectTeiError(Post("/embed", R"({"inputs": "a", "prompt_name": ""})"), 422, "Validation", "prompt_name is empty");
  ExpectTeiError(Post("/embed", R"({"inputs": "a", "dimensions": 0})"), 422, "Validation", "`dimensions`");
  ExpectTeiError(Post("/embed", R"({"inputs": "a", "model": "nope"})"), 422, "Validation", "no job has");
  EXPECT_TRUE(backend_.embeds.empty());  // none of them reached the request path
  HttpRequest large;
  large.method = "POST";
  large.path = "/embed";
  large.body_too_large = true;
  ExpectTeiError(api().Handle(large), 413, "Validation", "length limit exceeded");
}

TEST_F(TeiRoutesTest, MapsTheRequestPathsRefusals) {
  const std::vector<std::tuple<absl::Status, int, std::string>> cases = {
      {absl::InvalidArgumentError("text has 600 tokens; the model takes at most 512"), 413, "Validation"},
      {absl::FailedPreconditionError("Embed needs a BertModel job"), 424, "Backend"},
      {absl::ResourceExhaustedError("over this client's share"), 429, "Overloaded"},
      {absl::UnavailableError("job failed"), 503, "Unhealthy"},
      {absl::InternalError("worker answered badly"), 424, "Backend"},
  };
  for (const auto& [status, code, type] : cases) {
    SCOPED_TRACE(status.ToString());
    backend_.embed_error = status;
    ExpectTeiError(Post("/embed", R"({"inputs": "a"})"), code, type, std::string(status.message()));
  }
}

TEST_F(TeiRoutesTest, AnswersTooManyRequestsPastTheConcurrencyLimit) {
  options_.max_concurrent_requests = 1;
  HttpResponse second;
  // While the first request is on the request path, a second one finds no permit.
  backend_.on_embed = [&] {
    backend_.on_embed = nullptr;
    second = Post("/embed", R"({"inputs": "b"})");
  };
  const HttpResponse first = Post("/embed", R"({"inputs": "a"})");
  EXPECT_EQ(first.status, 200) << first.body;
  ExpectTeiError(second, 429, "Overloaded", "Model is overloaded");
  EXPECT_EQ(backend_.embeds.size(), 1u);
  EXPECT_EQ(api().in_flight(), 0);  // the permit went back
  EXPECT_EQ(Post("/embed", R"({"inputs": "c"})").status, 200);
}

TEST_F(TeiRoutesTest, NeedsTheReadTokenWhenOneIsSet) {
  options_.read_token = "read-secret";
  options_.admin_token = "admin-secret";
  for (const std::string& header :
       {std::string(), std::string("Bearer wrong"), std::string("read-secret"), std::string("Basic read-secret")}) {
    SCOPED_TRACE(header);
    const HttpResponse response = Post("/embed", R"({"inputs": "a"})", header);
    EXPECT_EQ(response.status, 401);
    EXPECT_EQ(response.body, "");  // TEI's api-key check answers with no body
    EXPECT_EQ(Headers(response)["WWW-Authenticate"], "Bearer");
  }
  EXPECT_TRUE(backend_.embeds.empty());
  EXPECT_EQ(Post("/embed", R"({"inputs": "a"})", "Bearer read-secret").status, 200);
  EXPECT_EQ(Post("/embed", R"({"inputs": "a"})", "bearer admin-secret").status, 200);
  EXPECT_EQ(Get("/info").status, 401);
  EXPECT_EQ(Get("/health").status, 200);  // the probe stays open, as gRPC's health service
}

// The open probe names no job when a read token hides them (review of issue 23).
TEST_F(TeiRoutesTest, AnUnhealthyProbeNamesNoJobWhenAReadTokenIsSet) {
  options_.default_job = "secret-project";
  const HttpResponse open = Get("/health");
  EXPECT_EQ(open.status, 503);
  EXPECT_NE(open.body.find("secret-project"), std::string::npos) << open.body;  // no token: said
  api_.reset();
  options_.read_token = "read-secret";
  const HttpResponse hidden = Get("/health");
  ExpectTeiError(hidden, 503, "Unhealthy", "the default job does not serve");
  EXPECT_EQ(hidden.body.find("secret-project"), std::string::npos) << hidden.body;
}

TEST_F(TeiRoutesTest, EmbedAllAnswersEachInputsRealTokens) {
  const HttpResponse response = Post("/embed_all", R"({"inputs": ["a", "b"]})");
  ASSERT_EQ(response.status, 200) << response.body;
  // Each row has 3 real tokens (the fake masks the fourth), each a hidden state (row, position).
  EXPECT_EQ(json::parse(response.body), json::parse("[[[0,0],[0,1],[0,2]], [[1,0],[1,1],[1,2]]]"));
  ASSERT_EQ(backend_.infers.size(), 1u);
  EXPECT_FALSE(backend_.infers[0].predictions_only());
  ExpectTeiError(Post("/embed_all", R"({"inputs": "a", "model": "sentiment"})"), 424, "Backend",
                 "model is not an embedding model");
}

TEST_F(TeiRoutesTest, EmbedSparseAnswersTeisIndexValueListsInTheInputsOrder) {
  const HttpResponse response =
      Post("/embed_sparse", R"({"inputs": ["a", [101, 102], "b"], "truncate": true, "truncation_direction": "Left",
                           "prompt_name": "query", "model": "splade"})");
  ASSERT_EQ(response.status, 200) << response.body;
  // Texts in one Embed (call 1: rows 0, 1), token rows in another (call 2: row 0).
  EXPECT_EQ(json::parse(response.body), json::parse(R"([[{"index": 0, "value": 0.5}, {"index": 101, "value": 1}],
                                                        [{"index": 0, "value": 0.5}, {"index": 102, "value": 2}],
                                                        [{"index": 1, "value": 0.5}, {"index": 101, "value": 1}]])"));
  ASSERT_EQ(backend_.embeds.size(), 2u);
  const v1::EmbedRequest& asked = backend_.embeds[0];
  EXPECT_TRUE(asked.sparse());
  EXPECT_EQ(asked.job_id(), "job-4");
  EXPECT_TRUE(asked.truncate());
  EXPECT_TRUE(asked.truncate_from_start());
  EXPECT_EQ(asked.prompt_name(), "query");
  EXPECT_EQ(asked.pooling(), v1::POOLING_UNSPECIFIED);
  EXPECT_EQ(asked.normalize(), v1::NORMALIZE_UNSPECIFIED);
  EXPECT_EQ(Headers(response)["x-compute-tokens"], "9");
  // The root route is a SPLADE model's own task; /info says so as TEI does.
  const HttpResponse root = Post("/", R"({"inputs": "a", "model": "splade"})");
  ASSERT_EQ(root.status, 200) << root.body;
  EXPECT_EQ(json::parse(root.body)[0][0]["index"], 0);
  ExpectTeiError(Post("/embed_sparse", R"({"inputs": "a"})"), 424, "Backend", "model is not a SPLADE model");
  ExpectTeiError(Post("/embed_sparse", R"({"inputs": "", "model": "splade"})"), 400, "Empty", "cannot be empty");
  ExpectTeiError(Post("/embed_sparse", R"({"inputs": "a", "model": "splade", "truncation_direction": "Up"})"), 422,
                 "Validation", "truncation_direction");
  EXPECT_TRUE(std::all_of(backend_.embeds.begin(), backend_.embeds.end(),
                          [](const v1::EmbedRequest& r) { return r.sparse(); }));
  api_.reset();
  options_.default_job = "splade";
  EXPECT_EQ(json::parse(Get("/info").body)["model_type"], json::parse(R"({"embedding": {"pooling": "splade"}})"));
}

TEST_F(TeiRoutesTest, ServesTheCoordinatorsMetricsBehindTheReadToken) {
  EXPECT_EQ(Get("/metrics").status, 404);  // no registry given: no route
  api_.reset();
  int renders = 0;
  options_.metrics = [&renders] { return "# TYPE x counter\nx " + std::to_string(++renders) + "\n"; };
  options_.read_token = "reader";
  EXPECT_EQ(Get("/metrics").status, 401);  // it names jobs, which only readers see
  const HttpResponse scraped = Get("/metrics", "Bearer reader");
  ASSERT_EQ(scraped.status, 200);
  EXPECT_EQ(scraped.content_type, "text/plain; version=0.0.4; charset=utf-8");
  EXPECT_EQ(scraped.body, "# TYPE x counter\nx 1\n");
  EXPECT_EQ(Post("/metrics", "{}", "Bearer reader").status, 405);
  EXPECT_EQ(renders, 1);
}

TEST_F(TeiRoutesTest, PredictsSinglesPairsAndBatches) {
  const std::string scores = R"([{"score": 0.75, "label": "POS"}, {"score": 0.25, "label": "NEG"}])";
  HttpResponse single = Post("/predict", R"({"inputs": "I like it", "model": "sentiment"})");
  ASSERT_EQ(single.status, 200) << single.body;
  EXPECT_EQ(json::parse(single.body), json::parse(scores));
  EXPECT_TRUE(backend_.infers.back().predictions_only());
  HttpResponse pair = Post("/predict", R"({"inputs": ["premise", "hypothesis"], "model": "sentiment"})");
  ASSERT_EQ(pair.status, 200) << pair.body;
  EXPECT_EQ(json::parse(pair.body), json::parse(scores));
  EXPECT_EQ(backend_.infers.back().text().text_pairs(0), "hypothesis");
  HttpResponse batch = Post("/predict", R"({"inputs": [["a"], ["b", "c"]], "model": "sentiment"})");
  ASSERT_EQ(batch.status, 200) << batch.body;
  EXPECT_EQ(json::parse(batch.body), json::parse("[" + scores + "," + scores + "]"));
  HttpResponse raw = Post("/predict", R"({"inputs": "a", "raw_scores": true, "model": "sentiment"})");
  ASSERT_EQ(raw.status, 200) << raw.body;
  EXPECT_EQ(json::parse(raw.body), json::parse(R"([{"score": 2, "label": "POS"}, {"score": -1, "label": "NEG"}])"));
  ExpectTeiError(Post("/predict", R"({"inputs": ["a", "b", "c"], "model": "sentiment"})"), 422, "Validation",
                 "invalid length 3");
  ExpectTeiError(Post("/predict", R"({"inputs": "a"})"), 424, "Backend", "model is not a classifier model");
}

TEST_F(TeiRoutesTest, SimilarityIsTheCosineOfTheSourceWithEachSentence) {
  // The fake's vectors: source (1, 0, 0.5, -1), sentences (1, 1, 0.5, -1) and (1, 2, 0.5, -1); dot
  // products 1 + 0.25 + 1 = 2.25 both (the source's second value is 0). The route asks for unit
  // vectors, whose dot products are the cosines; the fake does not normalise, so they show here.
  const HttpResponse response =
      Post("/similarity",
           R"({"inputs": {"source_sentence": "a", "sentences": ["b", "c"]}, "parameters": {"truncate": true}})");
  ASSERT_EQ(response.status, 200) << response.body;
  EXPECT_EQ(json::parse(response.body), json::parse("[2.25, 2.25]"));
  ASSERT_EQ(backend_.embeds.size(), 1u);
  EXPECT_EQ(backend_.embeds[0].text().texts_size(), 3);
  EXPECT_EQ(backend_.embeds[0].normalize(), v1::NORMALIZE_ON);
  EXPECT_TRUE(backend_.embeds[0].truncate());
  ExpectTeiError(Post("/similarity", R"({"inputs": {"source_sentence": "a", "sentences": []}})"), 400, "Empty",
                 "`inputs.sentences` cannot be empty");
  ExpectTeiError(Post("/similarity", R"({"inputs": "a"})"), 422, "Validation", "source_sentence");
  options_.max_client_batch_size = 2;
  api_.reset();
  ExpectTeiError(Post("/similarity", R"({"inputs": {"source_sentence": "a", "sentences": ["b", "c"]}})"), 413,
                 "Validation", "batch size 3 > maximum allowed batch size 2");
}

TEST_F(TeiRoutesTest, RerankSortsTheTextsByTheirSigmoidScores) {
  // The fake's logits for the 3 pairs: 0, 1, -1.
  const HttpResponse response =
      Post("/rerank", R"({"query": "q", "texts": ["a", "b", "c"], "return_text": true, "model": "reranker"})");
  ASSERT_EQ(response.status, 200) << response.body;
  const json body = json::parse(response.body);
  ASSERT_EQ(body.size(), 3u) << response.body;
  EXPECT_EQ(body[0]["index"], 1);
  EXPECT_EQ(body[0]["text"], "b");
  EXPECT_FLOAT_EQ(body[0]["score"].get<float>(), 1 / (1 + std::exp(-1.0f)));
  EXPECT_EQ(body[1]["index"], 0);
  EXPECT_FLOAT_EQ(body[1]["score"].get<float>(), 0.5f);
  EXPECT_EQ(body[2]["index"], 2);
  const v1::InferRequest& asked = backend_.infers.back();
  EXPECT_EQ(asked.text().texts(2), "q");
  EXPECT_EQ(asked.text().text_pairs(2), "c");
  const HttpResponse raw =
      Post("/rerank", R"({"query": "q", "texts": ["a", "b"], "raw_scores": true, "model": "reranker"})");
  EXPECT_EQ(json::parse(raw.body), json::parse(R"([{"index": 1, "score": 1}, {"index": 0, "score": 0}])"));
  ExpectTeiError(Post("/rerank", R"({"query": "q", "texts": [], "model": "reranker"})"), 400, "Empty",
                 "`texts` cannot be empty");
  ExpectTeiError(Post("/rerank", R"({"query": "q", "texts": ["a"], "model": "sentiment"})"), 424, "Backend",
                 "model is not a re-ranker model");
  ExpectTeiError(Post("/rerank", R"({"query": "q", "texts": ["a"]})"), 424, "Backend", "model is not a re-ranker");
  ExpectTeiError(Post("/rerank", R"({"texts": ["a"], "model": "reranker"})"), 422, "Validation", "`query`");
}

TEST_F(TeiRoutesTest, TheRootRouteIsTheModelsOwnTask) {
  // InferenceClient posts {"inputs": ...} to the server's URL: the default job's task answers.
  const HttpResponse embedded = Post("/", R"({"inputs": "a"})");
  ASSERT_EQ(embedded.status, 200) << embedded.body;
  EXPECT_EQ(json::parse(embedded.body), json::parse("[[1, 0, 0.5, -1]]"));
  const HttpResponse predicted = Post("/invocations", R"({"inputs": "a", "model": "sentiment"})");
  ASSERT_EQ(predicted.status, 200) << predicted.body;
  EXPECT_EQ(json::parse(predicted.body)[0]["label"], "POS");
  const HttpResponse ranked = Post("/", R"({"query": "q", "texts": ["a", "b"], "model": "reranker"})");
  ASSERT_EQ(ranked.status, 200) << ranked.body;
  EXPECT_EQ(json::parse(ranked.body)[0]["index"], 1);
  EXPECT_EQ(Get("/").status, 200);  // TEI's health on GET /
}

TEST_F(TeiRoutesTest, TokenizesAndDecodes) {
  HttpResponse tokens = Post("/tokenize", R"({"inputs": "hello"})");
  ASSERT_EQ(tokens.status, 200) << tokens.body;
  EXPECT_EQ(json::parse(tokens.body), json::parse(R"([[
      {"id": 101, "text": "[CLS]", "special": true, "start": null, "stop": null},
      {"id": 7592, "text": "hello", "special": false, "start": null, "stop": null},
      {"id": 102, "text": "[SEP]", "special": true, "start": null, "stop": null}]])"));
  HttpResponse plain = Post("/tokenize", R"({"inputs": ["a", "b"], "add_special_tokens": false})");
  ASSERT_EQ(plain.status, 200) << plain.body;
  EXPECT_EQ(json::parse(plain.body).size(), 2u);
  EXPECT_EQ(json::parse(plain.body)[1].size(), 1u);
  EXPECT_EQ(Post("/tokenize", R"({"inputs": [5]})").status, 422);  // text only, as TEI's TokenizeInput
  HttpResponse decoded = Post("/decode", R"({"ids": [101, 7592, 102]})");
  ASSERT_EQ(decoded.status, 200) << decoded.body;
  EXPECT_EQ(json::parse(decoded.body), json::parse(R"(["decoded 3"])"));
  HttpResponse batch = Post("/decode", R"({"ids": [[1], [2, 3]]})");
  EXPECT_EQ(json::parse(batch.body), json::parse(R"(["decoded 1", "decoded 2"])"));
  ExpectTeiError(Post("/decode", R"({"ids": []})"), 400, "Empty", "`ids` cannot be empty");
  ExpectTeiError(Post("/decode", R"({"ids": [99999999]})"), 422, "Tokenizer", "outside the vocabulary");
  ExpectTeiError(Post("/decode", R"({"ids": [1], "skip_special_tokens": false})"), 422, "Validation",
                 "skip_special_tokens");
}

TEST_F(TeiRoutesTest, DescribesTheDefaultJob) {
  options_.max_client_batch_size = 8;
  HttpResponse info = Get("/info");
  ASSERT_EQ(info.status, 200) << info.body;
  const json body = json::parse(info.body);
  EXPECT_EQ(body["model_id"], "minilm");
  EXPECT_EQ(body["model_type"], json::parse(R"({"embedding": {"pooling": "mean"}})"));
  EXPECT_EQ(body["max_input_length"], 256);
  EXPECT_EQ(body["max_client_batch_size"], 8);
  EXPECT_EQ(body["model_dtype"], "float32");
  EXPECT_TRUE(body["model_sha"].is_null());
  EXPECT_EQ(Post("/info", "{}").status, 405);
  EXPECT_EQ(Get("/embed").status, 405);
  EXPECT_EQ(Get("/nowhere").status, 404);
}

// As TEI's router: a classifier of more than one label is a classifier, one of one label (a
// cross-encoder) a reranker.
TEST_F(TeiRoutesTest, DescribesAOneLabelClassifierAsAReranker) {
  options_.default_job = "reranker";
  const json reranker = json::parse(Get("/info").body);
  EXPECT_EQ(reranker["model_type"], json::parse(R"({"reranker": {"id2label": {"0": "LABEL_0"},
                                                                 "label2id": {"LABEL_0": 0}}})"));
  api_.reset();
  options_.default_job = "sentiment";
  const json classifier = json::parse(Get("/info").body);
  ASSERT_TRUE(classifier["model_type"].contains("classifier")) << classifier.dump();
  EXPECT_GT(classifier["model_type"]["classifier"]["id2label"].size(), 1u);
}

}  // namespace
}  // namespace bertshard::http
