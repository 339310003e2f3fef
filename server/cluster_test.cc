// Cluster after a restart, in process: the job database is written as a stopped coordinator left
// it, and workers register with what they hold (no worker processes; the addresses refuse
// connections, so the Unload calls of failed jobs end at once).
#include "server/cluster.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "common/model_root.h"
#include "gtest/gtest.h"
#include "jobs/job_store.h"
#include "planner/planner.h"

namespace bertshard::server {
namespace {

constexpr int kWorld = 4;

std::string Address(int rank) { return "127.0.0.1:" + std::to_string(9 + rank); }

class ClusterRestart : public ::testing::Test {
 protected:
  // Stores job `id` as a stopped coordinator left it in `state` (PLANNED, LOADING or READY).
  void StoreJob(const std::string& id, v1::JobState state, v1::ModelVariant variant = v1::BERT_FOR_MASKED_LM,
                const std::string& checkpoint = "/models/unused") {
    auto store = jobs::JobStore::Open(path_);
    ASSERT_TRUE(store.ok()) << store.status();
    v1::PlanRequest request;
    request.set_variant(variant);
    request.mutable_parallel()->set_tp_size(2);
    request.mutable_parallel()->set_pp_size(2);
    auto plan = planner::Plan(request);  // BERT-base's configuration: no checkpoint to read
    ASSERT_TRUE(plan.ok()) << plan.status();
    request.set_checkpoint(checkpoint);  // what a submitted job has; "/models/unused" is never there
    v1::Job job;
    job.set_id(id);
    *job.mutable_request() = request;
    ASSERT_TRUE((*store)->Create(job).ok());
    ASSERT_TRUE((*store)->SetPlan(id, *plan).ok());
    std::vector<v1::RankAssignment> ranks;
    for (int r = 0; r < kWorld; ++r) {
      v1::RankAssignment a;
      a.set_rank(r);
      a.set_worker_id("old-worker-" + std::to_string(r));
      a.set_worker_address(Address(r));
      ranks.push_back(a);
    }
    ASSERT_TRUE((*store)->SetRanks(id, ranks).ok());
    for (v1::JobState s : {v1::PLANNED, v1::LOADING, v1::READY}) {
      ASSERT_TRUE((*store)->Transition(id, s, "").ok());
      if (s == state) break;
    }
  }

  void Start(absl::Duration grace = absl::Seconds(30), const common::ModelRoot& root = common::ModelRoot()) {
    ClusterOptions options;
    options.model_root = root;
    options.database_path = path_;
    options.heartbeat_interval = absl::Seconds(2);
    options.readopt_grace = grace;
    // A job its ranks do not come back to is placed again; on these addresses (nothing listens)
    // that load fails, and the next placement then waits out an hour of backoff: the job stays
    // PENDING, recovering, for the test to look at.
    options.restarts.backoff_initial = absl::Hours(1);
    options.restarts.backoff_max = absl::Hours(1);
    options.restarts.max_restarts = max_restarts_;
    auto cluster = Cluster::Create(options);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = *std::move(cluster);
  }

  static v1::HeldShard Held(const std::string& job, int rank, int64_t next_sequence) {
    v1::HeldShard h;
    h.set_job_id(job);
    h.set_rank(rank);
    h.set_world_size(kWorld);
    h.set_next_sequence(next_sequence);
    return h;
  }

  v1::RegisterWorkerResponse Register(int rank, std::vector<v1::HeldShard> held) {
    v1::RegisterWorkerRequest request;
    request.set_address(Address(rank));
    for (auto& h : held) *request.add_held() = std::move(h);
    return cluster_->RegisterWorker(request);
  }

  // Why job `id` went back to PENDING to be placed again (its first "recovering: " history entry);
  // "" when it never did.
  std::string Recovery(const std::string& id) {
    const v1::Job job = Job(id);
    for (const v1::StateChange& change : job.history()) {
      if (change.state() == v1::PENDING && change.reason().rfind("recovering: ", 0) == 0) return change.reason();
    }
    return "";
  }

  v1::Job Job(const std::string& id) {
    auto job = cluster_->GetJob(id);
    EXPECT_TRUE(job.ok()) << job.status();
    return job.ok() ? *job : v1::Job();
  }

  const std::string path_ = std::string(std::getenv("TEST_TMPDIR")) + "/" +
                            ::testing::UnitTest::GetInstance()->current_test_info()->name() + ".db";
  std::unique_ptr<Cluster> cluster_;
  int max_restarts_ = 10;  // --max_restarts of the next Start
};

TEST_F(ClusterRestart, TakesBackAJobWhoseRanksAllReturn) {
  ASSERT_NO_FATAL_FAILURE(StoreJob("job-1", v1::READY));
  ASSERT_NO_FATAL_FAILURE(Start());
  EXPECT_EQ(Job("job-1").state(), v1::READY);
  EXPECT_NE(Job("job-1").recovering(), "");
  std::vector<std::string> ids;
  for (int r = 0; r < kWorld; ++r) {
    v1::RegisterWorkerResponse response = Register(r, {Held("job-1", r, 3)});
    EXPECT_EQ(response.unload_job_ids_size(), 0);
    ids.push_back(response.worker_id());
    if (r == 2) {
      EXPECT_NE(Job("job-1").recovering().find("for rank 3 of 4"), std::string::npos) << Job("job-1").recovering();
      v1::InferRequest infer;
      infer.set_job_id("job-1");
      EXPECT_EQ(cluster_->Infer(infer, absl::Now() + absl::Seconds(5)).status().code(), absl::StatusCode::kUnavailable);
    }
  }
  const v1::Job job = Job("job-1");
  EXPECT_EQ(job.state(), v1::READY);
  EXPECT_EQ(job.recovering(), "");
  ASSERT_EQ(job.ranks_size(), kWorld);
  for (int r = 0; r < kWorld; ++r) EXPECT_EQ(job.ranks(r).worker_id(), ids[static_cast<size_t>(r)]);
  const v1::ListWorkersResponse workers = cluster_->ListWorkers();
  for (const auto& w : workers.workers()) EXPECT_EQ(w.job_id(), "job-1");
  // Another worker claiming a rank that is served already drops it.
  v1::RegisterWorkerRequest stray;
  stray.set_address("127.0.0.1:20");
  *stray.add_held() = Held("job-1", 0, 3);
  v1::RegisterWorkerResponse told = cluster_->RegisterWorker(stray);
  ASSERT_EQ(told.unload_job_ids_size(), 1);
  EXPECT_EQ(told.unload_job_ids(0), "job-1");
}

// Issue 21: the serving assets re-checked the checkpoint directory at the first Embed and kept the
// refusal, so a READY job whose directory changed meanwhile (the race flipped model.safetensors to
// a link leading out) answered every Embed FAILED_PRECONDITION for good. The assets are read when
// the job is taken back (or submitted), through the directory's descriptors, and served as read.
TEST_F(ClusterRestart, AReadyJobKeepsItsAssetsWhateverHappensToItsDirectoryLater) {
  namespace fs = std::filesystem;
  const fs::path base = fs::path(std::getenv("TEST_TMPDIR")) / "cluster_assets_kept";
  fs::remove_all(base);
  fs::create_directories(base / "models" / "bert");
  fs::create_directories(base / "outside");
  std::ofstream(base / "models" / "bert" / "config.json") << R"({"architectures": ["BertModel"]})";
  std::ofstream(base / "models" / "bert" / "modules.json")
      << R"([{"type": "sentence_transformers.models.Pooling", "path": "1_Pooling"}])";
  fs::create_directories(base / "models" / "bert" / "1_Pooling");
  std::ofstream(base / "models" / "bert" / "1_Pooling" / "config.json") << R"({"pooling_mode_cls_token": true})";
  std::ofstream(base / "outside" / "model.safetensors") << "not these weights";
  ASSERT_NO_FATAL_FAILURE(StoreJob("job-1", v1::READY, v1::BERT_MODEL, "bert"));
  ASSERT_NO_FATAL_FAILURE(Start(absl::Seconds(30), common::ModelRoot::Open((base / "models").string()).value()));
  for (int r = 0; r < kWorld; ++r) Register(r, {Held("job-1", r, 3)});
  ASSERT_EQ(Job("job-1").state(), v1::READY);
  // Now the directory holds a link out of the root, as the race leaves it half the time.
  fs::create_symlink(base / "outside" / "model.safetensors", base / "models" / "bert" / "model.safetensors");
  v1::EmbedRequest embed;
  embed.set_job_id("job-1");
  v1::TokenInputs* tokens = embed.mutable_tokens();
  tokens->set_rows(1);
  tokens->set_seq(3);
  for (int64_t id : {101, 7592, 102}) tokens->add_input_ids(id);
  // The assets hold: the request gets as far as the ranks (which this test does not run, so the
  // forward is UNAVAILABLE), not turned away for the checkpoint's configuration.
  const absl::Status served = cluster_->Embed(embed, absl::Now() + absl::Seconds(3)).status();
  EXPECT_EQ(served.code(), absl::StatusCode::kUnavailable) << served;
  EXPECT_EQ(served.message().find("sentence-transformers"), std::string::npos) << served;
}

// Not a restart: a worker that lost touch and registers again keeps its job if it holds its rank.
TEST_F(ClusterRestart, KeepsAJobWhoseWorkerRegistersAgainHoldingItsRank) {
  ASSERT_NO_FATAL_FAILURE(StoreJob("job-1", v1::READY));
  ASSERT_NO_FATAL_FAILURE(Start());
  for (int r = 0; r < kWorld; ++r) Register(r, {Held("job-1", r, 0)});
  ASSERT_EQ(Job("job-1").recovering(), "");
  v1::RegisterWorkerResponse again = Register(1, {Held("job-1", 1, 0)});
  EXPECT_EQ(again.unload_job_ids_size(), 0);
  v1::Job job = Job("job-1");
  EXPECT_EQ(job.state(), v1::READY);
  EXPECT_EQ(job.ranks(1).worker_id(), again.worker_id());
  Register(2, {});  // this one lost its shard (the process restarted): the group is lost
  job = Job("job-1");
  EXPECT_NE(job.state(), v1::FAILED);
  EXPECT_NE(Recovery("job-1").find("(rank 2) at 127.0.0.1:11 registered again without its shard"), std::string::npos)
      << job.DebugString();
}

// Taking a job back fails (here the ranks disagree on the next forward): it is placed and loaded
// again instead of FAILED (issue 22, item 5), and the ranks that came back are let go.
TEST_F(ClusterRestart, PlacesAgainAJobWhoseRanksDisagree) {
  ASSERT_NO_FATAL_FAILURE(StoreJob("job-1", v1::READY));
  ASSERT_NO_FATAL_FAILURE(Start());
  for (int r = 0; r < 3; ++r) Register(r, {Held("job-1", r, 3)});
  Register(3, {Held("job-1", 3, 2)});
  const v1::Job job = Job("job-1");
  EXPECT_NE(job.state(), v1::FAILED);
  EXPECT_EQ(job.recovering(), "");
  EXPECT_NE(Recovery("job-1").find("disagree on the next forward"), std::string::npos) << job.DebugString();
  EXPECT_GE(job.restarts(), 1);
}

TEST_F(ClusterRestart, PlacesALoadingJobAgainAtOnceWhenAWorkerCameBackWithoutItsRank) {
  ASSERT_NO_FATAL_FAILURE(StoreJob("job-1", v1::LOADING));
  ASSERT_NO_FATAL_FAILURE(Start());
  Register(0, {Held("job-1", 0, 0)});
  EXPECT_EQ(Job("job-1").state(), v1::LOADING);
  Register(1, {});  // rank 1's worker had not finished loading
  const v1::Job job = Job("job-1");
  EXPECT_EQ(job.state(), v1::PENDING);  // two workers of the four it needs
  EXPECT_NE(Recovery("job-1").find("while the job was loading; rank 1 (worker old-worker-1"), std::string::npos)
      << job.DebugString();
  EXPECT_NE(job.degraded(), "");
  // Rank 2 comes back too late: the job is being placed afresh, so the worker drops the old shard.
  v1::RegisterWorkerResponse late = Register(2, {Held("job-1", 2, 0)});
  ASSERT_EQ(late.unload_job_ids_size(), 1);
  EXPECT_EQ(late.unload_job_ids(0), "job-1");
}

TEST_F(ClusterRestart, PlacesAgainAfterTheGracePeriodNamingTheMissingRank) {
  ASSERT_NO_FATAL_FAILURE(StoreJob("job-1", v1::READY));
  ASSERT_NO_FATAL_FAILURE(Start(absl::Milliseconds(300)));
  for (int r = 0; r < 3; ++r) Register(r, {Held("job-1", r, 0)});
  // Watched until it goes back to PENDING (its recovery: the grace is over).
  v1::JobEvent last;
  const absl::Status watched = cluster_->WatchJob(
      "job-1", absl::Now() + absl::Seconds(20),
      [&](const v1::JobEvent& e) {
        last = e;
        return e.job().state() != v1::PENDING;
      },
      nullptr);
  EXPECT_EQ(watched.code(), absl::StatusCode::kCancelled) << watched << " " << last.DebugString();
  EXPECT_EQ(last.job().state(), v1::PENDING);
  EXPECT_EQ(Recovery("job-1"),
            "recovering: lost after a coordinator restart rank 3 (last on worker old-worker-3 at 127.0.0.1:12) did "
            "not come back within 300ms (restart 1 of at most 10)");
  // The metrics say so: one group lost, the job degraded at its first restart.
  const RecoveryMetrics metrics = cluster_->Recovery();
  EXPECT_EQ(metrics.groups_lost, 1);
  ASSERT_EQ(metrics.jobs.size(), 1u);
  EXPECT_EQ(metrics.jobs[0].job_id, "job-1");
  EXPECT_EQ(metrics.jobs[0].restarts, 1);
  EXPECT_TRUE(metrics.jobs[0].degraded);
}

// A job stored while it recovered from a lost group (PENDING, "recovering: ...") recovers again
// after a coordinator restart: Job.degraded says what was lost, and requests wait for the group.
TEST_F(ClusterRestart, AJobRecoveringFromALostGroupStillSaysSoAfterARestart) {
  ASSERT_NO_FATAL_FAILURE(StoreJob("job-1", v1::READY));
  {
    auto store = jobs::JobStore::Open(path_);
    ASSERT_TRUE(store.ok()) << store.status();
    ASSERT_TRUE((*store)
                    ->Transition("job-1", v1::PENDING,
                                 "recovering: lost worker w-1 (rank 1) at 127.0.0.1:10 stopped heartbeating (silent "
                                 "for 3.2s) (restart 2 of at most 10); waiting for 4 healthy idle CPU workers (gloo); "
                                 "0 are free")
                    .ok());
  }
  ASSERT_NO_FATAL_FAILURE(Start());
  const v1::Job job = Job("job-1");
  EXPECT_EQ(job.state(), v1::PENDING);
  EXPECT_EQ(
      job.degraded(),
      "lost worker w-1 (rank 1) at 127.0.0.1:10 stopped heartbeating (silent for 3.2s) (restart 1 of at most 10)");
  EXPECT_EQ(job.restarts(), 1);
  EXPECT_EQ(job.pending_reason().rfind("recovering: lost worker w-1 (rank 1)", 0), 0u) << job.pending_reason();
  // Requests queue for the group (UNAVAILABLE once their deadline is near: 0.5 s before it here, a
  // margin a loaded machine keeps), not refused as PENDING.
  v1::InferRequest infer;
  infer.set_job_id("job-1");
  infer.mutable_tokens()->set_rows(1);
  infer.mutable_tokens()->set_seq(1);
  infer.mutable_tokens()->add_input_ids(101);
  const absl::Status waited = cluster_->Infer(infer, absl::Now() + absl::Seconds(5)).status();
  EXPECT_EQ(waited.code(), absl::StatusCode::kUnavailable) << waited;
  EXPECT_NE(waited.message().find("has no replica serving"), std::string::npos) << waited;
}

// Placed again after a lost group (PLANNED) when the coordinator stopped: back to PENDING, still
// recovering from the loss (Job.degraded, requests wait for the group), not a job that never served.
TEST_F(ClusterRestart, AJobPlacedAgainAfterALostGroupStillRecoversAfterARestart) {
  ASSERT_NO_FATAL_FAILURE(StoreJob("job-1", v1::READY));
  {
    auto store = jobs::JobStore::Open(path_);
    ASSERT_TRUE(store.ok()) << store.status();
    ASSERT_TRUE((*store)
                    ->TransitionWithRanks("job-1", v1::PENDING,
                                          "recovering: lost worker w-1 (rank 1) at 127.0.0.1:10 stopped heartbeating "
                                          "(silent for 3.2s) (restart 2 of at most 10); waiting for 4 healthy idle "
                                          "CPU workers (gloo); 0 are free",
                                          {})
                    .ok());
    ASSERT_TRUE((*store)->Transition("job-1", v1::PLANNED, "4 workers assigned").ok());
  }
  ASSERT_NO_FATAL_FAILURE(Start());
  const v1::Job job = Job("job-1");
  EXPECT_EQ(job.state(), v1::PENDING);
  EXPECT_EQ(job.ranks_size(), 0);
  EXPECT_EQ(
      job.degraded(),
      "lost worker w-1 (rank 1) at 127.0.0.1:10 stopped heartbeating (silent for 3.2s) (restart 1 of at most 10)");
  EXPECT_EQ(job.pending_reason().rfind("recovering: lost worker w-1 (rank 1)", 0), 0u) << job.pending_reason();
  EXPECT_NE(job.pending_reason().find("; the coordinator restarted before loading; "), std::string::npos)
      << job.pending_reason();
  v1::InferRequest infer;
  infer.set_job_id("job-1");
  infer.mutable_tokens()->set_rows(1);
  infer.mutable_tokens()->set_seq(1);
  infer.mutable_tokens()->add_input_ids(101);
  const absl::Status waited = cluster_->Infer(infer, absl::Now() + absl::Seconds(5)).status();
  EXPECT_EQ(waited.code(), absl::StatusCode::kUnavailable) << waited;
  EXPECT_NE(waited.message().find("has no replica serving"), std::string::npos) << waited;
  // Degraded in the metrics too (no group lost by this coordinator); its series go when it ends.
  RecoveryMetrics metrics = cluster_->Recovery();
  EXPECT_EQ(metrics.groups_lost, 0);
  ASSERT_EQ(metrics.jobs.size(), 1u);
  EXPECT_EQ(metrics.jobs[0].restarts, 1);
  EXPECT_TRUE(metrics.jobs[0].degraded);
  ASSERT_TRUE(cluster_->CancelJob("job-1").ok());
  metrics = cluster_->Recovery();
  EXPECT_TRUE(metrics.jobs.empty());
}

// Stored recovering, restarted with --max_restarts=0 (no restart allowed): FAILED naming the loss,
// as the loss would have ended it under that flag, not PENDING with a bare "recovering: ".
TEST_F(ClusterRestart, AJobRecoveringWhenRestartedWithNoRestartsAllowedFails) {
  ASSERT_NO_FATAL_FAILURE(StoreJob("job-1", v1::READY));
  {
    auto store = jobs::JobStore::Open(path_);
    ASSERT_TRUE(store.ok()) << store.status();
    ASSERT_TRUE((*store)
                    ->TransitionWithRanks("job-1", v1::PENDING,
                                          "recovering: lost worker w-1 (rank 1) at 127.0.0.1:10 stopped heartbeating "
                                          "(restart 1 of at most 10); waiting for 4 healthy idle CPU workers (gloo)",
                                          {})
                    .ok());
  }
  max_restarts_ = 0;
  ASSERT_NO_FATAL_FAILURE(Start());
  const v1::Job job = Job("job-1");
  EXPECT_EQ(job.state(), v1::FAILED) << job.DebugString();
  EXPECT_EQ(job.failure_cause(),
            "lost its workers 1 times in a row (--max_restarts=0): 1) worker w-1 (rank 1) at 127.0.0.1:10 stopped "
            "heartbeating");
  EXPECT_EQ(job.degraded(), "");
  EXPECT_TRUE(cluster_->Recovery().jobs.empty());
}

TEST_F(ClusterRestart, PutsPlannedJobsBackToPending) {
  ASSERT_NO_FATAL_FAILURE(StoreJob("job-1", v1::PLANNED));
  ASSERT_NO_FATAL_FAILURE(Start());
  const v1::Job job = Job("job-1");
  EXPECT_EQ(job.state(), v1::PENDING);
  EXPECT_NE(job.pending_reason().find("restarted before loading"), std::string::npos) << job.pending_reason();
  EXPECT_EQ(job.ranks_size(), 0);
}

TEST_F(ClusterRestart, TellsWorkersToUnloadJobsItDoesNotKnowOrHasEnded) {
  ASSERT_NO_FATAL_FAILURE(StoreJob("job-1", v1::READY));
  ASSERT_NO_FATAL_FAILURE(Start());
  ASSERT_TRUE(cluster_->CancelJob("job-1").ok());
  v1::RegisterWorkerResponse registered = Register(0, {Held("job-unknown", 0, 0)});
  ASSERT_EQ(registered.unload_job_ids_size(), 1);
  EXPECT_EQ(registered.unload_job_ids(0), "job-unknown");
  v1::HeartbeatRequest heartbeat;
  heartbeat.set_worker_id(registered.worker_id());
  *heartbeat.add_held() = Held("job-1", 0, 0);
  auto response = cluster_->Heartbeat(heartbeat);
  ASSERT_TRUE(response.ok()) << response.status();
  ASSERT_EQ(response->unload_job_ids_size(), 1);
  EXPECT_EQ(response->unload_job_ids(0), "job-1");
}

// A coordinator with a model root plans only checkpoints inside it (SubmitJob and Plan both go
// through LocalRequest); without one, a config.json that is another file entirely (the issue's
// link to /etc/passwd) is still refused without a byte of it in the error.
TEST(ClusterModelRoot, SubmitsOnlyCheckpointsUnderTheRootAndNeverQuotesAFile) {
  namespace fs = std::filesystem;
  const fs::path base = fs::path(testing::TempDir()) / "cluster_model_root";
  fs::remove_all(base);
  fs::create_directories(base / "models" / "bert");
  fs::create_directories(base / "models" / "evil");
  fs::create_directories(base / "outside");
  std::ofstream(base / "models" / "bert" / "config.json") << R"({"architectures": ["BertForMaskedLM"]})";
  std::ofstream(base / "outside" / "passwd") << "root:x:0:0:root:/root:/bin/bash\n";
  fs::create_symlink(base / "outside" / "passwd", base / "models" / "evil" / "config.json");
  fs::create_directories(base / "models" / "hard");
  std::ofstream(base / "outside" / "config.json") << R"({"architectures": ["BertForMaskedLM"]})";
  fs::create_hard_link(base / "outside" / "config.json", base / "models" / "hard" / "config.json");

  for (const bool confined : {true, false}) {
    ClusterOptions options;
    if (confined) {
      auto root = common::ModelRoot::Open((base / "models").string());
      ASSERT_TRUE(root.ok()) << root.status();
      options.model_root = *root;
    }
    auto cluster = Cluster::Create(options);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    v1::SubmitJobRequest submit;
    const auto submit_path = [&](const std::string& checkpoint) {
      submit.mutable_request()->set_checkpoint(checkpoint);
      return (*cluster)->SubmitJob(submit).status();
    };
    const std::string evil = confined ? "evil" : (base / "models" / "evil").string();
    const absl::Status refused = submit_path(evil);
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
    EXPECT_EQ(refused.message().find("root:"), std::string::npos) << "a file's contents leaked: " << refused;
    if (confined) {
      EXPECT_NE(refused.message().find("config.json is a symbolic link that leads outside the model root"),
                std::string::npos)
          << refused;
      // A hard link to a file outside the root is that file: refused (issue 21; it was planned).
      const absl::Status hard = submit_path("hard");
      EXPECT_EQ(hard.code(), absl::StatusCode::kInvalidArgument) << hard;
      EXPECT_NE(hard.message().find("config.json has 2 hard links"), std::string::npos) << hard;
      const absl::Status outside = submit_path((base / "outside").string());
      EXPECT_EQ(outside.code(), absl::StatusCode::kInvalidArgument);
      EXPECT_NE(outside.message().find("outside the model root"), std::string::npos) << outside;
      EXPECT_EQ(submit_path("../outside").code(), absl::StatusCode::kInvalidArgument);
      // Plan (the RPC's path) resolves the same way.
      v1::PlanRequest plan;
      plan.set_checkpoint("../outside");
      EXPECT_EQ((*cluster)->LocalRequest(plan).status().code(), absl::StatusCode::kInvalidArgument);
      plan.set_checkpoint("bert");
      auto local = (*cluster)->LocalRequest(plan);
      ASSERT_TRUE(local.ok()) << local.status();
      // config.json read once, through the directory's descriptor: the planner gets its fields,
      // not a path to read again.
      EXPECT_EQ(local->variant(), v1::BERT_FOR_MASKED_LM);
      EXPECT_EQ(local->checkpoint(), "");
    } else {
      EXPECT_NE(refused.message().find("config.json is not a valid JSON object"), std::string::npos) << refused;
    }
    // A checkpoint inside the root (named relative to it when confined) is planned and queued.
    auto job = (*cluster)->SubmitJob([&] {
      v1::SubmitJobRequest r;
      r.mutable_request()->set_checkpoint(confined ? "bert" : (base / "models" / "bert").string());
      return r;
    }());
    ASSERT_TRUE(job.ok()) << job.status();
    EXPECT_EQ(job->state(), v1::PENDING);
    // Workers get the path as the client named it: each resolves it under its own root.
    EXPECT_EQ(job->request().checkpoint(), confined ? "bert" : (base / "models" / "bert").string());
  }
}

// A model directory holding only a config.json naming `architecture` (BERT-base's shape): enough
// to plan, never loaded here.
std::string ConfigOnlyModel(const std::string& name, const std::string& architecture) {
  const std::filesystem::path dir = std::filesystem::path(testing::TempDir()) / name;
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "config.json") << R"({"architectures": [")" << architecture << R"("]})";
  return dir.string();
}

// Jobs that have not ended are limited per client: the next is RESOURCE_EXHAUSTED, other clients
// are not affected, and cancelling one makes room. The submitter is recorded on the job.
TEST(ClusterLimits, JobsPerClientAreLimitedUntilOneEnds) {
  const std::string dir = ConfigOnlyModel("cluster_limits_model", "BertForMaskedLM");
  ClusterOptions options;
  options.max_jobs_per_client = 2;
  auto cluster = Cluster::Create(options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  v1::SubmitJobRequest submit;
  submit.mutable_request()->set_checkpoint(dir);
  auto first = (*cluster)->SubmitJob(submit, "host:10.0.0.1");
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->submitted_by(), "host:10.0.0.1");
  ASSERT_TRUE((*cluster)->SubmitJob(submit, "host:10.0.0.1").ok());
  const absl::Status third = (*cluster)->SubmitJob(submit, "host:10.0.0.1").status();
  EXPECT_EQ(third.code(), absl::StatusCode::kResourceExhausted) << third;
  EXPECT_NE(third.message().find("--max_jobs_per_client"), std::string::npos) << third;
  EXPECT_TRUE((*cluster)->SubmitJob(submit, "cn:other-client").ok());
  ASSERT_TRUE((*cluster)->CancelJob(first->id()).ok());
  EXPECT_TRUE((*cluster)->SubmitJob(submit, "host:10.0.0.1").ok());
}

// NCCL jobs go to GPU workers, one rank per GPU of a host, decided from the devices the workers
// report, before anything loads: two workers reporting one GPU count once, and the job waits
// saying so (or is refused at once with fail_if_no_workers). No worker processes: the addresses
// refuse connections, so a placed job fails at its load. With no restart allowed it ends FAILED
// keeping its rank assignments (recovering, it would drop them at once, before or after the check
// below reads them: the load's failure races the test).
TEST(ClusterPlacement, NcclJobsTakeOneWorkerPerGpuAndSayWhyTheyWait) {
  const std::string dir = ConfigOnlyModel("cluster_placement_model", "BertModel");
  ClusterOptions options;
  options.heartbeat_interval = absl::Hours(1);  // these workers never heartbeat
  options.restarts.max_restarts = 0;
  auto cluster = Cluster::Create(options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto register_worker = [&](int port, const std::string& device) {
    v1::RegisterWorkerRequest request;
    request.set_address("127.0.0.1:" + std::to_string(port));
    request.set_device(device);
    return (*cluster)->RegisterWorker(request).worker_id();
  };
  const std::string gpu0 = register_worker(9, "cuda:0");
  const std::string second_gpu0 = register_worker(10, "cuda:0");  // the same GPU of the same host
  register_worker(11, "cpu");
  v1::SubmitJobRequest submit;
  submit.mutable_request()->set_checkpoint(dir);
  submit.mutable_request()->mutable_parallel()->set_tp_size(2);
  submit.set_backend("mpi");
  EXPECT_EQ((*cluster)->SubmitJob(submit, "test").status().code(), absl::StatusCode::kInvalidArgument);

  submit.set_backend("nccl");
  submit.set_fail_if_no_workers(true);
  const absl::Status refused = (*cluster)->SubmitJob(submit, "test").status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_NE(refused.message().find("cuda:0 of 127.0.0.1 is reported by 2 workers"), std::string::npos) << refused;

  submit.set_fail_if_no_workers(false);
  auto job = (*cluster)->SubmitJob(submit, "test");
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->backend(), "nccl");
  EXPECT_EQ(job->state(), v1::PENDING);
  EXPECT_NE(job->pending_reason().find("1 distinct GPU is free"), std::string::npos) << job->pending_reason();
  // A gloo job does not take the GPU workers either: it waits for CPU ones.
  submit.set_backend("");
  auto gloo_job = (*cluster)->SubmitJob(submit, "test");
  ASSERT_TRUE(gloo_job.ok()) << gloo_job.status();
  EXPECT_EQ(gloo_job->backend(), "gloo");
  EXPECT_NE(gloo_job->pending_reason().find("CPU workers (gloo); 1 is free"), std::string::npos)
      << gloo_job->pending_reason();
  // The reason follows the pool: once the second worker on GPU 0 leaves, it is not named any more.
  EXPECT_NE(job->pending_reason().find("is reported by 2 workers"), std::string::npos) << job->pending_reason();
  v1::HeartbeatRequest leaving;
  leaving.set_worker_id(second_gpu0);
  leaving.set_leaving(true);
  ASSERT_TRUE((*cluster)->Heartbeat(leaving).ok());
  const std::string after_leaving = (*cluster)->GetJob(job->id())->pending_reason();
  EXPECT_EQ(after_leaving.find("reported by"), std::string::npos) << after_leaving;
  EXPECT_NE(after_leaving.find("1 distinct GPU is free"), std::string::npos) << after_leaving;

  // A second GPU of the host: the NCCL job starts, on GPUs 0 and 1 and not on the worker that
  // reported GPU 0 a second time.
  const std::string gpu1 = register_worker(12, "cuda:1");
  const v1::Job placed = (*cluster)->GetJob(job->id()).value();  // placed within RegisterWorker
  ASSERT_EQ(placed.ranks_size(), 2) << placed.DebugString();
  EXPECT_EQ(placed.ranks(0).worker_id(), gpu0);
  EXPECT_EQ(placed.ranks(1).worker_id(), gpu1);
  EXPECT_EQ((*cluster)->GetJob(gloo_job->id())->state(), v1::PENDING);
}

}  // namespace
}  // namespace bertshard::server
