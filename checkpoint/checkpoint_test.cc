#include "checkpoint/checkpoint.h"

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace bertshard::checkpoint {
namespace {

std::string MakeDir(const std::string& name) {
  const std::string dir = std::string(std::getenv("TEST_TMPDIR")) + "/" + name;
  EXPECT_EQ(std::system(("mkdir -p " + dir).c_str()), 0);
  return dir;
}

void ExpectStatus(const absl::Status& status, absl::StatusCode code, const std::string& fragment) {
  EXPECT_EQ(status.code(), code) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), fragment)) << status;
}

TEST(Checkpoint, ReadsShardedIndexAndFollowsAliases) {
  const std::string dir = MakeDir("sharded");
  ASSERT_TRUE(WriteSafetensors(dir + "/part-1.safetensors", {{"a.weight", {2}, {1, 2}}}).ok());
  ASSERT_TRUE(WriteSafetensors(dir + "/part-2.safetensors", {{"b.weight", {1}, {3}}}).ok());
  std::ofstream(dir + "/model.safetensors.index.json")
      << R"({"metadata": {}, "weight_map": {"a.weight": "part-1.safetensors", "b.weight": "part-2.safetensors"}})";
  auto ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  auto b = (*ckpt)->Find("b.weight", {});
  ASSERT_TRUE(b.ok());
  float value = 0;
  ASSERT_TRUE(b->file->ReadSlice(*b->info, {}, &value).ok());
  EXPECT_EQ(value, 3.f);
  EXPECT_EQ((*ckpt)->bytes_read(), 4u);
  auto tied = (*ckpt)->Find("decoder.weight", {"a.weight"});
  ASSERT_TRUE(tied.ok());
  EXPECT_EQ(tied->info->name, "a.weight");
  auto missing = (*ckpt)->Find("c.weight", {"d.weight"});
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(absl::StrContains(missing.status().message(), "c.weight or d.weight")) << missing.status();
}

TEST(Checkpoint, RefusesMissingWeightsBadIndexAndDuplicates) {
  ExpectStatus(Checkpoint::Open(MakeDir("empty")).status(), absl::StatusCode::kNotFound,
               "has neither model.safetensors nor model.safetensors.index.json");
  const std::string bad = MakeDir("bad_index");
  std::ofstream(bad + "/model.safetensors.index.json") << R"({"weight_map": ["x"]})";
  EXPECT_EQ(Checkpoint::Open(bad).status().code(), absl::StatusCode::kInvalidArgument);
  const std::string escape = MakeDir("escape");
  std::ofstream(escape + "/model.safetensors.index.json") << R"({"weight_map": {"x": "../../etc/passwd"}})";
  EXPECT_EQ(Checkpoint::Open(escape).status().code(), absl::StatusCode::kInvalidArgument);
  const std::string dup = MakeDir("dup");
  ASSERT_TRUE(WriteSafetensors(dup + "/p1.safetensors", {{"a", {1}, {1}}}).ok());
  ASSERT_TRUE(WriteSafetensors(dup + "/p2.safetensors", {{"a", {1}, {2}}}).ok());
  std::ofstream(dup + "/model.safetensors.index.json")
      << R"({"weight_map": {"a": "p1.safetensors", "b": "p2.safetensors"}})";
  ExpectStatus(Checkpoint::Open(dup).status(), absl::StatusCode::kInvalidArgument,
               "tensor a is stored in more than one shard");
}

// A shard the index names but the directory lacks (a partial copy): NOT_FOUND naming every
// missing file and the index that names them, before any shard is mapped.
TEST(Checkpoint, RefusesAnIndexNamingMissingShardFiles) {
  const std::string dir = MakeDir("missing_shard");
  ASSERT_TRUE(WriteSafetensors(dir + "/part-1.safetensors", {{"a.weight", {2}, {1, 2}}}).ok());
  std::ofstream(dir + "/model.safetensors.index.json")
      << R"({"weight_map": {"a.weight": "part-1.safetensors", "b.weight": "part-2.safetensors",
                            "c.weight": "part-3.safetensors", "d.weight": "part-2.safetensors"}})";
  ExpectStatus(Checkpoint::Open(dir).status(), absl::StatusCode::kNotFound,
               "checkpoint " + dir +
                   ": model.safetensors.index.json names shard files part-2.safetensors, "
                   "part-3.safetensors, which are missing");
  ASSERT_TRUE(WriteSafetensors(dir + "/part-3.safetensors", {{"c.weight", {1}, {3}}}).ok());
  ExpectStatus(Checkpoint::Open(dir).status(), absl::StatusCode::kNotFound,
               "names shard file part-2.safetensors, which is missing");
  ASSERT_TRUE(WriteSafetensors(dir + "/part-2.safetensors", {{"b.weight", {1}, {2}}, {"d.weight", {1}, {4}}}).ok());
  auto complete = Checkpoint::Open(dir);
  ASSERT_TRUE(complete.ok()) << complete.status();
  EXPECT_TRUE((*complete)->Find("d.weight", {}).ok());
}

// model.safetensors next to an index: the single file is read, as transformers' from_pretrained
// reads it, and the index is not even parsed (here it is malformed and names a missing shard).
TEST(Checkpoint, PrefersModelSafetensorsOverAnIndexBesideIt) {
  const std::string dir = MakeDir("both");
  ASSERT_TRUE(WriteSafetensors(dir + "/model.safetensors", {{"a.weight", {1}, {1}}}).ok());
  ASSERT_TRUE(WriteSafetensors(dir + "/part-1.safetensors", {{"a.weight", {1}, {2}}, {"b.weight", {1}, {3}}}).ok());
  std::ofstream(dir + "/model.safetensors.index.json")
      << R"({"weight_map": {"a.weight": "part-1.safetensors", "b.weight": "part-1.safetensors"}})";
  auto ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  auto a = (*ckpt)->Find("a.weight", {});
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->file->path(), dir + "/model.safetensors");
  float value = 0;
  ASSERT_TRUE(a->file->ReadSlice(*a->info, {}, &value).ok());
  EXPECT_EQ(value, 1.f);
  ExpectStatus((*ckpt)->Find("b.weight", {}).status(), absl::StatusCode::kNotFound, "has no tensor b.weight");

  std::ofstream(dir + "/model.safetensors.index.json") << R"({"weight_map": {"a.weight": "gone.safetensors"}})";
  EXPECT_TRUE(Checkpoint::Open(dir).ok());
  std::ofstream(dir + "/model.safetensors.index.json") << "{not json";
  EXPECT_TRUE(Checkpoint::Open(dir).ok());
  // Without the single file the same directory reads the index, and says what is wrong with it.
  ASSERT_EQ(std::remove((dir + "/model.safetensors").c_str()), 0);
  ExpectStatus(Checkpoint::Open(dir).status(), absl::StatusCode::kInvalidArgument,
               "model.safetensors.index.json is not a safetensors index (needs a weight_map object)");
}

TEST(Checkpoint, RefusesIndexesThatNameNoUsableShard) {
  const std::string dir = MakeDir("bad_names");
  std::ofstream(dir + "/model.safetensors.index.json") << R"({"weight_map": {}})";
  ExpectStatus(Checkpoint::Open(dir).status(), absl::StatusCode::kInvalidArgument,
               "has an empty weight_map: it names no shard file");
  for (const std::string name : {R"("")", R"("..")", R"(".")", R"("sub/x.safetensors")", "7"}) {
    SCOPED_TRACE(name);
    std::ofstream(dir + "/model.safetensors.index.json") << R"({"weight_map": {"x": )" << name << "}}";
    ExpectStatus(Checkpoint::Open(dir).status(), absl::StatusCode::kInvalidArgument,
                 "model.safetensors.index.json: tensor x maps to a bad shard file name");
  }
  // A shard that is there but corrupt is refused by the safetensors reader, naming the file.
  std::ofstream(dir + "/p.safetensors") << "abc";
  std::ofstream(dir + "/model.safetensors.index.json") << R"({"weight_map": {"x": "p.safetensors"}})";
  ExpectStatus(Checkpoint::Open(dir).status(), absl::StatusCode::kInvalidArgument,
               "safetensors file " + dir + "/p.safetensors: file is 3 bytes, shorter than the 8-byte header length");
}

// The value of a one-element tensor found under `name` (and `aliases`), and the name it is stored
// under; NaN and "" when it is not found.
std::pair<float, std::string> FoundValue(const Checkpoint& ckpt, const std::string& name,
                                         const std::vector<std::string>& aliases = {}) {
  auto where = ckpt.Find(name, aliases);
  EXPECT_TRUE(where.ok()) << where.status();
  if (!where.ok()) return {std::nanf(""), ""};
  float value = 0;
  EXPECT_TRUE(where->file->ReadSlice(*where->info, {}, &value).ok());
  return {value, where->info->name};
}

// Checkpoints converted from TensorFlow's BERT name LayerNorm's parameters gamma and beta;
// transformers reads them as weight and bias, and so must Find.
TEST(Checkpoint, FindsLayerNormWeightAndBiasUnderTheirLegacyNames) {
  const std::string dir = MakeDir("legacy_layer_norm");
  ASSERT_TRUE(WriteSafetensors(dir + "/model.safetensors", {{"x.LayerNorm.gamma", {1}, {1}},
                                                            {"x.LayerNorm.beta", {1}, {2}},
                                                            {"tied.LayerNorm.gamma", {1}, {3}},
                                                            {"y.weight", {1}, {4}}})
                  .ok());
  auto ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ(FoundValue(**ckpt, "x.LayerNorm.weight"), std::make_pair(1.f, std::string("x.LayerNorm.gamma")));
  EXPECT_EQ(FoundValue(**ckpt, "x.LayerNorm.bias"), std::make_pair(2.f, std::string("x.LayerNorm.beta")));
  // The legacy name of an alias is tried too.
  EXPECT_EQ(FoundValue(**ckpt, "other.LayerNorm.weight", {"tied.LayerNorm.weight"}),
            std::make_pair(3.f, std::string("tied.LayerNorm.gamma")));
  // Only LayerNorm's parameters have legacy names: a plain weight is not looked for as gamma.
  EXPECT_EQ((*ckpt)->Find("y.LayerNorm.beta", {}).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ((*ckpt)->Find("tied.weight", {}).status().code(), absl::StatusCode::kNotFound);
}

TEST(Checkpoint, PrefersTheModernLayerNormNamesWhenBothAreStored) {
  const std::string dir = MakeDir("both_layer_norm_names");
  ASSERT_TRUE(WriteSafetensors(dir + "/model.safetensors", {{"x.LayerNorm.gamma", {1}, {1}},
                                                            {"x.LayerNorm.weight", {1}, {2}},
                                                            {"x.LayerNorm.beta", {1}, {3}},
                                                            {"x.LayerNorm.bias", {1}, {4}},
                                                            {"a.LayerNorm.gamma", {1}, {5}},
                                                            {"b.LayerNorm.weight", {1}, {6}}})
                  .ok());
  auto ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ(FoundValue(**ckpt, "x.LayerNorm.weight"), std::make_pair(2.f, std::string("x.LayerNorm.weight")));
  EXPECT_EQ(FoundValue(**ckpt, "x.LayerNorm.bias"), std::make_pair(4.f, std::string("x.LayerNorm.bias")));
  // An alias stored under the modern name wins over the name's own legacy one.
  EXPECT_EQ(FoundValue(**ckpt, "a.LayerNorm.weight", {"b.LayerNorm.weight"}),
            std::make_pair(6.f, std::string("b.LayerNorm.weight")));
}

TEST(Checkpoint, NotFoundListsTheLegacyLayerNormNamesTried) {
  const std::string dir = MakeDir("no_layer_norm");
  ASSERT_TRUE(WriteSafetensors(dir + "/model.safetensors", {{"a.weight", {1}, {1}}}).ok());
  auto ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  ExpectStatus((*ckpt)->Find("x.LayerNorm.weight", {"y.LayerNorm.weight"}).status(), absl::StatusCode::kNotFound,
               "has no tensor x.LayerNorm.weight or y.LayerNorm.weight or x.LayerNorm.gamma or y.LayerNorm.gamma");
  ExpectStatus((*ckpt)->Find("x.LayerNorm.bias", {}).status(), absl::StatusCode::kNotFound,
               "has no tensor x.LayerNorm.bias or x.LayerNorm.beta");
}

}  // namespace
}  // namespace bertshard::checkpoint
