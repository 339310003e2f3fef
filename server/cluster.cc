#include "server/cluster.h"

#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "grpcpp/grpcpp.h"
#include "planner/planner.h"
#include "planner/token_check.h"
#include "tokenizer/wordpiece.h"

namespace bertshard::server {
namespace {

bool Terminal(v1::JobState s) { return s == v1::FAILED || s == v1::CANCELLED; }

std::string Host(const std::string& address) {
  const size_t colon = address.rfind(':');
  return colon == std::string::npos ? address : address.substr(0, colon);
}

void SetDeadline(grpc::ClientContext* context, absl::Time deadline) {
  context->set_deadline(absl::ToChronoTime(deadline));
}

absl::Status ValidateTokens(const v1::TokenInputs& in, const v1::ShardPlan& plan) {
  return planner::CheckTokens({in.rows(), in.seq(), std::max<int64_t>(1, in.choices()), in.input_ids(),
                               in.attention_mask(), in.token_type_ids()},
                              plan);
}

// When ranks fail together (a dead worker makes its peers' collectives fail too), the cause is
// the worker that no longer answers; otherwise the first failure. Pings need no lock.
std::string Blame(const std::vector<std::pair<std::string, std::shared_ptr<v1::Worker::Stub>>>& ranks,
                  const std::string& first_failure) {
  for (size_t r = 0; r < ranks.size(); ++r) {
    grpc::ClientContext context;
    SetDeadline(&context, absl::Now() + absl::Seconds(2));
    v1::ReservePortResponse ignored;
    grpc::Status status = ranks[r].second->ReservePort(&context, v1::ReservePortRequest(), &ignored);
    if (!status.ok()) {
      return absl::StrCat("worker ", ranks[r].first, " (rank ", r, ") is unreachable: ", status.error_message());
    }
  }
  return first_failure;
}

}  // namespace

struct Cluster::Worker {
  v1::WorkerInfo info;
  std::shared_ptr<v1::Worker::Stub> stub;
  absl::Time last_heartbeat;
};

struct Cluster::JobRuntime {
  v1::ShardPlan plan;
  std::string checkpoint;
  std::vector<std::string> rank_workers;
  std::vector<v1::RankProgress> progress;
  std::vector<std::shared_ptr<grpc::ClientContext>> load_contexts;
  absl::Mutex infer_mu;  // one inference at a time: every rank must see the same order
  int64_t next_sequence ABSL_GUARDED_BY(infer_mu) = 0;
  std::unique_ptr<tokenizer::WordPieceTokenizer> tokenizer ABSL_GUARDED_BY(infer_mu);
};

Cluster::Cluster(const ClusterOptions& options, std::unique_ptr<jobs::JobStore> store)
    : options_(options),
      store_(std::move(store)),
      incarnation_(absl::StrCat(absl::Hex(absl::ToUnixMillis(absl::Now()) & 0xffffffffff))) {}

absl::StatusOr<std::unique_ptr<Cluster>> Cluster::Create(const ClusterOptions& options) {
  ASSIGN_OR_RETURN(auto store, jobs::JobStore::Open(options.database_path));
  // Jobs that had workers cannot survive a coordinator restart: their workers must load again.
  RETURN_IF_ERROR(store->FailJobsWithWorkers("the coordinator restarted; resubmit the job").status());
  auto cluster = std::unique_ptr<Cluster>(new Cluster(options, std::move(store)));
  ASSIGN_OR_RETURN(std::vector<v1::Job> jobs, cluster->store_->List());
  {
    absl::MutexLock lock(&cluster->mu_);
    for (const v1::Job& job : jobs) {
      if (job.state() != v1::PENDING) continue;
      auto plan = planner::Plan(job.request());
      if (!plan.ok()) {
        (void)cluster->store_->Transition(job.id(), v1::FAILED, std::string(plan.status().message()));
        continue;
      }
      auto runtime = std::make_shared<JobRuntime>();
      runtime->plan = *std::move(plan);
      runtime->checkpoint = job.request().checkpoint();
      cluster->runtimes_[job.id()] = runtime;
    }
  }
  cluster->monitor_ = std::thread([c = cluster.get()] { c->MonitorLoop(); });
  return cluster;
}

Cluster::~Cluster() {
  std::vector<std::thread> threads;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    for (auto& [id, runtime] : runtimes_) {
      for (auto& context : runtime->load_contexts) context->TryCancel();
    }
    threads.swap(threads_);
    changed_.SignalAll();
  }
  monitor_.join();
  for (auto& t : threads) t.join();  // no new ones start once stopping_ is set
}

v1::RegisterWorkerResponse Cluster::RegisterWorker(const v1::RegisterWorkerRequest& request) {
  absl::MutexLock lock(&mu_);
  // A worker registering again from the same address lost touch with us: its old entry (and any
  // job that relied on it) is gone.
  for (auto it = workers_.begin(); it != workers_.end(); ++it) {
    if (it->second->info.address() != request.address()) continue;
    const std::string old_job = it->second->info.job_id();
    const std::string old_id = it->first;
    const int32_t old_rank = it->second->info.rank();
    it->second->info.set_healthy(false);
    if (!old_job.empty()) {
      FailJobLocked(old_job, absl::StrCat("worker ", old_id, " (rank ", old_rank, ") registered again"));
    }
    workers_.erase(old_id);
    break;
  }
  std::string id = request.previous_worker_id();
  // Ids carry this coordinator's incarnation: a worker still heartbeating with an id from before
  // a restart must get NOT_FOUND (and register again), not someone else's entry.
  if (id.empty() || workers_.count(id)) id = absl::StrCat("worker-", ++next_worker_, "-", incarnation_);
  auto worker = std::make_unique<Worker>();
  worker->info.set_worker_id(id);
  worker->info.set_address(request.address());
  worker->info.set_device(request.device().empty() ? "cpu" : request.device());
  worker->info.set_free_memory_bytes(request.free_memory_bytes());
  worker->info.set_healthy(true);
  worker->last_heartbeat = absl::Now();
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(1 << 30);
  args.SetMaxSendMessageSize(1 << 30);
  worker->stub = v1::Worker::NewStub(grpc::CreateCustomChannel(request.address(), grpc::InsecureChannelCredentials(), args));
  workers_[id] = std::move(worker);
  ScheduleLocked();
  v1::RegisterWorkerResponse response;
  response.set_worker_id(id);
  response.set_heartbeat_interval_ms(static_cast<int32_t>(absl::ToInt64Milliseconds(options_.heartbeat_interval)));
  return response;
}

absl::Status Cluster::Heartbeat(const v1::HeartbeatRequest& request) {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(request.worker_id());
  if (it == workers_.end()) {
    return absl::NotFoundError(absl::StrCat("unknown worker ", request.worker_id(), "; register again"));
  }
  it->second->last_heartbeat = absl::Now();
  it->second->info.set_free_memory_bytes(request.free_memory_bytes());
  if (!it->second->info.healthy()) {
    it->second->info.set_healthy(true);  // back after a pause: its old job has already failed
    ScheduleLocked();
  }
  return absl::OkStatus();
}

v1::ListWorkersResponse Cluster::ListWorkers() {
  absl::MutexLock lock(&mu_);
  v1::ListWorkersResponse response;
  for (const auto& [id, w] : workers_) {
    v1::WorkerInfo* info = response.add_workers();
    *info = w->info;
    info->set_last_heartbeat_unix_millis(absl::ToUnixMillis(w->last_heartbeat));
  }
  return response;
}

absl::StatusOr<v1::Job> Cluster::SubmitJob(const v1::SubmitJobRequest& request) {
  if (request.request().checkpoint().empty()) {
    return absl::InvalidArgumentError("SubmitJob needs request.checkpoint: the model directory the workers load");
  }
  ASSIGN_OR_RETURN(v1::ShardPlan plan, planner::Plan(request.request()));
  absl::MutexLock lock(&mu_);
  int idle = 0;
  for (const auto& [id, w] : workers_) idle += (w->info.healthy() && w->info.job_id().empty()) ? 1 : 0;
  if (idle < plan.world_size() && request.fail_if_no_workers()) {
    return absl::FailedPreconditionError(absl::StrCat("the job needs ", plan.world_size(), " healthy idle workers; ",
                                                      idle, " are free"));
  }
  v1::Job job;
  job.set_id(absl::StrCat("job-", absl::ToUnixMillis(absl::Now()), "-", ++next_job_));
  *job.mutable_request() = request.request();
  job.set_pending_reason(absl::StrCat("waiting for ", plan.world_size(), " healthy idle workers"));
  RETURN_IF_ERROR(store_->Create(job));
  auto runtime = std::make_shared<JobRuntime>();
  runtime->plan = std::move(plan);
  runtime->checkpoint = request.request().checkpoint();
  runtimes_[job.id()] = runtime;
  ScheduleLocked();
  changed_.SignalAll();
  return store_->Get(job.id());
}

void Cluster::ScheduleLocked() {
  if (stopping_) return;
  auto jobs = store_->List();
  if (!jobs.ok()) return;
  for (const v1::Job& job : *jobs) {
    if (job.state() != v1::PENDING) continue;
    auto runtime = runtimes_.find(job.id());
    if (runtime == runtimes_.end()) continue;
    const int need = runtime->second->plan.world_size();
    std::vector<Worker*> idle;
    for (auto& [id, w] : workers_) {
      if (w->info.healthy() && w->info.job_id().empty()) idle.push_back(w.get());
    }
    if (static_cast<int>(idle.size()) < need) continue;
    std::vector<v1::RankAssignment> ranks;
    runtime->second->rank_workers.clear();
    runtime->second->progress.clear();
    for (int r = 0; r < need; ++r) {
      idle[static_cast<size_t>(r)]->info.set_job_id(job.id());
      idle[static_cast<size_t>(r)]->info.set_rank(r);
      v1::RankAssignment a;
      a.set_rank(r);
      a.set_worker_id(idle[static_cast<size_t>(r)]->info.worker_id());
      a.set_worker_address(idle[static_cast<size_t>(r)]->info.address());
      ranks.push_back(a);
      runtime->second->rank_workers.push_back(a.worker_id());
      v1::RankProgress p;
      p.set_rank(r);
      p.set_worker_id(a.worker_id());
      runtime->second->progress.push_back(p);
    }
    (void)store_->SetRanks(job.id(), ranks);
    (void)store_->Transition(job.id(), v1::PLANNED, absl::StrCat(need, " workers assigned"));
    threads_.emplace_back([this, id = job.id()] { LoadJob(id); });
  }
  changed_.SignalAll();
}

void Cluster::FailJobLocked(std::string job_id, const std::string& cause, v1::JobState state) {
  auto job = store_->Get(job_id);
  if (!job.ok() || Terminal(job->state())) return;
  (void)store_->Transition(job_id, state, cause);
  auto runtime = runtimes_.find(job_id);
  if (runtime != runtimes_.end()) {
    for (auto& context : runtime->second->load_contexts) context->TryCancel();
  }
  for (auto& [id, w] : workers_) {
    if (w->info.job_id() != job_id) continue;
    w->info.clear_job_id();
    w->info.set_rank(0);
    if (!w->info.healthy() || stopping_) continue;
    // Survivors drop their shard; a dead worker has nothing to drop. Detached: the call owns
    // what it uses (the stub keeps its channel) and ends by its deadline.
    std::thread([stub = w->stub, job_id] {
      grpc::ClientContext context;
      SetDeadline(&context, absl::Now() + absl::Seconds(10));
      v1::UnloadRequest unload;
      unload.set_job_id(job_id);
      v1::UnloadResponse ignored;
      stub->Unload(&context, unload, &ignored);
    }).detach();
  }
  changed_.SignalAll();
  ScheduleLocked();
}

void Cluster::LoadJob(std::string job_id) {
  std::shared_ptr<JobRuntime> runtime;
  std::vector<std::shared_ptr<v1::Worker::Stub>> stubs;
  std::string master_host;
  {
    absl::MutexLock lock(&mu_);
    runtime = runtimes_.at(job_id);
    for (const std::string& w : runtime->rank_workers) stubs.push_back(workers_.at(w)->stub);
    master_host = Host(workers_.at(runtime->rank_workers[0])->info.address());
    (void)store_->Transition(job_id, v1::LOADING, "");
    changed_.SignalAll();
  }
  // Rank 0 hosts the rendezvous on a port its worker finds free.
  v1::ReservePortResponse port;
  {
    grpc::ClientContext context;
    SetDeadline(&context, absl::Now() + absl::Seconds(10));
    grpc::Status status = stubs[0]->ReservePort(&context, v1::ReservePortRequest(), &port);
    if (!status.ok()) {
      absl::MutexLock lock(&mu_);
      FailJobLocked(job_id, absl::StrCat("worker ", runtime->rank_workers[0], " (rank 0): ", status.error_message()));
      return;
    }
  }
  std::vector<std::thread> ranks;
  for (size_t r = 0; r < stubs.size(); ++r) {
    auto context = std::make_shared<grpc::ClientContext>();
    SetDeadline(context.get(), absl::Now() + options_.load_timeout);
    {
      absl::MutexLock lock(&mu_);
      runtime->load_contexts.push_back(context);
    }
    ranks.emplace_back([&, r, context] {
      v1::LoadShardRequest load;
      load.set_job_id(job_id);
      *load.mutable_plan() = runtime->plan;
      load.set_rank(static_cast<int32_t>(r));
      load.set_checkpoint(runtime->checkpoint);
      load.set_master_addr(master_host);
      load.set_master_port(port.port());
      load.set_timeout_seconds(options_.collective_timeout_seconds);
      auto reader = stubs[r]->LoadShard(context.get(), load);
      v1::LoadProgress progress;
      while (reader->Read(&progress)) {
        absl::MutexLock lock(&mu_);
        *runtime->progress[r].mutable_progress() = progress;
        changed_.SignalAll();
      }
      grpc::Status status = reader->Finish();
      if (!status.ok()) {
        std::vector<std::pair<std::string, std::shared_ptr<v1::Worker::Stub>>> all;
        for (size_t i = 0; i < stubs.size(); ++i) all.emplace_back(runtime->rank_workers[i], stubs[i]);
        const std::string cause = status.error_code() == grpc::StatusCode::CANCELLED
                                      ? absl::StrCat("worker ", runtime->rank_workers[r], " (rank ", r, "): cancelled")
                                      : Blame(all, absl::StrCat("worker ", runtime->rank_workers[r], " (rank ", r,
                                                                "): ", status.error_message()));
        absl::MutexLock lock(&mu_);
        FailJobLocked(job_id, cause);
      }
    });
  }
  for (auto& t : ranks) t.join();
  absl::MutexLock lock(&mu_);
  runtime->load_contexts.clear();
  auto job = store_->Get(job_id);
  if (job.ok() && job->state() == v1::LOADING) {
    (void)store_->Transition(job_id, v1::READY, "");
    changed_.SignalAll();
  }
}

void Cluster::MonitorLoop() {
  absl::MutexLock lock(&mu_);
  while (!stopping_) {
    // Checked every quarter interval against 1.5 intervals of silence: a dead worker's jobs fail
    // within two heartbeat intervals of its last heartbeat.
    changed_.WaitWithTimeout(&mu_, options_.heartbeat_interval / 4);
    if (stopping_) break;
    const absl::Time now = absl::Now();
    for (auto& [id, w] : workers_) {
      if (!w->info.healthy() || now - w->last_heartbeat <= options_.heartbeat_interval * 3 / 2) continue;
      w->info.set_healthy(false);
      if (!w->info.job_id().empty()) {
        FailJobLocked(w->info.job_id(), absl::StrCat("worker ", id, " (rank ", w->info.rank(), ") at ",
                                                     w->info.address(), " stopped heartbeating"));
      }
    }
  }
}

absl::StatusOr<v1::Job> Cluster::GetJob(const std::string& id) { return store_->Get(id); }

absl::StatusOr<std::vector<v1::Job>> Cluster::ListJobs() { return store_->List(); }

absl::StatusOr<v1::Job> Cluster::CancelJob(const std::string& id) {
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(v1::Job job, store_->Get(id));
  if (Terminal(job.state())) {
    return absl::FailedPreconditionError(absl::StrCat("job ", id, " is already ", v1::JobState_Name(job.state())));
  }
  FailJobLocked(id, "cancelled by request", v1::CANCELLED);
  return store_->Get(id);
}

v1::JobEvent Cluster::EventLocked(const v1::Job& job) {
  v1::JobEvent event;
  *event.mutable_job() = job;
  auto runtime = runtimes_.find(job.id());
  if (runtime != runtimes_.end()) {
    for (const auto& p : runtime->second->progress) *event.add_ranks() = p;
  }
  return event;
}

absl::Status Cluster::WatchJob(const std::string& id, absl::Time deadline,
                               const std::function<bool(const v1::JobEvent&)>& emit,
                               const std::function<bool()>& cancelled) {
  std::string last;
  while (true) {
    v1::JobEvent event;
    {
      absl::MutexLock lock(&mu_);
      ASSIGN_OR_RETURN(v1::Job job, store_->Get(id));
      event = EventLocked(job);
      std::string now = event.SerializeAsString();
      if (now == last) {
        if (absl::Now() >= deadline) {
          return absl::DeadlineExceededError(absl::StrCat("job ", id, " is still ", v1::JobState_Name(job.state())));
        }
        if (cancelled && cancelled()) return absl::CancelledError("watcher went away");
        changed_.WaitWithDeadline(&mu_, std::min(deadline, absl::Now() + absl::Milliseconds(500)));
        continue;
      }
      last = std::move(now);
    }
    if (!emit(event)) return absl::CancelledError("watcher went away");
    const v1::JobState s = event.job().state();
    if (Terminal(s) || s == v1::READY) return absl::OkStatus();
  }
}

absl::StatusOr<v1::InferResponse> Cluster::Infer(const v1::InferRequest& request, absl::Time deadline,
                                                 const std::function<bool()>& cancelled) {
  std::shared_ptr<JobRuntime> runtime;
  std::vector<std::pair<std::string, std::shared_ptr<v1::Worker::Stub>>> ranks;
  {
    absl::MutexLock lock(&mu_);
    ASSIGN_OR_RETURN(v1::Job job, store_->Get(request.job_id()));
    if (job.state() != v1::READY) {
      return absl::FailedPreconditionError(absl::StrCat("job ", job.id(), " is ", v1::JobState_Name(job.state()),
                                                        "; inference needs READY"));
    }
    runtime = runtimes_.at(job.id());
  }
  v1::InferResponse response;
  absl::MutexLock infer_lock(&runtime->infer_mu);  // queue behind earlier calls on this job
  v1::TokenInputs tokens;
  if (request.has_text()) {
    if (runtime->plan.variant() == v1::BERT_FOR_MULTIPLE_CHOICE) {
      return absl::InvalidArgumentError("text input is not supported for BertForMultipleChoice; send tokens");
    }
    if (request.text().texts_size() == 0) return absl::InvalidArgumentError("text input needs at least one text");
    if (request.text().text_pairs_size() > 0 && request.text().text_pairs_size() != request.text().texts_size()) {
      return absl::InvalidArgumentError("text_pairs needs one entry per text");
    }
    if (runtime->tokenizer == nullptr) {
      ASSIGN_OR_RETURN(tokenizer::TokenizerOptions options, tokenizer::ReadTokenizerConfig(runtime->checkpoint));
      auto tok = tokenizer::WordPieceTokenizer::FromVocabFile(runtime->checkpoint + "/vocab.txt", options);
      if (!tok.ok()) {
        return absl::FailedPreconditionError(absl::StrCat("text input needs the checkpoint's vocab.txt: ", tok.status().message()));
      }
      runtime->tokenizer = *std::move(tok);
    }
    std::vector<tokenizer::Encoding> encodings;
    int64_t longest = 0;
    for (int i = 0; i < request.text().texts_size(); ++i) {
      std::optional<absl::string_view> pair;
      if (request.text().text_pairs_size() > 0) pair = request.text().text_pairs(i);
      ASSIGN_OR_RETURN(tokenizer::Encoding e, runtime->tokenizer->Encode(request.text().texts(i), pair,
                                                                          runtime->plan.config().max_position_embeddings()));
      longest = std::max<int64_t>(longest, static_cast<int64_t>(e.input_ids.size()));
      encodings.push_back(std::move(e));
    }
    // Pad the batch to its longest text; padding is masked out.
    const int tp = std::max(1, runtime->plan.shard_config().tensor_parallel_size());
    if (runtime->plan.shard_config().sp_mode() == v1::SPLIT_GATHER) longest = (longest + tp - 1) / tp * tp;
    if (longest > runtime->plan.config().max_position_embeddings()) {
      return absl::InvalidArgumentError("the padded batch exceeds max_position_embeddings");
    }
    tokens.set_rows(static_cast<int64_t>(encodings.size()));
    tokens.set_seq(longest);
    tokens.set_choices(1);
    for (const auto& e : encodings) {
      for (int64_t i = 0; i < longest; ++i) {
        const bool real = i < static_cast<int64_t>(e.input_ids.size());
        tokens.add_input_ids(real ? e.input_ids[static_cast<size_t>(i)] : runtime->plan.config().pad_token_id());
        tokens.add_token_type_ids(real ? e.token_type_ids[static_cast<size_t>(i)] : 0);
        tokens.add_attention_mask(real ? 1 : 0);
      }
    }
  } else if (request.has_tokens()) {
    tokens = request.tokens();
    if (tokens.attention_mask_size() == 0) tokens.mutable_attention_mask()->Resize(tokens.input_ids_size(), 1);
    if (tokens.token_type_ids_size() == 0) tokens.mutable_token_type_ids()->Resize(tokens.input_ids_size(), 0);
  } else {
    return absl::InvalidArgumentError("infer needs tokens or text");
  }
  RETURN_IF_ERROR(ValidateTokens(tokens, runtime->plan));
  const int64_t batch = tokens.rows() / std::max<int64_t>(1, tokens.choices());
  if (request.micro_batches() < 0 || request.micro_batches() > batch) {
    return absl::InvalidArgumentError(absl::StrCat("micro_batches must be in 0..batch ", batch));
  }
  {
    absl::MutexLock lock(&mu_);
    ASSIGN_OR_RETURN(v1::Job job, store_->Get(request.job_id()));
    if (job.state() != v1::READY) {
      return absl::FailedPreconditionError(absl::StrCat("job ", job.id(), " is ", v1::JobState_Name(job.state())));
    }
    for (const std::string& w : runtime->rank_workers) ranks.emplace_back(w, workers_.at(w)->stub);
  }
  if (cancelled && cancelled()) return absl::CancelledError("the caller went away while the request was queued");
  if (absl::Now() >= deadline) return absl::DeadlineExceededError("the deadline passed while the request was queued");
  const int64_t sequence = runtime->next_sequence++;
  std::vector<v1::ForwardResponse> responses(ranks.size());
  std::vector<grpc::Status> statuses(ranks.size());
  std::vector<std::thread> calls;
  for (size_t r = 0; r < ranks.size(); ++r) {
    calls.emplace_back([&, r] {
      grpc::ClientContext context;
      SetDeadline(&context, deadline);
      v1::ForwardRequest forward;
      forward.set_job_id(request.job_id());
      forward.set_sequence(sequence);
      *forward.mutable_inputs() = tokens;
      forward.set_micro_batches(std::max(1, request.micro_batches()));
      statuses[r] = ranks[r].second->Forward(&context, forward, &responses[r]);
    });
  }
  for (auto& t : calls) t.join();
  for (size_t r = 0; r < ranks.size(); ++r) {
    if (statuses[r].ok()) continue;
    const std::string cause =
        Blame(ranks, absl::StrCat("worker ", ranks[r].first, " (rank ", r, "): ", statuses[r].error_message()));
    absl::MutexLock lock(&mu_);
    FailJobLocked(request.job_id(), cause);
    return absl::UnavailableError(absl::StrCat("inference failed: ", cause));
  }
  for (auto& rr : responses) {
    if (rr.outputs_size() > 0) {
      *response.mutable_outputs() = rr.outputs();
      response.set_forward_seconds(rr.forward_seconds());
    }
  }
  *response.mutable_tokens() = std::move(tokens);
  return response;
}

}  // namespace bertshard::server
