// Reading a checkpoint through its directory's descriptor, on real trees made per test: what was
// opened is what is read, whatever is renamed, linked or swapped in afterwards.
#include "common/checkpoint_dir.h"

#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "gtest/gtest.h"

namespace bertshard::common {
namespace {
namespace fs = std::filesystem;

class CheckpointDirTest : public testing::Test {
 protected:
  void SetUp() override {
    base_ = fs::path(testing::TempDir()) /
            ("checkpoint_dir_" + std::string(testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(base_);
    fs::create_directories(base_ / "models" / "bert" / "1_Pooling");
    fs::create_directories(base_ / "elsewhere");
    Write(base_ / "models" / "bert" / "config.json", "{\"inside\": true}");
    Write(base_ / "models" / "bert" / "1_Pooling" / "config.json", "{}");
    Write(base_ / "elsewhere" / "config.json", "root:x:0:0:root:/root:/bin/bash\n");
    root_ = ModelRoot::Open((base_ / "models").string()).value();
  }
  static void Write(const fs::path& p, const std::string& text) { std::ofstream(p) << text; }
  std::shared_ptr<const CheckpointDir> OpenBert() {
    auto dir = CheckpointDir::Open(root_, "bert");
    EXPECT_TRUE(dir.ok()) << dir.status();
    return dir.value_or(nullptr);
  }
  // The refusal's message (INVALID_ARGUMENT expected, no file contents in it), or the text read.
  static std::string Read(const CheckpointDir& dir, const std::string& name, int64_t cap = 1 << 20) {
    auto text = dir.ReadSmallFile(name, cap);
    if (text.ok()) return "read: " + *text;
    EXPECT_EQ(text.status().code(), absl::StatusCode::kInvalidArgument) << text.status();
    EXPECT_EQ(std::string(text.status().message()).find("root:x"), std::string::npos) << "a file's contents leaked";
    return std::string(text.status().message());
  }

  fs::path base_;
  ModelRoot root_;
};

TEST_F(CheckpointDirTest, ReadsFilesBeneathItsDescriptorAfterThePathIsSwappedOut) {
  auto dir = OpenBert();
  ASSERT_NE(dir, nullptr);
  // The directory moves away and a link out of the root takes its name: reads still see the
  // directory that was opened.
  fs::rename(base_ / "models" / "bert", base_ / "models" / "bert-moved");
  fs::create_directory_symlink(base_ / "elsewhere", base_ / "models" / "bert");
  EXPECT_EQ(Read(*dir, "config.json"), "read: {\"inside\": true}");
  EXPECT_EQ(Read(*dir, "1_Pooling/config.json"), "read: {}");
  // Opened again now, the name is refused.
  EXPECT_NE(CheckpointDir::Open(root_, "bert").status().message().find("outside the model root"), std::string::npos);
}

TEST_F(CheckpointDirTest, AFileThatBecomesALinkOutAfterOpenIsRefusedWhenRead) {
  auto dir = OpenBert();
  ASSERT_NE(dir, nullptr);
  fs::remove(base_ / "models" / "bert" / "config.json");
  fs::create_symlink(base_ / "elsewhere" / "config.json", base_ / "models" / "bert" / "config.json");
  EXPECT_NE(Read(*dir, "config.json").find("config.json is a symbolic link that leads outside the model root"),
            std::string::npos);
  // Relative, climbing out through "..": the same.
  fs::remove(base_ / "models" / "bert" / "config.json");
  fs::create_symlink("../../elsewhere/config.json", base_ / "models" / "bert" / "config.json");
  EXPECT_NE(Read(*dir, "config.json").find("leads outside the model root"), std::string::npos);
  // A name that climbs out (a modules.json's Pooling path of "../../elsewhere") never gets there.
  EXPECT_NE(Read(*dir, "../../elsewhere/config.json").find("outside the model root"), std::string::npos);
  EXPECT_NE(Read(*dir, (base_ / "elsewhere" / "config.json").string()).find("named relative"), std::string::npos);
}

// The Hugging Face cache's layout: snapshots/<rev>/config.json -> ../../blobs/<hash>.
TEST_F(CheckpointDirTest, LinksThatStayInsideTheRootAreFollowed) {
  const fs::path repo = base_ / "models" / "models--bert";
  fs::create_directories(repo / "blobs");
  fs::create_directories(repo / "snapshots" / "abc");
  Write(repo / "blobs" / "1234", "{\"cached\": 1}");
  fs::create_symlink("../../blobs/1234", repo / "snapshots" / "abc" / "config.json");
  fs::create_symlink(repo / "blobs" / "1234", repo / "snapshots" / "abc" / "absolute.json");
  auto dir = CheckpointDir::Open(root_, "models--bert/snapshots/abc");
  ASSERT_TRUE(dir.ok()) << dir.status();
  EXPECT_EQ((*dir)->path(), fs::canonical(repo / "snapshots" / "abc").string());
  EXPECT_EQ(Read(**dir, "config.json"), "read: {\"cached\": 1}");
  EXPECT_EQ(Read(**dir, "absolute.json"), "read: {\"cached\": 1}");
}

// A hard link to a file outside the root is that file: refused, at Open and when read.
TEST_F(CheckpointDirTest, HardLinksAreRefusedUnderARoot) {
  auto dir = OpenBert();
  ASSERT_NE(dir, nullptr);
  fs::remove(base_ / "models" / "bert" / "config.json");
  fs::create_hard_link(base_ / "elsewhere" / "config.json", base_ / "models" / "bert" / "config.json");
  EXPECT_NE(Read(*dir, "config.json").find("config.json has 2 hard links"), std::string::npos);
  EXPECT_EQ(dir->OpenForMap("config.json").status().code(), absl::StatusCode::kInvalidArgument);
  const absl::Status refused = CheckpointDir::Open(root_, "bert").status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("config.json has 2 hard links"), std::string::npos) << refused;
  // Without a root the link is read (one user's machine).
  auto unconfined = CheckpointDir::Open(ModelRoot(), (base_ / "models" / "bert").string());
  ASSERT_TRUE(unconfined.ok());
  EXPECT_EQ((*unconfined)->ReadSmallFile("config.json", 1 << 20).status().code(), absl::StatusCode::kOk);
}

// FIFOs, devices, directories and sparse giants, with and without a root: refused at once, never
// waited on or read whole.
TEST_F(CheckpointDirTest, OnlyRegularFilesWithinTheCapAreRead) {
  const fs::path bert = base_ / "models" / "bert";
  ASSERT_EQ(mkfifo((bert / "modules.json").c_str(), 0600), 0);
  Write(bert / "sentence_bert_config.json", "{}");
  ASSERT_EQ(truncate((bert / "sentence_bert_config.json").c_str(), int64_t{1} << 30), 0);  // 1 GiB, sparse
  auto confined = OpenBert();
  ASSERT_NE(confined, nullptr);
  auto unconfined = CheckpointDir::Open(ModelRoot(), bert.string()).value();
  for (const CheckpointDir* dir : {confined.get(), unconfined.get()}) {
    SCOPED_TRACE(dir->confined() ? "confined" : "unconfined");
    EXPECT_NE(Read(*dir, "modules.json").find("not a regular file"), std::string::npos);
    EXPECT_NE(Read(*dir, "sentence_bert_config.json", 4 << 20).find("1073741824 bytes; at most 4194304"),
              std::string::npos);
    EXPECT_EQ(Read(*dir, "config.json"), "read: {\"inside\": true}");
    EXPECT_EQ(dir->ReadSmallFile("absent.json", 100).status().code(), absl::StatusCode::kNotFound);
    EXPECT_EQ(dir->ReadSmallFile("1_Pooling", 100).status().code(), absl::StatusCode::kInvalidArgument);
    auto weights = dir->OpenForMap("sentence_bert_config.json");  // mapped files have no cap
    ASSERT_TRUE(weights.ok()) << weights.status();
    EXPECT_EQ(weights->size, int64_t{1} << 30);
    EXPECT_GE(weights->fd.get(), 0);
  }
  fs::remove(bert / "config.json");
  fs::create_symlink("/dev/zero", bert / "config.json");
  EXPECT_NE(Read(*confined, "config.json").find("leads outside the model root"), std::string::npos);
  EXPECT_NE(Read(*unconfined, "config.json").find("not a regular file"), std::string::npos);
}

TEST_F(CheckpointDirTest, TheRootItselfAndLinkLoopsAndLimits) {
  auto root_dir = CheckpointDir::Open(root_, ".");
  ASSERT_TRUE(root_dir.ok()) << root_dir.status();
  EXPECT_EQ((*root_dir)->path(), root_.root());
  EXPECT_EQ(Read(**root_dir, "bert/config.json"), "read: {\"inside\": true}");
  fs::create_symlink("loop-b", base_ / "models" / "bert" / "loop-a");
  fs::create_symlink("loop-a", base_ / "models" / "bert" / "loop-b");
  EXPECT_NE(CheckpointDir::Open(root_, "bert").status().message().find("too many levels of symbolic links"),
            std::string::npos);
  EXPECT_EQ(ModelRoot::Open(root_.root(), {.max_json_bytes = 0}).status().code(), absl::StatusCode::kInvalidArgument);
  auto small = ModelRoot::Open("", {.max_json_bytes = 7, .max_vocab_bytes = 9});
  ASSERT_TRUE(small.ok());
  EXPECT_EQ(small->limits().max_json_bytes, 7);
  EXPECT_EQ(CheckpointDir::Open(*small, "x").value()->limits().max_vocab_bytes, 9);
}

// Open's check of the tree holds a few descriptors at a time (the parents of what it lists), not
// one per directory found: a wide checkpoint cannot run the server out of descriptors.
TEST_F(CheckpointDirTest, AWideTreeIsCheckedWithFewDescriptors) {
  for (int i = 0; i < 600; ++i) fs::create_directories(base_ / "models" / "bert" / ("d" + std::to_string(i)));
  struct rlimit saved {};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &saved), 0);
  struct rlimit low = saved;
  low.rlim_cur = 128;
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &low), 0);
  const absl::Status opened = CheckpointDir::Open(root_, "bert").status();
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &saved), 0);
  EXPECT_TRUE(opened.ok()) << opened;
}

TEST_F(CheckpointDirTest, ANulInANameNeverClimbsOutOfTheRoot) {
  // "..\0" is three bytes to a string comparison and ".." to the kernel: from the root, it would
  // open the root's parent as if it were a child, and elsewhere/ with it.
  const std::string up("..\0", 3);
  auto escaped = CheckpointDir::Open(root_, up + "/elsewhere");
  EXPECT_EQ(escaped.status().code(), absl::StatusCode::kInvalidArgument) << escaped.status();
  EXPECT_NE(escaped.status().message().find("NUL"), std::string::npos) << escaped.status();
  auto dir = OpenBert();
  ASSERT_NE(dir, nullptr);
  // A name from the checkpoint's own files (modules.json's Pooling path) the same way.
  const std::string read = Read(*dir, up + "/" + up + "/elsewhere/config.json");
  EXPECT_NE(read.find("NUL"), std::string::npos) << read;
  // An absolute path outside the root reads the same whether or not it exists there.
  EXPECT_EQ(CheckpointDir::Open(root_, (base_ / "elsewhere").string()).status().message(),
            "checkpoint " + (base_ / "elsewhere").string() + " is outside the model root");
  EXPECT_EQ(CheckpointDir::Open(root_, (base_ / "nowhere").string()).status().message(),
            "checkpoint " + (base_ / "nowhere").string() + " is outside the model root");
}

}  // namespace
}  // namespace bertshard::common
