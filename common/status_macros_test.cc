#include "common/status_macros.h"

#include "gtest/gtest.h"

namespace bertshard {
namespace {

absl::StatusOr<int> Half(int x) {
  if (x % 2 != 0) return absl::InvalidArgumentError("odd");
  return x / 2;
}

absl::Status CheckEven(int x) { return Half(x).status(); }

absl::StatusOr<int> Quarter(int x) {
  ASSIGN_OR_RETURN(int half, Half(x));
  ASSIGN_OR_RETURN(int quarter, Half(half));
  return quarter;
}

absl::Status Both(int a, int b, int* calls) {
  RETURN_IF_ERROR((++*calls, CheckEven(a)));
  RETURN_IF_ERROR(CheckEven(b));
  return absl::OkStatus();
}

TEST(StatusMacros, AssignOrReturnPropagatesFirstError) {
  EXPECT_EQ(*Quarter(8), 2);
  EXPECT_EQ(Quarter(6).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Quarter(3).status().message(), "odd");
}

TEST(StatusMacros, ReturnIfErrorEvaluatesOnceAndStops) {
  int calls = 0;
  EXPECT_TRUE(Both(2, 4, &calls).ok());
  EXPECT_EQ(calls, 1);
  EXPECT_FALSE(Both(1, 4, &calls).ok());
  EXPECT_EQ(calls, 2);
  EXPECT_FALSE(Both(2, 3, &calls).ok());
}

}  // namespace
}  // namespace bertshard
