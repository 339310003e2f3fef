// File: server/scheduler_test_fixture.h
// -----------------------------------------------------------------------------
// The Scheduler under test through its own interface, with fake worker daemons on loopback
// (fake_worker.h): shared by scheduler_test.cc and scheduler_replicas_test.cc.
//
// Example:
//   TEST_F(SchedulerTest, ...) { FakeWorker a; Register(a); ASSERT_EQ(Settled(Submit(1).id()).state(), v1::READY); }
//
// Thread safety: the fixture's calls are the test thread's.
#ifndef BERTSHARD_SERVER_SCHEDULER_TEST_FIXTURE_H_
#define BERTSHARD_SERVER_SCHEDULER_TEST_FIXTURE_H_

#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include "gtest/gtest.h"
#include "jobs/job_store.h"
#include "server/fake_worker.h"
#include "server/scheduler.h"
#include "server/worker_pool.h"

namespace bertshard::server {

class SchedulerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    options_.heartbeat_interval = absl::Hours(1);  // the fakes never heartbeat
    // A lost group is placed again at once every time (backoff: SchedulerBackoffTest), twice at most.
    options_.restarts.backoff_initial = absl::ZeroDuration();
    options_.restarts.max_restarts = 2;
    Start();
  }
  // A new scheduler and pool over a new store, or over `store_path_`'s (a restart) when set.
  void Start() {
    scheduler_.reset();
    pool_ = std::make_unique<WorkerPool>(options_, "test");
    auto store = jobs::JobStore::Open(store_path_.empty() ? ":memory:" : store_path_);
    ASSERT_TRUE(store.ok()) << store.status();
    auto scheduler = Scheduler::Create(options_, *std::move(store), pool_.get());
    ASSERT_TRUE(scheduler.ok()) << scheduler.status();
    scheduler_ = *std::move(scheduler);
    const std::filesystem::path dir = std::filesystem::path(testing::TempDir()) / "scheduler_model";
    std::filesystem::create_directories(dir);
    std::ofstream(dir / "config.json") << R"({"architectures": ["BertForMaskedLM"]})";
    checkpoint_ = dir.string();
  }
  void TearDown() override { scheduler_.reset(); }

  std::string Register(const FakeWorker& worker) {
    v1::RegisterWorkerRequest request;
    request.set_address(worker.Address());
    return scheduler_->RegisterWorker(request).worker_id();
  }
  v1::Job Submit(int ranks, int replicas = 1) {
    v1::SubmitJobRequest submit;
    submit.mutable_request()->set_checkpoint(checkpoint_);
    submit.mutable_request()->mutable_parallel()->set_tp_size(ranks);
    if (replicas != 1) submit.set_replicas(replicas);
    auto job = scheduler_->SubmitJob(submit, "test");
    EXPECT_TRUE(job.ok()) << job.status();
    return job.ok() ? *job : v1::Job();
  }
  // The job once READY or ended (WatchJob's end), within 60 s.
  // Worker `id` says it is leaving (SIGTERM): its job loses its group.
  bool Leave(const std::string& id) {
    v1::HeartbeatRequest leaving;
    leaving.set_worker_id(id);
    leaving.set_leaving(true);
    return scheduler_->Heartbeat(leaving).ok();
  }
  // With `all_replicas`, until every replica it wants is READY too.
  v1::Job Settled(const std::string& id, bool all_replicas = false) {
    v1::Job last;
    const absl::Status watched = scheduler_->WatchJob(
        id, absl::Now() + absl::Seconds(60),
        [&](const v1::JobEvent& e) {
          last = e.job();
          return true;
        },
        nullptr, all_replicas);
    EXPECT_TRUE(watched.ok()) << watched;
    return last;
  }

  ClusterOptions options_;
  std::string store_path_;  // empty: an in-memory store, new at each Start()
  std::unique_ptr<WorkerPool> pool_;
  std::unique_ptr<Scheduler> scheduler_;
  std::string checkpoint_;
};

}  // namespace bertshard::server

#endif  // BERTSHARD_SERVER_SCHEDULER_TEST_FIXTURE_H_
