// File: server/job_serving.h
// -----------------------------------------------------------------------------
// One served job's request path, the counterpart of text-embeddings-inference's router `Infer`:
// a JobServing holds the job's serving assets (tokenizer, pooling configuration, labels: read
// before the job serves, server/job_assets.h, so no request waits on a file), the preparation of each request's tokens,
// the job's BatchQueue, and the decoding of what comes back. It asks the cluster only for the job's ranks for each
// forward, through ForwardTargets; the forward itself goes to every rank at once (server/rank_fanout.h), and asks the
// last stage for the small results when that is all the caller wants (server/output_decoding.h).
//
// Example:
//   JobServing serving("job-1", plan, LoadJobAssets(plan, *checkpoint_dir), &cluster, options);
//   ASSIGN_OR_RETURN(v1::EmbedResponse response, serving.Embed(request, deadline, cancelled));
//
// Failure model: bad requests are INVALID_ARGUMENT (FAILED_PRECONDITION for what the job cannot
// do) before anything is queued. Each merged forward goes to one of the job's replicas (the one
// ForwardTargets hands out: up to one forward per replica at once, SetConcurrency). A forward that
// fails on a rank (or is cut off because the replica was lost elsewhere) loses that replica
// (ForwardTargets::LoseGroup, with the worker to blame: the scheduler places it again) and is sent
// once more, on another replica or the one that replaces it (inference is idempotent); only when
// that fails too do the batch's requests get UNAVAILABLE. While no replica
// serves, a batch waits for one until shortly before its callers' latest deadline (a tenth of the
// time left, at most a second, so that the answer is UNAVAILABLE saying why, not a bare
// DEADLINE_EXCEEDED), bounded by forward_timeout; callers whose own deadline passes first get
// DEADLINE_EXCEEDED from the batch queue. An answer
// that does not fit the batch (a shape, a row count, a NaN or infinity: CheckForwardResponse)
// gets them INTERNAL naming the worker, and is never served; Close fails the waiting requests.
// Deadlines and cancellation hold per request (see BatchQueue); a request over the bounds
// (InputBounds, from BatchLimits) is INVALID_ARGUMENT before any of it is copied or tokenised,
// and a client over its queued-token share RESOURCE_EXHAUSTED.
//
// Thread safety: thread-safe. The destructor waits for the running forward, so it must not run
// under a lock that ForwardTargets takes, nor on the queue's thread.
#ifndef BERTSHARD_SERVER_JOB_SERVING_H_
#define BERTSHARD_SERVER_JOB_SERVING_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "bertshard/v1/coordinator.pb.h"
#include "server/batch_queue.h"
#include "server/input_preparation.h"
#include "server/job_assets.h"
#include "server/rank_fanout.h"

namespace bertshard::server {

// Where one forward of a job goes.
struct ForwardTarget {
  std::vector<RankStub> ranks;          // in rank order
  int64_t sequence = 0;                 // the forward's number: every rank expects the next one
  std::shared_ptr<ForwardAbort> abort;  // the group's: ends its forward in flight when it is lost elsewhere
  // Which replica of the job, and which placement of it, this is: a loss reported for an earlier
  // one (a forward that failed on a group already replaced) changes nothing.
  int32_t replica = 0;
  int64_t generation = 0;
  // The replica's pipeline stages (its shape's pp_size; a smaller shape may have fewer): a batch
  // that asked for no micro-batches is split into DefaultMicroBatches of them.
  int pipeline_stages = 1;
  // What the replica's workers hold its shards by (ForwardRequest.job_id: replica_keys.h); empty:
  // the job's id.
  std::string shard_key;
};

// The micro-batches a batch of `groups` rows (choice groups, `seq` tokens each, padded) runs as on
// a pipeline of `stages` stages when its requests asked for none: a forward-only pipeline keeps at
// most m / (m + p - 1) of the stages busy, so 4 (p - 1) of them keep 80% busy (PP 2: 4); but each
// micro-batch holds at least kMinMicroBatchTokens tokens, below which its fixed costs (every
// operator's, every transfer's) outweigh the overlap. 1 without a pipeline.
inline constexpr int64_t kMinMicroBatchTokens = 64;
int DefaultMicroBatches(int64_t groups, int64_t seq, int stages);

// What a JobServing needs from the cluster (the Scheduler implements it).
class ForwardTargets {
 public:
  virtual ~ForwardTargets() = default;
  // The ranks of one of the job's replicas for its next forward, numbered: the sequence advances
  // once per call, so a caller that gets a target must send it, and the replica is the caller's
  // until it calls EndForward (one forward at a time per replica). While no replica is free (all
  // busy, or being placed and loaded again), waits for one until `wait_until`, then UNAVAILABLE
  // saying why. FAILED_PRECONDITION when the job no longer serves (it ended).
  virtual absl::StatusOr<ForwardTarget> NextForward(const std::string& job_id, int32_t version,
                                                    absl::Time wait_until) = 0;
  // The forward sent to `replica`'s placement `generation` has ended (whatever its outcome): the
  // replica takes the next one.
  virtual void EndForward(const std::string& job_id, int32_t replica, int64_t generation) = 0;
  // A forward failed on placement `generation` of the job's replica (`cause` names the worker;
  // `unreachable_worker` is the one that does not answer its health check, "" when all do): the
  // ranks may be out of step, so the replica is dropped and placed again (or the job fails, past
  // --max_restarts).
  virtual void LoseGroup(const std::string& job_id, int32_t replica, int64_t generation, const std::string& cause,
                         const std::string& unreachable_worker) = 0;
};

// One token of JobServing::Tokenize: its id, its vocabulary entry (a word piece, "##" and all) and
// whether the tokenizer added it ([CLS], [SEP]).
struct TokenPiece {
  int64_t id = 0;
  std::string text;
  bool special = false;
};

struct JobServingOptions {
  BatchLimits batching;
  BatchObserver batch_observer;  // may be null
  // How long one forward may take on the ranks before the job is failed; the callers' own
  // deadlines end their calls, never the forward (stopping some ranks would desynchronise them).
  absl::Duration forward_timeout = absl::Minutes(10);
  // Which of the job's shapes (Job.version) this request path is for: its forwards go to that
  // shape's replicas only (ForwardTargets::NextForward), so that a live update answers each
  // request wholly with the old shape or the new.
  int32_t version = 0;
};

class JobServing {
 public:
  // `assets` were read from the checkpoint beforehand (a part's error is each request's that needs
  // that part); they are served as they are, never read again.
  JobServing(std::string job_id, v1::ShardPlan plan, std::shared_ptr<const JobAssets> assets, ForwardTargets* targets,
             const JobServingOptions& options);
  JobServing(const JobServing&) = delete;
  JobServing& operator=(const JobServing&) = delete;

  // See Cluster::Infer and Cluster::Embed.
  absl::StatusOr<v1::InferResponse> Infer(const v1::InferRequest& request, absl::Time deadline,
                                          const std::function<bool()>& cancelled, const Caller& caller = {});
  absl::StatusOr<v1::EmbedResponse> Embed(const v1::EmbedRequest& request, absl::Time deadline,
                                          const std::function<bool()>& cancelled, const Caller& caller = {});
  // See Cluster::Rerank: the (query, text) pairs run as one Infer on this path.
  absl::StatusOr<v1::RerankResponse> Rerank(const v1::RerankRequest& request, absl::Time deadline,
                                            const std::function<bool()>& cancelled, const Caller& caller = {});

  // The job's tokenizer on its own (no forward): `text` as the model would see it, with [CLS] and
  // [SEP] when `add_special_tokens`. FAILED_PRECONDITION when the checkpoint has no usable
  // vocabulary; INVALID_ARGUMENT for text that is not UTF-8.
  absl::StatusOr<std::vector<TokenPiece>> Tokenize(absl::string_view text, bool add_special_tokens) const;
  // Token ids back to text as HF's decode(skip_special_tokens=True) gives it (tokenizer/wordpiece.h).
  // INVALID_ARGUMENT for an id outside the vocabulary; FAILED_PRECONDITION as Tokenize.
  absl::StatusOr<std::string> Decode(const std::vector<int64_t>& ids) const;

  // Fails the waiting requests with UNAVAILABLE(`reason`) and refuses new ones; the forwards in
  // flight finish. Does not block.
  void Close(const std::string& reason);
  // Up to `lanes` (>= 1) merged forwards run at once: one per replica that serves
  // (BatchQueue::SetConcurrency). Does not block; safe under the caller's locks.
  void SetConcurrency(int lanes);
  // Infer/Embed calls in progress (queue depth).
  int calls() const { return calls_.load(); }

 private:
  // One merged forward on every rank of the job (sent once more on the next group when its group
  // is lost under it); runs on the queue's thread. `callers_deadline`: the batch's latest.
  absl::StatusOr<BatchOutputs> Forward(const v1::TokenInputs& merged, int micro_batches, absl::Time callers_deadline,
                                       const v1::ForwardWant& want);

  const std::string job_id_;
  const int32_t version_;
  const v1::ShardPlan plan_;
  // Immutable: read without a lock by every request (token ids included), never waiting on I/O.
  const std::shared_ptr<const JobAssets> assets_;
  ForwardTargets* const targets_;
  const absl::Duration forward_timeout_;
  const InputBounds input_bounds_;  // from options.batching
  std::atomic<int> calls_{0};
  BatchQueue queue_;  // last: destroyed first, its thread calls Forward
};

}  // namespace bertshard::server

#endif  // BERTSHARD_SERVER_JOB_SERVING_H_
