// File: common/grpc_status.h
// -----------------------------------------------------------------------------
// absl::Status <-> grpc::Status. The codes match one to one (both follow google.rpc.Code), but
// the two enums are distinct types, so each conversion is an explicit switch with an UNKNOWN
// fallback for codes a newer peer might send.
//
// Thread safety: thread-safe (pure functions).
#ifndef BERTSHARD_COMMON_GRPC_STATUS_H_
#define BERTSHARD_COMMON_GRPC_STATUS_H_

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace bertshard::common {

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace bertshard::common

#endif  // BERTSHARD_COMMON_GRPC_STATUS_H_
