#include "server/job_names.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace bertshard::server {
namespace {

TEST(CheckJobName, AcceptsModelIds) {
  for (const std::string& name :
       std::vector<std::string>{"minilm", "sentence-transformers/all-MiniLM-L6-v2", "bge.small_en:v1.5", "a",
                                std::string(kMaxJobNameLength, 'x')}) {
    SCOPED_TRACE(name);
    EXPECT_TRUE(CheckJobName(name).ok()) << CheckJobName(name);
  }
}

TEST(CheckJobName, RefusesWhatCannotBeAName) {
  for (const std::string& name :
       {std::string(), std::string(kMaxJobNameLength + 1, 'x'), std::string("-lead"), std::string("/abs"),
        std::string("with space"), std::string("quote\""), std::string("nul\0x", 5), std::string("caf\xc3\xa9"),
        std::string("job-17"), std::string("JOB-1")}) {
    SCOPED_TRACE(name);
    const absl::Status status = CheckJobName(name);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_NE(status.message().find("letters, digits"), std::string::npos) << status;
  }
}

}  // namespace
}  // namespace bertshard::server
