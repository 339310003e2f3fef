#include "common/file.h"

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "gtest/gtest.h"

namespace bertshard::common {
namespace {

std::string Dir(const std::string& name) {
  const std::string dir = testing::TempDir() + "/file_test_" + name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

TEST(ReadCheckpointFile, ReadsARegularFileWhole) {
  const std::string path = Dir("regular") + "/config.json";
  std::ofstream(path, std::ios::binary) << "{\"a\": 1}\n";
  const absl::StatusOr<std::string> text = ReadCheckpointFile(path, kMaxCheckpointJsonBytes);
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_EQ(*text, "{\"a\": 1}\n");
}

TEST(ReadCheckpointFile, AMissingFileIsNotFound) {
  const absl::StatusOr<std::string> text = ReadCheckpointFile(Dir("missing") + "/config.json", 100);
  EXPECT_EQ(text.status().code(), absl::StatusCode::kNotFound) << text.status();
}

// A FIFO would park the reading thread until a writer comes: refused at once instead.
TEST(ReadCheckpointFile, AFifoIsRefusedWithoutWaiting) {
  const std::string path = Dir("fifo") + "/config.json";
  ASSERT_EQ(mkfifo(path.c_str(), 0600), 0);
  const absl::StatusOr<std::string> text = ReadCheckpointFile(path, kMaxCheckpointJsonBytes);
  EXPECT_EQ(text.status().code(), absl::StatusCode::kInvalidArgument) << text.status();
  EXPECT_NE(text.status().message().find("not a regular file"), std::string::npos) << text.status();
}

// A link to /dev/zero would be read for ever.
TEST(ReadCheckpointFile, ADeviceIsRefused) {
  const std::string path = Dir("device") + "/vocab.txt";
  std::filesystem::create_symlink("/dev/zero", path);
  const absl::StatusOr<std::string> text = ReadCheckpointFile(path, kMaxVocabBytes);
  EXPECT_EQ(text.status().code(), absl::StatusCode::kInvalidArgument) << text.status();
}

// A sparse file costs no disk but would cost the server its memory: refused by its size.
TEST(ReadCheckpointFile, AFileOverTheCapIsRefusedBySize) {
  const std::string path = Dir("large") + "/config.json";
  std::ofstream(path, std::ios::binary) << "{}";
  ASSERT_EQ(truncate(path.c_str(), int64_t{5} << 20), 0);
  const absl::StatusOr<std::string> text = ReadCheckpointFile(path, kMaxCheckpointJsonBytes);
  EXPECT_EQ(text.status().code(), absl::StatusCode::kInvalidArgument) << text.status();
  EXPECT_NE(text.status().message().find("5242880 bytes; at most 4194304"), std::string::npos) << text.status();
  EXPECT_EQ(ReadCheckpointFile(path, int64_t{8} << 20).value_or("").size(), size_t{5} << 20);  // within a larger cap
}

}  // namespace
}  // namespace bertshard::common
