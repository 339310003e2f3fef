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
// do) before anything is queued; a forward that fails on a rank fails the job (ForwardTargets::
// FailJob, with the worker to blame) and every request of its batch gets UNAVAILABLE; an answer
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
  std::shared_ptr<ForwardAbort> abort;  // the job's: ends its forward in flight when it fails elsewhere
};

// What a JobServing needs from the cluster (Cluster implements it).
class ForwardTargets {
 public:
  virtual ~ForwardTargets() = default;
  // The job's ranks for its next forward, numbered: the sequence advances once per call, so a
  // caller that gets a target must send it. FAILED_PRECONDITION when the job no longer serves.
  virtual absl::StatusOr<ForwardTarget> NextForward(const std::string& job_id) = 0;
  // A forward failed on a rank (`cause` names it): the ranks may be out of step, so the job fails.
  virtual void FailJob(const std::string& job_id, const std::string& cause) = 0;
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

  // The job's tokenizer on its own (no forward): `text` as the model would see it, with [CLS] and
  // [SEP] when `add_special_tokens`. FAILED_PRECONDITION when the checkpoint has no usable
  // vocabulary; INVALID_ARGUMENT for text that is not UTF-8.
  absl::StatusOr<std::vector<TokenPiece>> Tokenize(absl::string_view text, bool add_special_tokens) const;
  // Token ids back to text as HF's decode(skip_special_tokens=True) gives it (tokenizer/wordpiece.h).
  // INVALID_ARGUMENT for an id outside the vocabulary; FAILED_PRECONDITION as Tokenize.
  absl::StatusOr<std::string> Decode(const std::vector<int64_t>& ids) const;

  // Fails the waiting requests with UNAVAILABLE(`reason`) and refuses new ones; the forward in
  // flight finishes. Does not block.
  void Close(const std::string& reason);
  // Infer/Embed calls in progress (queue depth).
  int calls() const { return calls_.load(); }

 private:
  // One merged forward on every rank of the job; runs on the queue's thread.
  absl::StatusOr<BatchOutputs> Forward(const v1::TokenInputs& merged, int micro_batches, const v1::ForwardWant& want);

  const std::string job_id_;
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
