// File: server/batch_queue.h
// -----------------------------------------------------------------------------
// Dynamic batching in front of one job's forward (as HuggingFace text-embeddings-inference or
// Triton's dynamic batcher do): concurrent requests are merged into one padded forward, and each
// caller gets back exactly its own rows. A queue runs its batches on lanes, one at a time per lane:
// one lane by default (every rank of a job must see forwards in one order), or as many as
// SetConcurrency says for a job with several replicas (each a group of ranks with its own forward
// order: the caller's RunBatchFn leases a free replica for each batch, so the queue only bounds how
// many run at once). While every lane is busy, new requests queue, and a lane takes what has
// queued as soon as it is free (continuous batching): a batch is formed only once a lane is free,
// so it is as large as what queued meanwhile. No gRPC service and no LibTorch here: the forward
// itself is the caller's RunBatchFn.
//
// Forming a batch: requests come from callers (Submit's Caller: a client, which the coordinator
// takes from a TLS certificate's name or else the peer's host, see ClientOf in
// server/coordinator_server.cc, and the client's connection), and they take turns, in two levels:
// the next batch is headed by the oldest waiting request of the connection served least recently
// of the client served least recently (round-robin; ties go to the older request; a batch serves
// its callers when it is dispatched, whichever lane runs it). So one client's flood delays another
// client's request by one dispatched forward at most, however many connections it opens, and one connection's flood
// delays another connection's of the same client (another process on the same host) likewise; nothing starves. Then the
// other waiting requests the head can merge with, from anyone, closest in length to it first (less padding), while the
// merged batch stays within BatchLimits. Waiting tokens are bounded per connection and per client
// (BatchLimits::max_client_queued_tokens: RESOURCE_EXHAUSTED past either), so a caller that floods
// or stops reading holds a bounded part of the queue's memory. Requests merge only with the same
// `choices` and without micro-batching; requests with micro_batches > 1 run alone. Requests whose
// caller went away or whose deadline passed before their batch was dispatched are never sent.
// When to dispatch it: at once, unless BatchLimits::max_batch_delay or ::regroup_delay asks to wait
// (the latter for the callers the last forward to end just answered to come back).
//
// Merging pads every request's rows to the batch's longest sequence (input_ids with the pad
// token, attention_mask and token_type_ids with 0), rounded up per BatchPadding, and stacks the
// rows in request order. Splitting gives each request its rows of every output (dim 0 is rows, or
// rows / choices for multiple-choice logits) and, for per-token outputs (sequence axis at dim 1),
// cuts the padding back off: values bit for bit as the merged forward produced them. A batch of
// one request runs that request's tokens as they are and returns the outputs untouched.
//
// What each request wants back (a v1::ForwardWant: raw outputs, pooled embeddings, masked LM
// top-k, answer spans) goes with it. Requests merge only when their wants are compatible: the same
// embedding pooling, masked LM (but for top_k) and answer-span settings; the merged forward asks
// for the union (every raw output any of them wants, the largest top_k), and each request gets
// back exactly what it alone asked for: its rows of the per-row results (ForwardRow), only its
// raw outputs, its own top_k (a prefix of the larger one: MaskedLmTopK's order is total). The
// per-row results of a padded row are those of the unpadded row: they only read attended positions.
//
// Example:
//   BatchQueue queue(limits, {.pad_token_id = 0}, run_on_all_ranks,
//                    [](const std::string& name) { return name == "last_hidden_state"; });
//   ASSIGN_OR_RETURN(BatchResult r, queue.Submit(std::move(tokens), deadline, cancelled));
//   // r.outputs: this request's rows only; r.batch says what it was merged into.
//
// Thread safety: thread-safe. RunBatchFn, PerTokenFn and BatchObserver run on the queue's lane
// threads: with SetConcurrency(n > 1), up to n of each at once on different threads (never two
// for one batch), so they must be thread-safe then; with one lane, one at a time as before.
// `cancelled` (see Submit) may run on a lane thread too.
#ifndef BERTSHARD_SERVER_BATCH_QUEUE_H_
#define BERTSHARD_SERVER_BATCH_QUEUE_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "bertshard/v1/worker.pb.h"

namespace bertshard::server {

// Bounds on one merged forward (values below 1 count as 1).
struct BatchLimits {
  int64_t max_batch_tokens = 16384;  // rows x padded seq of the merged batch
  int max_batch_requests = 32;       // requests merged into one forward
  // How long the first request of a batch may wait for more to merge with; the wait ends early
  // once the batch is full. Zero: a lone request runs at once (no added latency). A batch is formed
  // (and waits) only while a lane is free; time waited for a lane counts towards it.
  absl::Duration max_batch_delay = absl::ZeroDuration();
  // Regrouping closed-loop callers: after a forward that answered k requests, the next batch is
  // dispatched once k requests have been submitted since that forward ended, or the batch is full,
  // or this long after the forward ended, whichever comes first (max_batch_delay still applies on
  // top). Without it, callers that send again as soon as they are answered split into cohorts
  // that alternate: those answered come back just after the thread started the batch that queued
  // meanwhile, and wait all of it (with 16 such callers, two forwards of ~8 instead of one of 16).
  // Cost: at most this much added to a batch, and only when the previous batch's callers have not
  // all come back; a lone caller's own next request ends the wait, and a request arriving later
  // than this after the last forward ended runs at once. Zero: no regrouping.
  // With several lanes (SetConcurrency), "that forward" is the last forward to end on any lane,
  // and a later end while a batch waits restarts the wait for its own callers: a lane frees when
  // its forward ends, so the callers that forward just answered are the ones that can come back
  // now; those of forwards still running cannot come back before those end, so waiting for them
  // would only keep the free lane idle, and summing the callers of every forward that ended
  // would pull all the cohorts into one batch on one lane and leave the others idle. With one
  // lane this is the rule above exactly.
  absl::Duration regroup_delay = absl::Milliseconds(5);

  // Not bounds on a forward but on what one caller may ask for at once:
  // The tokens (rows x seq) of one connection's requests waiting in one job's queue (not yet in a
  // forward), and 4 times as many for all of one client's connections; a request that would pass
  // either is refused RESOURCE_EXHAUSTED. 0: 4 x max_batch_tokens; never below max_batch_tokens (a
  // request that fits a batch always fits an empty share).
  int64_t max_client_queued_tokens = 0;
  // The bytes of one request's texts and text pairs together, refused before tokenising (checked
  // by JobServing, server/input_preparation.h). 0: no cap.
  int64_t max_request_text_bytes = 32 << 20;
};

// How merged rows are padded; the caller derives it from the plan.
struct BatchPadding {
  int64_t pad_token_id = 0;  // the model config's pad_token_id
  // The padded seq of a merged batch is rounded up to a multiple of this (split_gather sequence
  // parallelism needs seq divisible by the TP size) unless that would pass max_seq.
  int64_t seq_multiple = 1;
  int64_t max_seq = 0;  // max_position_embeddings; 0: no cap
};

// What one merged forward returned: HF-named outputs for all of its rows.
struct BatchOutputs {
  std::vector<v1::NamedTensor> outputs;
  std::vector<v1::ForwardRow> rows;  // per input row, when the want asked for per-row results
  double forward_seconds = 0;
  int64_t response_bytes = 0;  // what the forward's answers took on the network
};

// Runs one merged forward (the caller numbers it and sends it to every rank of a replica). `micro_batches`
// (>= 1) is what a request that runs alone asked for, 1 for a merged batch; `deadline` is the
// latest deadline among the batch's requests; `want` the union of the requests' wants.
// Called on a lane thread: with BatchQueue::SetConcurrency(n), up to n calls run at once on
// different threads (one per batch), so it must be thread-safe and keep each replica's forwards in
// its own order itself (e.g. lease a free replica for the call); with one lane, never two at once.
using RunBatchFn = std::function<absl::StatusOr<BatchOutputs>(const v1::TokenInputs& merged, int micro_batches,
                                                              absl::Time deadline, const v1::ForwardWant& want)>;
// Whether an output has a sequence axis at dim 1 (last_hidden_state, token logits, start/end
// logits), decided by the caller from the model variant. Null: no output does.
using PerTokenFn = std::function<bool(const std::string& output_name)>;

// One dispatched batch.
struct BatchStats {
  int requests = 0;
  int64_t rows = 0;    // merged rows (batch x choices)
  int64_t seq = 0;     // padded seq
  int64_t tokens = 0;  // rows x seq
};
// Called on the batch's lane thread for every batch dispatched, just before it runs (for metrics);
// with several lanes, concurrently for different batches.
using BatchObserver = std::function<void(const BatchStats&)>;

struct BatchResult {
  std::vector<v1::NamedTensor> outputs;  // this request's rows only, its own seq, the outputs it wants
  std::vector<v1::ForwardRow> rows;      // this request's rows of the per-row results
  double forward_seconds = 0;            // of the merged forward
  int64_t response_bytes = 0;            // of the merged forward
  BatchStats batch;                      // what the request was merged into
  absl::Duration queued;                 // from Submit to the batch's dispatch
};

// Who sent a request, for the batcher's turns and shares: the client (the coordinator's ClientOf:
// a TLS certificate's name, else the peer's host) and its connection (the peer's address and
// port). Empty strings are a client and a connection like any other.
struct Caller {
  std::string client;
  std::string connection;
};

// The want of a caller that wants every output as the model returned it, and nothing else.
v1::ForwardWant EveryOutput();
// Whether requests with these wants may share a forward (see the file comment).
bool CompatibleWants(const v1::ForwardWant& a, const v1::ForwardWant& b);
// What a merged forward asks for: every raw output any of `wants` asks for, the largest top_k.
// `wants` are compatible and not empty.
v1::ForwardWant UnionOfWants(const std::vector<const v1::ForwardWant*>& wants);
// Cuts a result of UnionOfWants(...) down to what `want` (one of those) asked for.
void CutToWant(const v1::ForwardWant& want, BatchResult* result);

class BatchQueue {
 public:
  BatchQueue(BatchLimits limits, BatchPadding padding, RunBatchFn run, PerTokenFn per_token,
             BatchObserver observer = nullptr);
  // Close("job is going away"), then waits for every running batch (on any lane), for the lane
  // threads to end and for every Submit call to return. So it must not run on a lane thread (from
  // RunBatchFn or the observer), nor under a lock that RunBatchFn takes.
  ~BatchQueue();
  BatchQueue(const BatchQueue&) = delete;
  BatchQueue& operator=(const BatchQueue&) = delete;

  // Runs `tokens` (row-major [rows, seq], rows = batch x choices; an empty attention_mask or
  // token_type_ids means ones or zeros) in the next batch that can take it. INVALID_ARGUMENT for
  // malformed tokens or rows x seq over max_batch_tokens (says both numbers and the flag).
  // Blocks until this request's rows come back, the forward fails (its status, for every request
  // of the batch), `deadline` passes (DEADLINE_EXCEEDED; a batch already running goes on for the
  // others), `cancelled` turns true (CANCELLED; checked at least every 20 ms, the batch goes on
  // likewise), or the queue closes while the request waits (UNAVAILABLE).
  // `cancelled` may be null; it must be cheap and thread-safe, and must not call into this
  // queue: a lane thread calls it (with the queue's lock held) right before dispatch.
  // `micro_batches` > 1: the request runs alone, and RunBatchFn gets it (the ranks split the
  // forward into that many micro-batches). `want`: what the request wants back (default: every
  // output as the model returned it).
  // `caller`: who is asking (turns and shares, see the file comment). RESOURCE_EXHAUSTED, at
  // once, when its connection's or client's waiting tokens would pass their share
  // (BatchLimits::max_client_queued_tokens).
  absl::StatusOr<BatchResult> Submit(v1::TokenInputs tokens, absl::Time deadline,
                                     const std::function<bool()>& cancelled = nullptr, int micro_batches = 0,
                                     const v1::ForwardWant& want = EveryOutput(), const Caller& caller = {})
      ABSL_LOCKS_EXCLUDED(mu_);

  // Fails the requests still waiting with UNAVAILABLE(`reason`) and refuses new ones; the batches
  // already running finish. Does not block (safe with the caller's own locks held). Idempotent.
  void Close(const std::string& reason) ABSL_LOCKS_EXCLUDED(mu_);

  // Up to `n` batches dispatched and running at once (values below 1 count as 1; 1, the default,
  // is one at a time), each on its own lane thread: threads are started as needed, up to the
  // largest n seen, and kept. Raising it lets waiting requests form a batch at once; lowering it
  // interrupts no running batch, and no new one is dispatched while n or more run. Does not block
  // and calls nothing of the caller's: callable from any thread, from RunBatchFn or the observer,
  // and with the caller's own locks held.
  //   queue.SetConcurrency(replicas);  // e.g. when a job is scaled
  void SetConcurrency(int n) ABSL_LOCKS_EXCLUDED(mu_);

  // Requests waiting for a batch (not counting those running), for a queue-depth gauge.
  int queued() const ABSL_LOCKS_EXCLUDED(mu_);
  // Batches dispatched and not yet ended (at most the concurrency, but for a lowering while more
  // ran), for a gauge.
  int running() const ABSL_LOCKS_EXCLUDED(mu_);
  // The tokens of `client`'s requests waiting for a batch (all its connections).
  int64_t queued_tokens(const std::string& client) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Request;
  // One connection's waiting requests.
  struct ConnectionQueue {
    std::map<int64_t, Request*> waiting;  // by id: arrival order
    int64_t tokens = 0;                   // rows x seq of `waiting`
    int64_t turn = 0;                     // the batch that last served it: the lowest goes next
  };
  // One client's waiting requests, by connection.
  struct ClientQueue {
    absl::flat_hash_map<std::string, ConnectionQueue> connections;  // those with waiting requests
    int64_t tokens = 0;                                             // of all of them
    int64_t turn = 0;
  };
  // Queues `r` (waiting_, its client's queue) or takes it off, handing back the queue's reference.
  void AddLocked(std::shared_ptr<Request> r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::shared_ptr<Request> RemoveLocked(const Request* r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The request heading the next batch: the oldest of the client whose turn it is. waiting_ is
  // not empty.
  Request* HeadLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // The requests of the next batch: HeadLocked() first. `*full`: the batch cannot take
  // more of what is waiting (a limit was reached, or the oldest runs alone).
  std::vector<Request*> FormBatchLocked(bool* full) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Waits for a free lane and for the next batch, and takes it off the queue (marked running,
  // counted in running_); empty once stopping.
  std::vector<std::shared_ptr<Request>> NextBatch() ABSL_LOCKS_EXCLUDED(mu_);
  // Whether as many requests were submitted since the last forward ended as it answered (always
  // true before the first forward).
  bool RegroupedLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Runs one batch and hands every request its result (and records its end for regroup_delay,
  // and frees its lane).
  void RunBatch(std::vector<std::shared_ptr<Request>> batch) ABSL_LOCKS_EXCLUDED(mu_);
  // One lane thread: NextBatch, RunBatch, until stopping.
  void Loop();
  int64_t PaddedSeq(int64_t longest) const;

  const BatchLimits limits_;
  const int64_t connection_share_;  // waiting tokens, from limits_
  const int64_t client_share_;
  const BatchPadding padding_;
  const RunBatchFn run_;
  const PerTokenFn per_token_;
  const BatchObserver observer_;

  mutable absl::Mutex mu_;
  std::vector<std::shared_ptr<Request>> waiting_ ABSL_GUARDED_BY(mu_);  // arrival order
  // Clients with waiting requests (an entry goes when its last request leaves the queue).
  absl::flat_hash_map<std::string, ClientQueue> clients_ ABSL_GUARDED_BY(mu_);
  int64_t batches_ ABSL_GUARDED_BY(mu_) = 0;  // dispatched so far (the turns' clock)
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  std::string close_reason_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;  // each lane thread exits once its batch is done
  int concurrency_ ABSL_GUARDED_BY(mu_) = 1;    // lanes that may run a batch (SetConcurrency)
  int running_ ABSL_GUARDED_BY(mu_) = 0;        // batches dispatched and not yet ended
  // A free lane's thread is forming the next batch (perhaps waiting for the delays): the other
  // free lanes wait, so that each batch is formed once and takes all that queued before it.
  bool forming_ ABSL_GUARDED_BY(mu_) = false;
  int submits_ ABSL_GUARDED_BY(mu_) = 0;  // Submit calls in progress
  int64_t next_id_ ABSL_GUARDED_BY(mu_) = 0;
  // The last forward to end, on any lane (for regroup_delay): when, how many requests it
  // answered, and next_id_ then (so next_id_ - this is how many were submitted since). 0
  // requests: none yet. `forwards_ended_` counts the ends, so a wait notices one.
  absl::Time last_end_ ABSL_GUARDED_BY(mu_);
  int last_requests_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t ids_at_last_end_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t forwards_ended_ ABSL_GUARDED_BY(mu_) = 0;
  // The lane threads, started by the constructor (one) and SetConcurrency; joined by the
  // destructor.
  std::vector<std::thread> lanes_ ABSL_GUARDED_BY(mu_);
};

}  // namespace bertshard::server

#endif  // BERTSHARD_SERVER_BATCH_QUEUE_H_
