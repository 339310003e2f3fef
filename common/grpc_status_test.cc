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
  const absl::Status s = FromGrpcStatus(grpc::Status(static_cast<grpc::StatusCode>(99), "new"));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnknown);
  EXPECT_EQ(s.message(), "new");
}

}  // namespace
}  // namespace bertshard::common
