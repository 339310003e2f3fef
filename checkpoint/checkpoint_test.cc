#include "checkpoint/checkpoint.h"

#include <cstdlib>
#include <fstream>

#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace bertshard::checkpoint {
namespace {

std::string MakeDir(const std::string& name) {
  const std::string dir = std::string(std::getenv("TEST_TMPDIR")) + "/" + name;
  EXPECT_EQ(std::system(("mkdir -p " + dir).c_str()), 0);
  return dir;
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
  EXPECT_EQ(Checkpoint::Open(MakeDir("empty")).status().code(), absl::StatusCode::kNotFound);
  const std::string bad = MakeDir("bad_index");
  std::ofstream(bad + "/model.safetensors.index.json") << R"({"weight_map": ["x"]})";
  EXPECT_EQ(Checkpoint::Open(bad).status().code(), absl::StatusCode::kInvalidArgument);
  const std::string escape = MakeDir("escape");
  std::ofstream(escape + "/model.safetensors.index.json") << R"({"weight_map": {"x": "../../etc/passwd"}})";
  EXPECT_EQ(Checkpoint::Open(escape).status().code(), absl::StatusCode::kInvalidArgument);
  const std::string dup = MakeDir("dup");
  ASSERT_TRUE(WriteSafetensors(dup + "/p1.safetensors", {{"a", {1}, {1}}}).ok());
  ASSERT_TRUE(WriteSafetensors(dup + "/p2.safetensors", {{"a", {1}, {2}}}).ok());
  std::ofstream(dup + "/model.safetensors.index.json") << R"({"weight_map": {"a": "p1.safetensors", "b": "p2.safetensors"}})";
  EXPECT_EQ(Checkpoint::Open(dup).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace bertshard::checkpoint
