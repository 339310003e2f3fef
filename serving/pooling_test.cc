#include "serving/pooling.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace bertshard::serving {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using Rows = std::vector<std::vector<float>>;

// [3 rows, 4 positions, 3 dims]: torch.randint(-400, 400, (3, 4, 3), generator=manual_seed(0)) / 100.
const std::vector<float> kHidden = {-3.56f, -1.61f, 1.33f,  -2.40f, -2.37f, -0.21f, -1.73f, -2.97f, -1.03f,
                                    -3.17f, 1.01f,  0.66f,  -0.44f, 1.99f,  2.78f,  -0.24f, -3.44f, -1.32f,
                                    3.94f,  -3.67f, -0.74f, 1.19f,  3.91f,  2.54f,  -3.76f, -1.59f, -3.31f,
                                    1.69f,  3.49f,  2.80f,  2.81f,  -1.88f, 1.63f,  1.60f,  1.95f,  0.85f};
// The last row has no real token: sentence-transformers' clamps keep it free of NaN.
const std::vector<int64_t> kMask = {1, 1, 1, 0, 1, 1, 0, 0, 0, 0, 0, 0};

// Expected vectors come from sentence-transformers 2.x's Pooling.forward and Normalize
// (torch.nn.functional.normalize) transcribed into torch 1.13 and run on kHidden / kMask in float32;
// printed with 9 significant digits. We accumulate in double, so agreement is to ~1e-6.
void ExpectRows(const Rows& got, const Rows& want, double tolerance = 2e-6) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t r = 0; r < want.size(); ++r) {
    ASSERT_EQ(got[r].size(), want[r].size()) << "row " << r;
    for (size_t d = 0; d < want[r].size(); ++d) {
      EXPECT_NEAR(got[r][d], want[r][d], tolerance * std::max(1.0, std::fabs(static_cast<double>(want[r][d]))))
          << "row " << r << " dim " << d;
    }
  }
}

Rows PoolOrDie(Pooling pooling, bool normalize) {
  auto out = Pool(kHidden, 3, 4, 3, kMask, pooling, normalize);
  EXPECT_TRUE(out.ok()) << out.status();
  return out.ok() ? *out : Rows{};
}

TEST(Pool, MeanMatchesSentenceTransformers) {
  ExpectRows(PoolOrDie(Pooling::kMean, false),
             {{-2.56333327f, -2.3166666f, 0.0300000105f}, {-0.340000004f, -0.725000024f, 0.729999959f}, {0, 0, 0}});
  ExpectRows(PoolOrDie(Pooling::kMean, true),
             {{-0.741873384f, -0.670483768f, 0.00868252665f}, {-0.313777477f, -0.669084311f, 0.673698664f}, {0, 0, 0}});
}

TEST(Pool, ClsIsTokenZeroWhateverTheMask) {
  ExpectRows(PoolOrDie(Pooling::kCls, false),
             {{-3.56f, -1.61f, 1.33f}, {-0.44f, 1.99f, 2.78f}, {-3.76f, -1.59f, -3.31f}}, 0);
  ExpectRows(PoolOrDie(Pooling::kCls, true), {{-0.862549484f, -0.390085608f, 0.322244644f},
                                              {-0.127645671f, 0.577306509f, 0.806488514f},
                                              {-0.715421259f, -0.302531868f, -0.629799008f}});
}

TEST(Pool, MaxGivesMaskedPositionsMinusOneBillion) {
  ExpectRows(PoolOrDie(Pooling::kMax, false), {{-1.73f, -1.61f, 1.33f}, {-0.24f, 1.99f, 2.78f}, {-1e9f, -1e9f, -1e9f}},
             0);
  ExpectRows(PoolOrDie(Pooling::kMax, true), {{-0.637950897f, -0.593699992f, 0.490447819f},
                                              {-0.0700268149f, 0.580639005f, 0.811143935f},
                                              {-0.577350259f, -0.577350259f, -0.577350259f}});
}

TEST(Pool, MaxLetsMinusOneBillionWinOverSmallerRealValues) {
  // sentence-transformers takes the max after setting masked positions to -1e9, so a masked
  // position beats real values below -1e9.
  const std::vector<float> hidden = {-2e9f, 5.0f, -3e9f, 6.0f};
  auto out = Pool(hidden, 1, 2, 2, std::vector<int64_t>{1, 0}, Pooling::kMax, false);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ((*out)[0], (std::vector<float>{-1e9f, 5.0f}));
}

TEST(Pool, MeanSqrtLen) {
  ExpectRows(PoolOrDie(Pooling::kMeanSqrtLen, false),
             {{-4.43982363f, -4.01258421f, 0.0519615449f}, {-0.480832636f, -1.02530491f, 1.03237581f}, {0, 0, 0}});
  ExpectRows(PoolOrDie(Pooling::kMeanSqrtLen, true),
             {{-0.741873384f, -0.670483708f, 0.00868252665f}, {-0.313777506f, -0.66908437f, 0.673698664f}, {0, 0, 0}});
}

TEST(Pool, NoNanAnywhereForAnEmptyRow) {
  for (Pooling p : {Pooling::kMean, Pooling::kCls, Pooling::kMax, Pooling::kMeanSqrtLen}) {
    for (bool normalize : {false, true}) {
      // Held by name: a range-for over PoolOrDie(...)[2] read a destroyed temporary (found by ASan).
      const Rows rows = PoolOrDie(p, normalize);
      ASSERT_EQ(rows.size(), 3u);
      for (float v : rows[2]) EXPECT_FALSE(std::isnan(v)) << PoolingName(p) << " " << normalize;
    }
  }
}

TEST(Pool, ZeroRowsIsAnEmptyBatch) {
  auto out = Pool(nullptr, 0, 4, 3, nullptr, Pooling::kMean, true);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_TRUE(out->empty());
}

TEST(Pool, RejectsInconsistentInput) {
  EXPECT_THAT(Pool(kHidden, 3, 4, 2, kMask, Pooling::kMean, false).status().message(), HasSubstr("needs 24"));
  EXPECT_THAT(Pool(kHidden, 3, 4, 3, absl::MakeConstSpan(kMask).subspan(1), Pooling::kMean, false).status().message(),
              HasSubstr("attention mask holds 11"));
  EXPECT_EQ(Pool(kHidden.data(), 3, 0, 3, kMask.data(), Pooling::kMean, false).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Pool(kHidden.data(), -1, 4, 3, kMask.data(), Pooling::kMean, false).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Pool(kHidden.data(), 3, 4, 0, kMask.data(), Pooling::kMean, false).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Pool(nullptr, 3, 4, 3, kMask.data(), Pooling::kMean, false).status().code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<int64_t> bad = kMask;
  bad[5] = 2;
  EXPECT_THAT(Pool(kHidden, 3, 4, 3, bad, Pooling::kMean, false).status().message(),
              HasSubstr("value 2 at row 1, position 1"));
}

TEST(Cosine, AsSentenceTransformersCosSim) {
  // util.cos_sim on [1, 2, 3] and [-2, 0.5, 4] in torch: 0.6533052325248718.
  EXPECT_NEAR(Cosine({1, 2, 3}, {-2, 0.5, 4}), 0.6533052325248718, 1e-7);
  EXPECT_NEAR(Cosine({1, 2, 3}, {2, 4, 6}), 1.0, 1e-12);
  EXPECT_EQ(Cosine({0, 0}, {1, 2}), 0.0);
  EXPECT_TRUE(std::isnan(Cosine({1, 2}, {1, 2, 3})));
}

TEST(ParsePooling, NamesRoundTrip) {
  for (Pooling p : {Pooling::kMean, Pooling::kCls, Pooling::kMax, Pooling::kMeanSqrtLen}) {
    auto parsed = ParsePooling(PoolingName(p));
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, p);
  }
  auto bad = ParsePooling("lasttoken");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("mean, cls, max, mean_sqrt_len"));
}

// A checkpoint directory in the test's temp dir, with files written by the test.
class Checkpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::path(::testing::TempDir()) / (std::string("serving_pooling_") + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void Write(const std::string& relative, const std::string& text) {
    const fs::path path = dir_ / relative;
    fs::create_directories(path.parent_path());
    std::ofstream(path) << text;
  }
  // modules.json as sentence-transformers saves it for e.g. all-MiniLM-L6-v2.
  void WriteModules(bool normalize, const std::string& extra = "") {
    std::string modules =
        R"([{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"})";
    if (normalize) {
      modules +=
          R"(, {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})";
    }
    Write("modules.json", modules + extra + "]");
  }
  void WritePooling(const std::string& mode, const std::string& extra = "") {
    std::string config = R"({"word_embedding_dimension": 384)";
    for (const char* m :
         {"cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken"}) {
      config += std::string(", \"pooling_mode_") + m + "\": " + (mode == m ? "true" : "false");
    }
    Write("1_Pooling/config.json", config + extra + R"(, "include_prompt": true})");
  }
  std::string dir() const { return dir_.string(); }

  fs::path dir_;
};

TEST_F(Checkpoint, ReadsSentenceTransformersFiles) {
  // Mirrors sentence-transformers/all-MiniLM-L6-v2's files.
  WriteModules(/*normalize=*/true);
  WritePooling("mean_tokens");
  Write("sentence_bert_config.json", R"({"max_seq_length": 256, "do_lower_case": false})");
  auto config = ReadEmbeddingConfig(dir());
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->pooling, Pooling::kMean);
  EXPECT_TRUE(config->normalize);
  EXPECT_EQ(config->max_seq_length, 256);
  EXPECT_EQ(config->word_embedding_dimension, 384);
  EXPECT_TRUE(config->from_files);
}

// config_sentence_transformers.json's prompts as sentence-transformers saves them (e.g. the E5 and
// BGE families), and which one a request gets.
TEST_F(Checkpoint, ReadsPromptsAndChoosesTheNamedOrTheDefaultOne) {
  WriteModules(/*normalize=*/true);
  WritePooling("mean_tokens");
  Write("config_sentence_transformers.json",
        R"({"__version__": {"sentence_transformers": "3.0.1"}, "prompts": {"query": "query: ", "passage": "passage: "},
            "default_prompt_name": "query", "similarity_fn_name": "cosine"})");
  auto config = ReadEmbeddingConfig(dir());
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->prompts.size(), 2u);
  EXPECT_EQ(config->default_prompt_name, "query");
  EXPECT_TRUE(config->include_prompt);
  EXPECT_EQ(PromptFor(*config, "").value_or("?"), "query: ");
  EXPECT_EQ(PromptFor(*config, "passage").value_or("?"), "passage: ");
  const absl::Status unknown = PromptFor(*config, "document").status();
  EXPECT_EQ(unknown.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(unknown.message().find("passage, query"), std::string::npos) << unknown;
  // No default: no prompt unless one is named; none at all: every name is unknown.
  config->default_prompt_name.clear();
  EXPECT_EQ(PromptFor(*config, "").value_or("?"), "");
  EXPECT_EQ(PromptFor(EmbeddingConfig(), "query").status().code(), absl::StatusCode::kInvalidArgument);
  // A pooling without the prompt's tokens is not done: refused once a prompt applies.
  Write("1_Pooling/config.json", R"({"word_embedding_dimension": 384, "pooling_mode_mean_tokens": true,
                                     "include_prompt": false})");
  config = ReadEmbeddingConfig(dir());
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_FALSE(config->include_prompt);
  EXPECT_EQ(PromptFor(*config, "passage").status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(Checkpoint, MalformedPromptsNameTheFile) {
  WriteModules(/*normalize=*/false);
  WritePooling("mean_tokens");
  for (const char* bad :
       {R"({"prompts": ["query: "]})", R"({"prompts": {"query": 1}})",
        R"({"prompts": {"query": "q: "}, "default_prompt_name": "passage"})", R"({"default_prompt_name": 3})", "[]"}) {
    SCOPED_TRACE(bad);
    Write("config_sentence_transformers.json", bad);
    const absl::Status refused = ReadEmbeddingConfig(dir()).status();
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(refused.message().find("config_sentence_transformers.json"), std::string::npos) << refused;
  }
  Write("config_sentence_transformers.json", R"({"prompts": {}, "default_prompt_name": null})");
  EXPECT_TRUE(ReadEmbeddingConfig(dir()).ok());
}

TEST_F(Checkpoint, EachSupportedMode) {
  WriteModules(/*normalize=*/false);
  const std::pair<const char*, Pooling> modes[] = {{"cls_token", Pooling::kCls},
                                                   {"mean_tokens", Pooling::kMean},
                                                   {"max_tokens", Pooling::kMax},
                                                   {"mean_sqrt_len_tokens", Pooling::kMeanSqrtLen}};
  for (const auto& [key, pooling] : modes) {
    WritePooling(key);
    auto config = ReadEmbeddingConfig(dir());
    ASSERT_TRUE(config.ok()) << config.status();
    EXPECT_EQ(config->pooling, pooling) << key;
    EXPECT_FALSE(config->normalize);
    EXPECT_FALSE(config->max_seq_length.has_value());
  }
}

TEST_F(Checkpoint, PoolingModeStringOverridesFlags) {
  WriteModules(false);
  WritePooling("mean_tokens", R"(, "pooling_mode": "CLS")");
  auto config = ReadEmbeddingConfig(dir());
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->pooling, Pooling::kCls);
  WritePooling("mean_tokens", R"(, "pooling_mode": "lasttoken")");
  EXPECT_THAT(ReadEmbeddingConfig(dir()).status().message(), HasSubstr("pooling_mode_lasttoken is not supported"));
  WritePooling("mean_tokens", R"(, "pooling_mode": "median")");
  EXPECT_THAT(ReadEmbeddingConfig(dir()).status().message(), HasSubstr("unknown pooling_mode \"median\""));
}

TEST_F(Checkpoint, WithoutModulesJsonDefaultsToMean) {
  Write("config.json", R"({"model_type": "bert"})");
  auto config = ReadEmbeddingConfig(dir());
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->pooling, Pooling::kMean);
  EXPECT_FALSE(config->normalize);
  EXPECT_FALSE(config->from_files);
  EXPECT_FALSE(config->max_seq_length.has_value());
}

TEST_F(Checkpoint, UnsupportedModesAreNamed) {
  WriteModules(true);
  WritePooling("weightedmean_tokens");
  auto config = ReadEmbeddingConfig(dir());
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(config.status().message(), HasSubstr("pooling_mode_weightedmean_tokens is not supported"));
  EXPECT_THAT(config.status().message(), HasSubstr("1_Pooling/config.json"));
  WritePooling("lasttoken");
  EXPECT_THAT(ReadEmbeddingConfig(dir()).status().message(), HasSubstr("pooling_mode_lasttoken is not supported"));
}

TEST_F(Checkpoint, ExactlyOneModeMustBeOn) {
  WriteModules(false);
  WritePooling("none");
  EXPECT_THAT(ReadEmbeddingConfig(dir()).status().message(), HasSubstr("exactly one"));
  Write("1_Pooling/config.json", R"({"pooling_mode_cls_token": true, "pooling_mode_max_tokens": true})");
  EXPECT_THAT(ReadEmbeddingConfig(dir()).status().message(), HasSubstr("(2 are)"));
  Write("1_Pooling/config.json", R"({"pooling_mode_cls_token": "yes"})");
  EXPECT_THAT(ReadEmbeddingConfig(dir()).status().message(), HasSubstr("pooling_mode_cls_token must be true or false"));
}

TEST_F(Checkpoint, DenseAndOtherModulesAreRefused) {
  WriteModules(true, R"(, {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})");
  WritePooling("mean_tokens");
  auto config = ReadEmbeddingConfig(dir());
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(config.status().message(), HasSubstr("sentence_transformers.models.Dense is not supported"));
}

TEST_F(Checkpoint, MissingPoolingIsAnError) {
  Write("modules.json", R"([{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}])");
  EXPECT_THAT(ReadEmbeddingConfig(dir()).status().message(),
              HasSubstr("lists no sentence_transformers.models.Pooling"));
  WriteModules(false);  // lists 1_Pooling, which is not there
  EXPECT_THAT(ReadEmbeddingConfig(dir()).status().message(), HasSubstr("1_Pooling/config.json is missing"));
}

TEST_F(Checkpoint, MalformedJsonNamesTheFile) {
  Write("modules.json", "[{");
  auto config = ReadEmbeddingConfig(dir());
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(config.status().message(), HasSubstr("modules.json is not valid JSON"));

  WriteModules(false);
  Write("1_Pooling/config.json", "{\"pooling_mode_mean_tokens\": tru");
  EXPECT_THAT(ReadEmbeddingConfig(dir()).status().message(), HasSubstr("1_Pooling/config.json is not valid JSON"));

  WritePooling("mean_tokens");
  Write("sentence_bert_config.json", "{");
  EXPECT_THAT(ReadEmbeddingConfig(dir()).status().message(), HasSubstr("sentence_bert_config.json is not valid JSON"));
  Write("sentence_bert_config.json", R"({"max_seq_length": "long"})");
  EXPECT_THAT(ReadEmbeddingConfig(dir()).status().message(), HasSubstr("max_seq_length must be a positive integer"));
  Write("sentence_bert_config.json", R"({"max_seq_length": 128})");
  Write("modules.json", R"({"0": "Transformer"})");
  EXPECT_THAT(ReadEmbeddingConfig(dir()).status().message(), HasSubstr("is not a JSON list"));
}

// Issue 21: the sentence-transformers files were read by path with no size cap and no regular-file
// check: a FIFO parked the reading thread (the first Embed of the job, holding the assets' lock)
// until a writer came, a sparse gigabyte cost a gigabyte. Now each is refused at once.
TEST_F(Checkpoint, AFifoOrASparseGiantIsRefusedAtOnce) {
  ASSERT_EQ(mkfifo((dir_ / "sentence_bert_config.json").c_str(), 0600), 0);
  EXPECT_THAT(ReadEmbeddingConfig(dir()).status().message(),
              HasSubstr("sentence_bert_config.json is not a regular file"));
  fs::remove(dir_ / "sentence_bert_config.json");
  ASSERT_EQ(mkfifo((dir_ / "modules.json").c_str(), 0600), 0);
  EXPECT_THAT(ReadEmbeddingConfig(dir()).status().message(), HasSubstr("modules.json is not a regular file"));
  fs::remove(dir_ / "modules.json");
  WriteModules(/*normalize=*/false);
  WritePooling("mean_tokens");
  ASSERT_EQ(truncate((dir_ / "1_Pooling" / "config.json").c_str(), int64_t{1} << 30), 0);  // sparse: no disk
  const absl::Status giant = ReadEmbeddingConfig(dir()).status();
  EXPECT_EQ(giant.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(giant.message(), HasSubstr("1_Pooling/config.json is 1073741824 bytes; at most 4194304"));
}

}  // namespace
}  // namespace bertshard::serving
