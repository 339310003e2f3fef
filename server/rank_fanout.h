// File: server/rank_fanout.h
// -----------------------------------------------------------------------------
// Sending one numbered forward to every rank of a job at once (gRPC's callback API: no thread per
// rank), returning as soon as any rank fails or another thread aborts the job's forwards; and
// naming the worker to blame when ranks fail together.
//
// Example:
//   ForwardOutcome out = ForwardOnAllRanks(ranks, forward, absl::Now() + absl::Minutes(10), &abort);
//   if (out.failed_rank >= 0) cause = Blame(ranks, out.status.error_message());
//   // out.responses: one per rank, in rank order, when every call succeeded
//
// Failure model: a failed call is a value in ForwardOutcome (the first one, with its rank); the
// calls still running are cancelled and finish in the background, owning what they use.
//
// Thread safety: thread-safe. One ForwardAbort serves one job, whose forwards run one at a time.
#ifndef BERTSHARD_SERVER_RANK_FANOUT_H_
#define BERTSHARD_SERVER_RANK_FANOUT_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "bertshard/v1/worker.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace bertshard::server {

// A rank of a job and the worker serving it.
struct RankStub {
  std::string worker_id;
  std::string address;
  std::shared_ptr<v1::Worker::Stub> stub;
  std::string token;  // sent with each call (the workers' bearer token; empty: none)
  // The worker's gRPC health service on the same channel: whether it answers at all.
  std::shared_ptr<grpc::health::v1::Health::Stub> health;
};

struct ForwardOutcome {
  std::vector<v1::ForwardResponse> responses;  // one per rank when every call succeeded
  int failed_rank = -1;                        // the first rank whose call failed; -1 if none
  grpc::Status status;                         // that call's status, or the abort's reason
  bool aborted = false;                        // ended by ForwardAbort::Abort
  // Every rank answered, and at least one (failed_rank, the first) with INVALID_ARGUMENT, the others
  // OK or INVALID_ARGUMENT: the workers refused the request itself before any collective, each
  // taking the forward's number, so the ranks are still in step and the group can serve on.
  bool refused = false;
};

// Lets another thread end a job's forwards early: when the job fails for another reason (a worker
// went silent), its forward in flight would otherwise wait for the surviving ranks' collective
// timeout. One per job; its forwards run one at a time.
class ForwardAbort {
 public:
  // Cancels the forward in flight, if any, and every later one, each ending with `reason`.
  void Abort(const std::string& reason) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  friend ForwardOutcome ForwardOnAllRanks(const std::vector<RankStub>&, const v1::ForwardRequest&, absl::Time,
                                          ForwardAbort*);
  absl::Mutex mu_;  // taken before a fan-out's own lock, never after
  bool aborted_ ABSL_GUARDED_BY(mu_) = false;
  std::string reason_ ABSL_GUARDED_BY(mu_);
  std::function<void(const std::string&)> in_flight_ ABSL_GUARDED_BY(mu_);  // cancels the running one
};

// Calls Forward(`forward`) on every rank in parallel, each with `deadline`. Returns when all have
// answered, at the first failure (a dead worker answers UNAVAILABLE at once), or when `abort`
// (optional) is aborted: the calls still running are then cancelled and finish in the background,
// owning what they use. A refusal (INVALID_ARGUMENT) is not such a failure: the other ranks are
// awaited, up to 5 s, to tell a refusal by all (`refused`) from ranks out of step.
ForwardOutcome ForwardOnAllRanks(const std::vector<RankStub>& ranks, const v1::ForwardRequest& forward,
                                 absl::Time deadline, ForwardAbort* abort = nullptr);

// The first rank whose worker does not answer its gRPC health check (2 s each), and the cause
// naming it ("worker ID (rank R) at ADDR is unreachable: ..."); rank -1 when every worker answers.
struct UnreachableRank {
  int rank = -1;
  std::string cause;
};
UnreachableRank FindUnreachableRank(const std::vector<RankStub>& ranks);

// When ranks fail together (a dead worker makes its peers' collectives fail too), the cause is
// the worker that no longer answers its gRPC health check (FindUnreachableRank); otherwise
// `first_failure`.
std::string Blame(const std::vector<RankStub>& ranks, const std::string& first_failure);

}  // namespace bertshard::server

#endif  // BERTSHARD_SERVER_RANK_FANOUT_H_
