// File: worker/rendezvous.h
// -----------------------------------------------------------------------------
// The rendezvous every backend (Gloo, NCCL: worker/collectives_backend.h) starts from: rank 0
// hosts the job's store (MASTER_ADDR/MASTER_PORT style), the others connect to
// master_addr:master_port, all with the options' timeout. The store is bertshard's own
// (worker/auth_store.h), not c10d's TCPStore: it listens on rank 0's one address (the worker's
// advertised host; 127.0.0.1 for `shardctl run --local`), and serves only clients that prove they
// know the job's secret, which the coordinator hands every rank over gRPC (LoadShardRequest's
// rendezvous_secret). Keys and values are bounded. What travels through it (Gloo addresses, NCCL
// ids, the shared-memory segment's name and token) is authenticated, not encrypted.
//
// Example:
//   ASSIGN_OR_RETURN(auto store, ConnectStore({.master_addr = "10.0.0.7", .master_port = 29500,
//                                              .rank = 1, .world_size = 4, .secret = secret}));
//   RETURN_IF_ERROR(StoreBarrier(*store, "loaded", 4));
//
// A store is best hosted on port 0 -- the system picks a free port and binds it in one step -- and
// its port then handed to the other ranks (HostStore; WorkerService::ReservePort keeps such stores
// in ReservedStores until their job's rank 0 takes one). A port found free, released and bound
// later could be taken in between by anything else on the host.
//
// Failure model: UNAVAILABLE when a store cannot be hosted or reached in time; PERMISSION_DENIED
// when the secret is refused (or the server cannot prove it); INVALID_ARGUMENT for a secret of the
// wrong size. Store calls throw (worker/auth_store.h's AuthStoreError), as c10d's callers expect.
//
// Thread safety: ConnectStore, HostStore and StoreBarrier share no state; ReservedStores is
// thread-safe.
#ifndef BERTSHARD_WORKER_RENDEZVOUS_H_
#define BERTSHARD_WORKER_RENDEZVOUS_H_

#include <chrono>
#include <map>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "worker/auth_store.h"

namespace bertshard::worker {

// Where and how one rank meets the others of its world: the part every backend shares.
struct RendezvousOptions {
  std::string master_addr = "127.0.0.1";
  int master_port = 0;  // with `store`: the port it serves (the other ranks' master_port)
  int rank = 0;
  int world_size = 1;
  // Rendezvous and every collective give up after this long (no hangs).
  std::chrono::milliseconds timeout{120000};
  // The job's rendezvous secret (16 to 256 bytes): what every rank proves it knows before it reads
  // or writes a key. Unused with `store` (that store was made with it).
  std::string secret;
  // A rendezvous store made beforehand, used instead of hosting one (rank 0) or connecting to
  // master_addr:master_port; its timeout is set to `timeout`. This is how torchrun's agent hosts
  // the store before it starts the ranks: rank 0 is handed a store already bound to a port the
  // system picked (HostStore, ReservedStores), and the others connect to that port -- rather than
  // rank 0 binding a port chosen earlier, which may have been taken meanwhile.
  c10::intrusive_ptr<c10d::Store> store;
};

// options.store, with its timeout set to options.timeout, where there is one; otherwise rank 0
// hosts a store on master_addr:master_port (that address only) and the others connect to it with
// the secret. UNAVAILABLE if the store cannot be hosted (the port is taken) or reached in time;
// PERMISSION_DENIED if the secret is refused.
absl::StatusOr<c10::intrusive_ptr<c10d::Store>> ConnectStore(const RendezvousOptions& options);

// A store for the job whose secret is `secret`, served on `host` only (a name is resolved to its
// first address), on a port the system picks (getPort() says which). For rank 0, through
// RendezvousOptions::store; the other ranks connect to the port. UNAVAILABLE if no port can be
// bound; INVALID_ARGUMENT for a bad secret.
absl::StatusOr<c10::intrusive_ptr<HostedStore>> HostStore(const std::string& host, const std::string& secret,
                                                          std::chrono::milliseconds timeout);

// Returns once all `world_size` ranks have called it with the same `key` (each key once): a
// barrier through the store, the same for every backend and on no device. UNAVAILABLE when the
// store's timeout passes first (a peer is gone).
absl::Status StoreBarrier(c10d::Store& store, const std::string& key, int world_size);

// Stores hosted ahead of their job, by port, on this worker's advertised host: Reserve() hosts one
// with the job's secret, and the job's rank 0 Claim()s it by that port and secret when it joins. One nobody claims
// within `ttl` is closed, so that a reservation whose job never comes (its coordinator died in between) does not hold a
// port and a thread for good.
class ReservedStores {
 public:
  // `host`: the one address the stores listen on (the worker's advertised host).
  ReservedStores(absl::Duration ttl, std::string host);
  ~ReservedStores();  // closes the stores still unclaimed
  ReservedStores(const ReservedStores&) = delete;
  ReservedStores& operator=(const ReservedStores&) = delete;

  // Hosts a store (HostStore) for job `job_id` with its `secret` and returns its port. UNAVAILABLE
  // if it cannot be hosted; INVALID_ARGUMENT for a bad secret.
  absl::StatusOr<int> Reserve(const std::string& job_id, const std::string& secret);
  // The store reserved on `port` for `job_id` (or for no job in particular: reserved with "") with
  // `secret`, handed over to the caller (it is no longer kept here); null if there is none: never
  // reserved here, reserved for another job or load attempt (another secret), claimed already, or
  // expired.
  c10::intrusive_ptr<c10d::Store> Claim(const std::string& job_id, int port, const std::string& secret);

 private:
  struct Reservation {
    c10::intrusive_ptr<c10d::Store> store;
    absl::Time expires;
    std::string job_id;
    std::string secret;
  };
  void ExpireLoop();  // closes expired reservations until the destructor stops it

  const absl::Duration ttl_;
  const std::string host_;
  absl::Mutex mu_;
  absl::CondVar changed_;  // a reservation was added, or stopping_ set
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::map<int, Reservation> reserved_ ABSL_GUARDED_BY(mu_);
  std::thread expirer_;  // last: started once the rest is built
};

}  // namespace bertshard::worker

#endif  // BERTSHARD_WORKER_RENDEZVOUS_H_
