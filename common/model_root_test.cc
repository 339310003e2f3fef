// Model-root confinement on real directory trees made per test (symbolic links included): which
// checkpoint directories CheckpointDir::Open takes under a root.
#include "common/model_root.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "common/checkpoint_dir.h"
#include "gtest/gtest.h"

namespace bertshard::common {
namespace {
namespace fs = std::filesystem;

class ModelRootTest : public testing::Test {
 protected:
  void SetUp() override {
    base_ = fs::path(testing::TempDir()) /
            ("model_root_" + std::string(testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(base_);
    fs::create_directories(base_ / "models" / "bert" / "1_Pooling");
    fs::create_directories(base_ / "models-old" / "stolen");
    fs::create_directories(base_ / "elsewhere");
    Write(base_ / "models" / "bert" / "config.json", "{}");
    Write(base_ / "models" / "bert" / "1_Pooling" / "config.json", "{}");
    Write(base_ / "elsewhere" / "secret.txt", "root:x:0:0:root:/root:/bin/bash\n");
    auto root = ModelRoot::Open((base_ / "models").string());
    ASSERT_TRUE(root.ok()) << root.status();
    root_ = *root;
  }
  static void Write(const fs::path& p, const std::string& text) { std::ofstream(p) << text; }
  absl::StatusOr<std::string> Resolve(const std::string& path) {
    absl::StatusOr<std::shared_ptr<const CheckpointDir>> dir = CheckpointDir::Open(root_, path);
    if (!dir.ok()) return dir.status();
    return (*dir)->path();
  }
  // The refusal's message, or "" when `path` resolved.
  std::string Refusal(const std::string& path) {
    auto r = Resolve(path);
    if (r.ok()) return "";
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
    EXPECT_EQ(std::string(r.status().message()).find("root:x"), std::string::npos) << "a file's contents leaked";
    return std::string(r.status().message());
  }

  fs::path base_;
  ModelRoot root_;
};

TEST_F(ModelRootTest, ACheckpointInsideResolvesToItsCanonicalPath) {
  const std::string want = fs::canonical(base_ / "models" / "bert").string();
  EXPECT_EQ(*Resolve("bert"), want);
  EXPECT_EQ(*Resolve("./bert/"), want);
  EXPECT_EQ(*Resolve((base_ / "models" / "bert").string()), want);
  EXPECT_EQ(*Resolve("bert/1_Pooling/.."), want);
}

TEST_F(ModelRootTest, DotDotAndAbsolutePathsOutsideAreRefused) {
  EXPECT_NE(Refusal("../elsewhere").find("outside the model root"), std::string::npos);
  EXPECT_NE(Refusal("bert/../../elsewhere").find("outside the model root"), std::string::npos);
  EXPECT_NE(Refusal((base_ / "elsewhere").string()).find("outside the model root"), std::string::npos);
  EXPECT_NE(Refusal("/etc").find("outside the model root"), std::string::npos);
  // A sibling whose name starts with the root's is not inside it.
  EXPECT_NE(Refusal((base_ / "models-old" / "stolen").string()).find("outside the model root"), std::string::npos);
}

TEST_F(ModelRootTest, ASymlinkedCheckpointDirectoryLeadingOutIsRefused) {
  fs::create_directory_symlink(base_ / "elsewhere", base_ / "models" / "door");
  EXPECT_NE(Refusal("door").find("outside the model root"), std::string::npos);
}

TEST_F(ModelRootTest, AFileInsideThatLinksOutRefusesTheCheckpoint) {
  // The report of the issue: config.json -> /etc/passwd (here: a file with its first line).
  fs::remove(base_ / "models" / "bert" / "config.json");
  fs::create_symlink(base_ / "elsewhere" / "secret.txt", base_ / "models" / "bert" / "config.json");
  const std::string why = Refusal("bert");
  EXPECT_NE(why.find("config.json is a symbolic link that leads outside the model root"), std::string::npos) << why;
  // The same one level down (1_Pooling/config.json is read by the serving path).
  fs::remove(base_ / "models" / "bert" / "config.json");
  Write(base_ / "models" / "bert" / "config.json", "{}");
  fs::remove(base_ / "models" / "bert" / "1_Pooling" / "config.json");
  fs::create_symlink("/etc/passwd", base_ / "models" / "bert" / "1_Pooling" / "config.json");
  EXPECT_NE(Refusal("bert").find("1_Pooling/config.json is a symbolic link that leads outside"), std::string::npos);
}

TEST_F(ModelRootTest, LinksThatStayInsideAreFollowedAndChecked) {
  // A shared file linked from another model under the root is fine...
  fs::create_directories(base_ / "models" / "shared");
  Write(base_ / "models" / "shared" / "vocab.txt", "[PAD]\n");
  fs::create_symlink(base_ / "models" / "shared" / "vocab.txt", base_ / "models" / "bert" / "vocab.txt");
  EXPECT_EQ(Refusal("bert"), "");
  // ...and so is a linked directory, whose contents are checked in turn.
  fs::create_directory_symlink(base_ / "models" / "shared", base_ / "models" / "bert" / "extra");
  EXPECT_EQ(Refusal("bert"), "");
  fs::create_symlink(base_ / "elsewhere" / "secret.txt", base_ / "models" / "shared" / "leak.txt");
  EXPECT_NE(Refusal("bert").find("leak.txt is a symbolic link that leads outside"), std::string::npos);
  // A loop of directory links ends.
  fs::remove(base_ / "models" / "shared" / "leak.txt");
  fs::create_directory_symlink(base_ / "models" / "bert", base_ / "models" / "shared" / "back");
  EXPECT_EQ(Refusal("bert"), "");
}

TEST_F(ModelRootTest, MissingNotADirectoryDanglingAndEmptyAreRefused) {
  EXPECT_NE(Refusal("nothing-here").find("does not exist under the model root"), std::string::npos);
  EXPECT_NE(Refusal("bert/config.json").find("is not a directory"), std::string::npos);
  fs::create_symlink(base_ / "models" / "gone", base_ / "models" / "bert" / "dangling");
  EXPECT_NE(Refusal("bert").find("dangling is a symbolic link to nothing"), std::string::npos);
  EXPECT_NE(Refusal("").find("empty"), std::string::npos);
}

TEST_F(ModelRootTest, AHugeDirectoryIsRefused) {
  fs::create_directories(base_ / "models" / "big");
  for (int i = 0; i <= ModelRoot::kMaxEntries; ++i) Write(base_ / "models" / "big" / std::to_string(i), "");
  EXPECT_NE(Refusal("big").find("more than"), std::string::npos);
}

TEST(ModelRoot, UnconfinedPassesPathsThroughAndABadRootIsRefused) {
  ModelRoot none;
  EXPECT_FALSE(none.confined());
  EXPECT_EQ(none.fd(), -1);
  auto dir = CheckpointDir::Open(none, "../anything");
  ASSERT_TRUE(dir.ok()) << dir.status();
  EXPECT_EQ((*dir)->path(), "../anything");
  EXPECT_EQ((*dir)->ReadSmallFile("config.json", 100).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(ModelRoot::Open("/no/such/dir").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ModelRoot::Open("/etc/passwd").status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace bertshard::common
