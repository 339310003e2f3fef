// File: worker/rendezvous.h
// -----------------------------------------------------------------------------
// The TCPStore rendezvous every backend starts from: rank 0 hosts the store on
// master_addr:master_port (MASTER_ADDR/MASTER_PORT style), the others connect, all with the
// options' timeout.
//
// Thread safety: thread-safe (no shared state).
#ifndef BERTSHARD_WORKER_RENDEZVOUS_H_
#define BERTSHARD_WORKER_RENDEZVOUS_H_

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "absl/status/statusor.h"
#include "worker/gloo_collectives.h"

namespace bertshard::worker {

// UNAVAILABLE if the store cannot be hosted or reached in time.
absl::StatusOr<c10::intrusive_ptr<c10d::Store>> ConnectStore(const GlooOptions& options);

}  // namespace bertshard::worker

#endif  // BERTSHARD_WORKER_RENDEZVOUS_H_
