#include "server/cluster.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "planner/model_config.h"
#include "server/inference.h"
#include "server/shard_loading.h"

namespace bertshard::server {

Cluster::Cluster(const ClusterOptions& options, std::unique_ptr<WorkerPool> pool)
    : options_(options), pool_(std::move(pool)) {}

absl::StatusOr<std::unique_ptr<Cluster>> Cluster::Create(const ClusterOptions& options) {
  ASSIGN_OR_RETURN(auto store, jobs::JobStore::Open(options.database_path));
  // Ids carry this coordinator's incarnation (worker_pool.h).
  auto pool =
      std::make_unique<WorkerPool>(options, absl::StrCat(absl::Hex(absl::ToUnixMillis(absl::Now()) & 0xffffffffff)));
  auto cluster = std::unique_ptr<Cluster>(new Cluster(options, std::move(pool)));
  ASSIGN_OR_RETURN(cluster->scheduler_, Scheduler::Create(options, std::move(store), cluster->pool_.get()));
  return cluster;
}

// Closes every batch queue, then joins the background threads (Scheduler::Stop).
Cluster::~Cluster() {
  if (scheduler_ != nullptr) scheduler_->Stop();
}

void Cluster::Drain() { scheduler_->Drain(); }

v1::RegisterWorkerResponse Cluster::RegisterWorker(const v1::RegisterWorkerRequest& request) {
  return scheduler_->RegisterWorker(request);
}

absl::StatusOr<v1::HeartbeatResponse> Cluster::Heartbeat(const v1::HeartbeatRequest& request) {
  return scheduler_->Heartbeat(request);
}

v1::ListWorkersResponse Cluster::ListWorkers() { return pool_->List(); }

absl::StatusOr<v1::PlanRequest> Cluster::LocalRequest(const v1::PlanRequest& request) const {
  return LocalPlanRequest(options_.model_root, request);
}

absl::StatusOr<v1::Job> Cluster::SubmitJob(const v1::SubmitJobRequest& request, const std::string& client) {
  return scheduler_->SubmitJob(request, client);
}

absl::StatusOr<v1::Job> Cluster::GetJob(const std::string& id) { return scheduler_->GetJob(id); }

absl::StatusOr<std::vector<v1::Job>> Cluster::ListJobs() { return scheduler_->ListJobs(); }

absl::StatusOr<v1::Job> Cluster::CancelJob(const std::string& id) { return scheduler_->CancelJob(id); }

absl::Status Cluster::WatchJob(const std::string& id, absl::Time deadline,
                               const std::function<bool(const v1::JobEvent&)>& emit,
                               const std::function<bool()>& cancelled) {
  return scheduler_->WatchJob(id, deadline, emit, cancelled);
}

std::map<std::string, int> Cluster::InferQueueDepths() {
  std::map<std::string, int> depths;
  scheduler_->ForEachRuntime(
      [&](const std::string& id, JobRuntime& runtime) { depths[id] = runtime.infer_calls.load(); });
  return depths;
}

namespace {

// READY, and not waiting for its ranks after a restart.
absl::Status CheckServing(const v1::Job& job) {
  if (!job.recovering().empty()) {
    return absl::UnavailableError(absl::StrCat("job ", job.id(), " is recovering (", job.recovering(), "); retry"));
  }
  if (job.state() != v1::READY) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", job.id(), " is ", v1::JobState_Name(job.state()), "; inference needs READY"));
  }
  return absl::OkStatus();
}

// Counts a call on a job from its start to its end (the queue-depth gauge).
class CallCount {
 public:
  explicit CallCount(std::atomic<int>* calls) : calls_(calls) { calls_->fetch_add(1); }
  ~CallCount() { calls_->fetch_sub(1); }
  CallCount(const CallCount&) = delete;
  CallCount& operator=(const CallCount&) = delete;

 private:
  std::atomic<int>* const calls_;
};

v1::BatchInfo ToBatchInfo(const BatchResult& result) {
  v1::BatchInfo info;
  info.set_requests(result.batch.requests);
  info.set_rows(result.batch.rows);
  info.set_padded_tokens(result.batch.tokens);
  info.set_queue_seconds(absl::ToDoubleSeconds(result.queued));
  return info;
}

}  // namespace

absl::StatusOr<Cluster::Serving> Cluster::ServingFor(const std::string& job_id) {
  Serving serving;
  RETURN_IF_ERROR(scheduler_->WithServingRuntime(
      job_id, [&](const std::shared_ptr<JobRuntime>& found, const absl::StatusOr<v1::Job>& job) -> absl::Status {
        if (found == nullptr) {
          // Not serving: the stored job says why (unknown, recovering, or its state).
          RETURN_IF_ERROR(job.status());
          RETURN_IF_ERROR(CheckServing(*job));
          return absl::UnavailableError(absl::StrCat("job ", job_id, " is not serving yet; retry"));
        }
        serving.runtime = found;
        JobRuntime& runtime = *serving.runtime;
        if (runtime.batcher == nullptr) {
          BatchPadding padding;
          padding.pad_token_id = runtime.plan.config().pad_token_id();
          if (runtime.plan.shard_config().sp_mode() == v1::SPLIT_GATHER) {
            padding.seq_multiple = std::max(1, runtime.plan.shard_config().tensor_parallel_size());
          }
          padding.max_seq = runtime.plan.config().max_position_embeddings();
          const v1::ModelVariant variant = runtime.plan.variant();
          runtime.batcher = std::make_shared<BatchQueue>(
              options_.batching, padding,
              [this, job_id](const v1::TokenInputs& merged, int micro_batches, absl::Time deadline) {
                return ForwardBatch(job_id, merged, micro_batches, deadline);
              },
              [variant](const std::string& name) { return PerTokenOutput(variant, name); }, options_.batch_observer);
        }
        serving.batcher = runtime.batcher;
        return absl::OkStatus();
      }));
  absl::MutexLock lock(&serving.runtime->assets_mu);
  if (serving.runtime->assets == nullptr) {
    // Resolved again: the directory may have changed since the job was submitted.
    absl::StatusOr<std::string> dir = options_.model_root.Resolve(serving.runtime->checkpoint);
    serving.runtime->assets = dir.ok() ? LoadJobAssets(serving.runtime->plan, *dir) : RefusedJobAssets(dir.status());
  }
  serving.assets = serving.runtime->assets;
  return serving;
}

absl::StatusOr<BatchOutputs> Cluster::ForwardBatch(const std::string& job_id, const v1::TokenInputs& merged,
                                                   int micro_batches, absl::Time /*callers' latest deadline*/) {
  // Not the callers' deadline: a rank call cut short by one fails the job (the ranks' order can no
  // longer be vouched for), and the workers finish the forward anyway. Callers whose deadline passes
  // get DEADLINE_EXCEEDED from the batch queue at once; the forward itself is bounded by the
  // server's own limit (the workers' collectives time out well before it when a peer is gone).
  const absl::Time deadline = absl::Now() + options_.forward_timeout;
  ASSIGN_OR_RETURN(ForwardTarget target, scheduler_->NextForward(job_id));
  const std::vector<RankStub>& ranks = target.ranks;
  v1::ForwardRequest forward;
  forward.set_sequence(target.sequence);
  forward.set_job_id(job_id);
  *forward.mutable_inputs() = merged;
  forward.set_micro_batches(std::max(1, micro_batches));
  ForwardOutcome outcome = ForwardOnAllRanks(ranks, forward, deadline, target.abort.get());
  if (outcome.aborted) {
    // The job failed meanwhile (Scheduler::FailJobLocked says why); nothing more to blame.
    return absl::UnavailableError(absl::StrCat("inference failed: ", outcome.status.error_message()));
  }
  if (outcome.failed_rank >= 0) {
    // The ranks may be out of step now: the job fails at once, and the survivors unload.
    const RankStub& failed = ranks[static_cast<size_t>(outcome.failed_rank)];
    const std::string cause =
        BlameUnreachable(ranks, absl::StrCat("worker ", failed.worker_id, " (rank ", outcome.failed_rank, ") at ",
                                             failed.address, ": forward ", forward.sequence(),
                                             " failed: ", common::FromGrpcStatus(outcome.status).ToString()));
    scheduler_->FailJob(job_id, cause);
    return absl::UnavailableError(absl::StrCat("inference failed: ", cause));
  }
  BatchOutputs out;
  for (auto& rr : outcome.responses) {
    if (rr.outputs_size() > 0) {
      out.outputs.assign(std::make_move_iterator(rr.mutable_outputs()->begin()),
                         std::make_move_iterator(rr.mutable_outputs()->end()));
      out.forward_seconds = rr.forward_seconds();
    }
  }
  return out;
}

absl::StatusOr<v1::InferResponse> Cluster::Infer(const v1::InferRequest& request, absl::Time deadline,
                                                 const std::function<bool()>& cancelled) {
  ASSIGN_OR_RETURN(Serving serving, ServingFor(request.job_id()));
  CallCount count(&serving.runtime->infer_calls);
  const v1::ShardPlan& plan = serving.runtime->plan;
  if (request.top_k() < 0) return absl::InvalidArgumentError(absl::StrCat("top_k must be >= 0, got ", request.top_k()));
  ASSIGN_OR_RETURN(
      PreparedInput input,
      PrepareInput(request.has_tokens() ? &request.tokens() : nullptr, request.has_text() ? &request.text() : nullptr,
                   plan, *serving.assets, plan.config().max_position_embeddings(), request.truncate()));
  const int64_t batch = input.tokens.rows() / std::max<int64_t>(1, input.tokens.choices());
  if (request.micro_batches() < 0 || request.micro_batches() > batch) {
    return absl::InvalidArgumentError(absl::StrCat("micro_batches must be in 0..batch ", batch));
  }
  ASSIGN_OR_RETURN(BatchResult result,
                   serving.batcher->Submit(input.tokens, deadline, cancelled, request.micro_batches()));
  v1::InferResponse response;
  for (auto& t : result.outputs) *response.add_outputs() = std::move(t);
  ASSIGN_OR_RETURN(std::vector<v1::Prediction> predictions,
                   Predict(plan, *serving.assets, input.tokens, response.outputs(), request.top_k()));
  for (auto& p : predictions) *response.add_predictions() = std::move(p);
  response.set_forward_seconds(result.forward_seconds);
  *response.mutable_batch() = ToBatchInfo(result);
  for (bool t : input.truncated) response.add_truncated(t);
  *response.mutable_tokens() = std::move(input.tokens);
  return response;
}

absl::StatusOr<v1::EmbedResponse> Cluster::Embed(const v1::EmbedRequest& request, absl::Time deadline,
                                                 const std::function<bool()>& cancelled) {
  ASSIGN_OR_RETURN(Serving serving, ServingFor(request.job_id()));
  CallCount count(&serving.runtime->infer_calls);
  const v1::ShardPlan& plan = serving.runtime->plan;
  if (plan.variant() != v1::BERT_MODEL) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", request.job_id(), " runs ", planner::HfClassName(plan.variant()),
                     ", whose outputs are the head's, not the encoder's hidden states; Embed needs a BertModel job"));
  }
  if (!serving.assets->embedding.ok()) {
    return absl::FailedPreconditionError(absl::StrCat("the checkpoint's sentence-transformers configuration: ",
                                                      serving.assets->embedding.status().message()));
  }
  const serving::EmbeddingConfig& config = *serving.assets->embedding;
  // sentence-transformers truncates at max_seq_length (the length the model was trained for); the
  // position table bounds the rest.
  const int64_t max_length = std::min(config.max_seq_length.value_or(plan.config().max_position_embeddings()),
                                      plan.config().max_position_embeddings());
  ASSIGN_OR_RETURN(const EmbeddingMode mode, ResolveEmbeddingMode(request, config));
  ASSIGN_OR_RETURN(PreparedInput input, PrepareInput(request.has_tokens() ? &request.tokens() : nullptr,
                                                     request.has_text() ? &request.text() : nullptr, plan,
                                                     *serving.assets, max_length, request.truncate()));
  if (request.has_tokens() && input.tokens.seq() > max_length) {
    // Token rows are the caller's own; the embedding model's limit still holds for them.
    for (int32_t n : input.token_counts) {
      if (n > max_length) {
        return absl::InvalidArgumentError(absl::StrCat("a token row has ", n,
                                                       " tokens; the embedding model takes at most ", max_length,
                                                       " (sentence_bert_config.json max_seq_length)"));
      }
    }
  }
  ASSIGN_OR_RETURN(BatchResult result, serving.batcher->Submit(input.tokens, deadline, cancelled));
  v1::EmbedResponse response;
  google::protobuf::RepeatedPtrField<v1::NamedTensor> outputs;
  for (auto& t : result.outputs) *outputs.Add() = std::move(t);
  RETURN_IF_ERROR(PoolEmbeddings(mode, input.tokens, outputs, &response));
  response.set_max_length(static_cast<int32_t>(max_length));
  for (int32_t n : input.token_counts) response.add_token_counts(n);
  for (bool t : input.truncated) response.add_truncated(t);
  *response.mutable_batch() = ToBatchInfo(result);
  return response;
}

}  // namespace bertshard::server
