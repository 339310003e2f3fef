// File: common/free_port.h
// -----------------------------------------------------------------------------
// A TCP port that is free right now, found by binding port 0 and releasing it: for a rendezvous
// that another process hosts a moment later (rank 0's TCPStore). Another process could take the
// port in between; the rendezvous then fails with a clear error rather than hanging.
//
// Thread safety: thread-safe.
#ifndef BERTSHARD_COMMON_FREE_PORT_H_
#define BERTSHARD_COMMON_FREE_PORT_H_

#include "absl/status/statusor.h"

namespace bertshard::common {

// `loopback`: bind 127.0.0.1 (else every interface). UNAVAILABLE if no port can be bound.
absl::StatusOr<int> FindFreePort(bool loopback);

}  // namespace bertshard::common

#endif  // BERTSHARD_COMMON_FREE_PORT_H_
