// File: server/placement.h
// -----------------------------------------------------------------------------
// Which workers a job's ranks go to, from the devices the workers report. A job's backend decides
// the devices it takes: Gloo runs on CPU workers ("cpu"), NCCL on GPU workers ("cuda:N"), one rank
// per GPU: NCCL refuses two ranks of a communicator on one GPU, and says so only deep inside
// ncclCommInitRank ("Duplicate GPU detected"), after every rank has loaded its shard. Here two
// workers reporting the same GPU of one host count once, and the job waits, saying so, instead
// of failing in NCCL. Pure functions on strings: no gRPC, no CUDA.
//
// Thread safety: stateless functions.
#ifndef BERTSHARD_SERVER_PLACEMENT_H_
#define BERTSHARD_SERVER_PLACEMENT_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace bertshard::server {

// "" (the default) and "gloo" are Gloo; "nccl". Normalised: "gloo" or "nccl". INVALID_ARGUMENT
// otherwise, listing the valid ones.
absl::StatusOr<std::string> NormaliseBackend(absl::string_view backend);

// A worker's reported device: "cpu" (or "", a worker that predates the field) is CPU, "cuda:N"
// GPU N (N >= 0) of its host. INVALID_ARGUMENT otherwise.
absl::Status CheckDevice(absl::string_view device);

// The host part of a worker's "host:port" address ("[v6]:port" too; an address with several
// colons and no brackets is all host, as gRPC reads it): workers on one host share its GPUs. Two
// names of one host are two hosts here.
std::string HostOf(absl::string_view address);

struct IdleWorker {
  std::string worker_id;
  std::string address;
  std::string device;
  std::string gpu_bus_id;  // where reported, what tells GPUs of one host apart (else `device`)
};

struct Placement {
  // Indexes into the idle workers, one per rank in rank order; empty when the job must wait.
  std::vector<size_t> ranks;
  // Why it waits, for the job's pending_reason; names GPUs that several workers report.
  std::string waiting_for;
};

// `need` workers of `idle` (taken in its order) whose devices suit `backend` (normalised): for
// nccl, no two on one GPU of one host (the same bus id where reported, else the same device).
Placement PlaceRanks(absl::string_view backend, int need, const std::vector<IdleWorker>& idle);

}  // namespace bertshard::server

#endif  // BERTSHARD_SERVER_PLACEMENT_H_
