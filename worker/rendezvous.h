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

#include <string>

#include "absl/status/statusor.h"
#include "worker/gloo_collectives.h"

namespace bertshard::worker {

// UNAVAILABLE if the store cannot be hosted or reached in time.
absl::StatusOr<c10::intrusive_ptr<c10d::Store>> ConnectStore(const GlooOptions& options);

// Returns once all `world_size` ranks have called it with the same `key` (each key once): a
// barrier through the store, the same for every backend and on no device. UNAVAILABLE when the
// store's timeout passes first (a peer is gone).
absl::Status StoreBarrier(c10d::Store& store, const std::string& key, int world_size);

}  // namespace bertshard::worker

#endif  // BERTSHARD_WORKER_RENDEZVOUS_H_
