#include "server/job_assets.h"

#include <filesystem>
#include <fstream>

#include "gtest/gtest.h"
#include "planner/planner.h"

namespace bertshard::server {
namespace {

namespace fs = std::filesystem;

v1::ShardPlan Plan(v1::ModelVariant variant) {
  v1::PlanRequest request;
  request.set_variant(variant);
  return planner::Plan(request).value();  // BERT-base's configuration
}

std::shared_ptr<const JobAssets> Load(const v1::ShardPlan& plan, const fs::path& dir) {
  return LoadJobAssets(plan, *common::CheckpointDir::Open(common::ModelRoot(), dir.string()).value());
}

fs::path Checkpoint(const std::string& name, bool with_vocab) {
  const fs::path dir = fs::path(testing::TempDir()) / name;
  fs::create_directories(dir);
  if (with_vocab) std::ofstream(dir / "vocab.txt") << "[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nthe\n";
  std::ofstream(dir / "config.json") << R"({"id2label": {"0": "NEG", "1": "POS"}})";
  return dir;
}

TEST(LoadJobAssets, ReadsTheTokenizerItsIdsAndTheLabels) {
  auto assets = Load(Plan(v1::BERT_MODEL), Checkpoint("full", true));
  ASSERT_NE(assets->tokenizer, nullptr) << assets->tokenizer_status;
  EXPECT_EQ(assets->cls_id, 2);
  EXPECT_EQ(assets->sep_id, 3);
  EXPECT_EQ(assets->pad_id, 0);
  EXPECT_EQ(assets->mask_id, 4);
  ASSERT_TRUE(assets->labels.ok()) << assets->labels.status();
  EXPECT_EQ(assets->labels->names, (std::vector<std::string>{"NEG", "POS"}));
  ASSERT_TRUE(assets->embedding.ok()) << assets->embedding.status();  // BertModel: defaults without modules.json
  EXPECT_FALSE(assets->embedding->from_files);
}

TEST(LoadJobAssets, AMissingVocabularyIsAnErrorOfItsOwn) {
  auto assets = Load(Plan(v1::BERT_FOR_SEQUENCE_CLASSIFICATION), Checkpoint("no_vocab", false));
  EXPECT_EQ(assets->tokenizer, nullptr);
  EXPECT_FALSE(assets->tokenizer_status.ok());
  EXPECT_EQ(assets->mask_id, -1);
  EXPECT_EQ(assets->pad_id, 0);  // the plan's pad_token_id
  EXPECT_TRUE(assets->labels.ok());
  EXPECT_FALSE(assets->embedding.ok());  // not a BertModel: not read
}

TEST(RefusedJobAssets, EveryPartSaysWhy) {
  const absl::Status why = absl::InvalidArgumentError("outside the model root");
  auto assets = RefusedJobAssets(why);
  EXPECT_EQ(assets->tokenizer, nullptr);
  EXPECT_EQ(assets->tokenizer_status, why);
  EXPECT_EQ(assets->embedding.status(), why);
  EXPECT_EQ(assets->labels.status(), why);
}

}  // namespace
}  // namespace bertshard::server
