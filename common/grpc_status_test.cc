#include "common/grpc_status.h"

#include "gtest/gtest.h"

namespace bertshard::common {
namespace {

TEST(GrpcStatus, EveryCodeRoundTripsWithMessage) {
  for (int code = 0; code <= 16; ++code) {
    SCOPED_TRACE(code);
    const absl::Status original(static_cast<absl::StatusCode>(code), code == 0 ? "" : "why");
    const grpc::Status wire = ToGrpcStatus(original);
    EXPECT_EQ(static_cast<int>(wire.error_code()), code);
    EXPECT_EQ(FromGrpcStatus(wire), original);
  }
}

TEST(GrpcStatus, UnknownCodeFromPeerBecomesUnknown) {
  // 20: no code today, and inside the enum's range (its values span -1..16, so -32..31 are valid);
  // 99 was undefined behaviour in the test itself (UBSan: "not a valid value for type StatusCode").
  const absl::Status s = FromGrpcStatus(grpc::Status(static_cast<grpc::StatusCode>(20), "new"));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnknown);
  EXPECT_EQ(s.message(), "new");
}

}  // namespace
}  // namespace bertshard::common
