// Coordinator behaviours end to end, on a coordinator and four shard-worker processes on loopback
// (tests/cluster_fixture.h): PENDING jobs start by themselves when workers free up or join, and
// after a coordinator restart; two jobs share the pool; cancelling PENDING and LOADING jobs (a load
// held at the worker's "worker_load" pause point); callers of Infer whose deadline passes or who go
// away while their forward is held leave the job serving; text pairs and multiple choice through
// the service against references; a worker that registers again is listed once; WatchJob's errors.
//
// Phases are held with the workers' pause points (common/fault_point.h): the fixture gives the
// workers $BERTSHARD_FAULT_DIR, a test creates <point>.hold there and waits for the workers'
// <point>.<pid>.reached markers. No sleep stands in for synchronisation: every wait polls for a
// condition with a bound.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "bertshard/v1/coordinator.grpc.pb.h"
#include "bertshard/v1/worker.grpc.pb.h"
#include "checkpoint/safetensors.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/cluster_fixture.h"
#include "tests/test_process.h"

namespace bertshard {
namespace {

using testing::Cli;
using testing::Context;
using testing::kModel;
using testing::ReadAll;
using testing::Shardctl;
using testing::Spawn;
using testing::TempDir;

constexpr char kMultipleChoice[] = "tests/testdata/model/multiple_choice";
constexpr char kBertModel[] = "tests/testdata/model/bert_model";

int64_t NowMillis() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// Polls `condition` every 50 ms for up to `seconds`; whether it came true.
bool PollFor(double seconds, const std::function<bool()>& condition) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(static_cast<int>(seconds * 1000));
  while (true) {
    if (condition()) return true;
    if (std::chrono::steady_clock::now() >= end) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

// The float32 tensor `name` of a safetensors file, with its shape; empty when missing.
std::pair<std::vector<int64_t>, std::vector<float>> ReadTensor(const std::string& path, const std::string& name) {
  auto file = checkpoint::SafetensorsFile::Open(path);
  if (!file.ok()) return {};
  const checkpoint::TensorInfo* info = (*file)->Find(name);
  if (info == nullptr) return {};
  std::vector<float> values(static_cast<size_t>(info->numel()));
  if (!(*file)->ReadSlice(*info, {}, values.data()).ok()) return {};
  return {std::vector<int64_t>(info->shape.begin(), info->shape.end()), values};
}

std::vector<int64_t> Shape(const v1::NamedTensor& t) { return {t.shape().begin(), t.shape().end()}; }

const v1::NamedTensor* Output(const v1::InferResponse& response, const std::string& name) {
  for (const auto& t : response.outputs()) {
    if (t.name() == name) return &t;
  }
  return nullptr;
}

std::vector<v1::JobState> States(const v1::Job& job) {
  std::vector<v1::JobState> states;
  for (const auto& change : job.history()) states.push_back(change.state());
  return states;
}

// A DEADLINE_EXCEEDED seen by the caller comes from its own gRPC library ("Deadline Exceeded") or,
// when the server answered first, from the coordinator with the reason.
bool DeadlineMessage(const grpc::Status& s, const std::string& server_reason) {
  return s.error_message() == "Deadline Exceeded" || s.error_message().find(server_reason) != std::string::npos;
}

// Likewise CANCELLED after the caller's TryCancel: its own library's message, or the server's reason.
bool CancelledMessage(const grpc::Status& s, const std::string& server_reason) {
  return s.error_message() == "Cancelled" || s.error_message() == "CANCELLED" ||
         s.error_message().find(server_reason) != std::string::npos;
}

class BehaviourCluster : public testing::Cluster {
 protected:
  // The workers SetUp spawns get a fault directory (the fixture's Hold / Release / WaitReached).
  BehaviourCluster() { UseFaultDir("behaviour-" + std::to_string(++instances_)); }

  void TearDown() override {
    for (pid_t p : stopped_) kill(p, SIGCONT);
    Cluster::TearDown();  // releases every pause point first
  }

  // The pause points' markers say which process got there; they are kept (one per process and
  // point) until cleared, so a point is cleared before it is held a second time.
  void ClearReached(const std::string& point) {
    std::error_code ignored;
    for (const auto& entry : std::filesystem::directory_iterator(fault_dir_, ignored)) {
      const std::string name = entry.path().filename().string();
      if (name.rfind(point + ".", 0) == 0 && name.find(".reached") != std::string::npos) {
        std::filesystem::remove(entry.path(), ignored);
      }
    }
  }

  grpc::Status Cancel(const std::string& id, v1::Job* job) {
    v1::GetJobRequest cancel;
    cancel.set_job_id(id);
    return stub_->CancelJob(Context().get(), cancel, job);
  }

  v1::ListWorkersResponse Workers() {
    v1::ListWorkersResponse workers;
    const grpc::Status s = stub_->ListWorkers(Context().get(), v1::ListWorkersRequest(), &workers);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return workers;
  }

  // The listed workers by value (a range-for over Workers().workers() would outlive the response).
  std::vector<v1::WorkerInfo> ListedWorkers() {
    const v1::ListWorkersResponse workers = Workers();
    return {workers.workers().begin(), workers.workers().end()};
  }

  // Every worker process is listed exactly once: as many entries as processes, one per address
  // and per id.
  void ExpectListedOnce(const v1::ListWorkersResponse& workers) {
    std::set<std::string> addresses, ids;
    for (const auto& w : workers.workers()) {
      EXPECT_TRUE(addresses.insert(w.address()).second) << "address listed twice: " << workers.DebugString();
      EXPECT_TRUE(ids.insert(w.worker_id()).second) << "id listed twice: " << workers.DebugString();
    }
    EXPECT_EQ(workers.workers_size(), static_cast<int>(workers_.size())) << workers.DebugString();
  }

  // Infers the reference input on `job`; the status, and the output in `response`.
  grpc::Status InferReference(const std::string& job, v1::InferResponse* response, grpc::ClientContext* context) {
    v1::InferRequest infer;
    infer.set_job_id(job);
    *infer.mutable_tokens() = Tokens();
    return stub_->Infer(context, infer, response);
  }

  // Starts one more shard-worker process (its log: WorkerLog(index)); returns its index in workers_.
  int StartExtraWorker() {
    const int index = next_log_++;
    std::vector<std::string> args = {"worker/shard-worker", "--listen=127.0.0.1:0", "--threads=1",
                                     "--coordinator=127.0.0.1:" + std::to_string(port_)};
    args.insert(args.end(), tls_flags_.begin(), tls_flags_.end());
    workers_.push_back(Spawn(args, WorkerLog(static_cast<size_t>(index))));
    spawn_index_.push_back(index);
    return static_cast<int>(workers_.size()) - 1;
  }

  static int Count(const std::string& text, const std::string& what) {
    int n = 0;
    for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
    return n;
  }

  int next_log_ = 4;            // the fixture's workers write logs 0..3
  std::vector<pid_t> stopped_;  // SIGSTOPped by a test: continued in TearDown whatever happened
  inline static int instances_ = 0;
};

// 1. A PENDING job starts by itself when the job holding the workers is cancelled, and when a new
// worker registers.
TEST_F(BehaviourCluster, PendingJobStartsWhenWorkersFreeUpOrJoin) {
  const v1::Job first = Submit(kModel);
  ASSERT_EQ(Watch(first.id()).job().state(), v1::READY);
  const v1::Job waiting = Submit(kModel);
  ASSERT_EQ(waiting.state(), v1::PENDING);
  EXPECT_EQ(waiting.pending_reason(), "waiting for 4 healthy idle CPU workers (gloo); 0 are free");
  EXPECT_EQ(GetJob(waiting.id()).state(), v1::PENDING);  // still: nobody is free

  v1::Job cancelled;
  ASSERT_TRUE(Cancel(first.id(), &cancelled).ok());
  const v1::JobEvent started = Watch(waiting.id());  // no other call: it starts by itself
  ASSERT_EQ(started.job().state(), v1::READY) << started.job().failure_cause();
  EXPECT_EQ(States(started.job()), (std::vector<v1::JobState>{v1::PENDING, v1::PLANNED, v1::LOADING, v1::READY}));
  EXPECT_LE(InferDiff(waiting.id()), 1e-5f);

  // Every worker is busy again: a one-worker job waits, and starts on a worker that joins.
  const v1::Job small = Submit(kModel, 1, 1);
  ASSERT_EQ(small.state(), v1::PENDING);
  EXPECT_EQ(small.pending_reason(), "waiting for 1 healthy idle CPU worker (gloo); 0 are free");
  const int extra = StartExtraWorker();
  const v1::JobEvent small_ready = Watch(small.id());
  ASSERT_EQ(small_ready.job().state(), v1::READY) << small_ready.job().failure_cause();
  std::string id;
  EXPECT_EQ(WorkerServing(small.id(), 0, &id), extra) << "the job did not start on the worker that joined";
  EXPECT_EQ(id, IdOf(extra));
  EXPECT_LE(InferDiff(small.id()), 1e-5f);
  EXPECT_LE(InferDiff(waiting.id()), 1e-5f);  // the 2 x 2 job is unaffected
  ExpectListedOnce(Workers());
}

// 2. Two jobs share the four workers: both READY at once on disjoint workers, both answer correctly
// (concurrently too), and cancelling one leaves the other serving.
TEST_F(BehaviourCluster, TwoJobsShareThePoolAndCancellingOneLeavesTheOther) {
  const v1::Job tp = Submit(kModel, 2, 1);
  const v1::Job pp = Submit(kModel, 1, 2);
  ASSERT_EQ(Watch(tp.id()).job().state(), v1::READY);
  ASSERT_EQ(Watch(pp.id()).job().state(), v1::READY);
  std::map<std::string, std::set<int>> ranks;
  for (const auto& w : ListedWorkers()) ranks[w.job_id()].insert(w.rank());
  EXPECT_EQ(ranks[tp.id()], (std::set<int>{0, 1}));
  EXPECT_EQ(ranks[pp.id()], (std::set<int>{0, 1}));
  EXPECT_EQ(ranks.size(), 2u);  // no idle worker left, none serving both

  std::vector<float> diffs(6, 1e9f);
  std::vector<std::thread> clients;
  for (int c = 0; c < 6; ++c) {
    clients.emplace_back([&, c] {
      v1::InferRequest infer;
      infer.set_job_id(c % 2 == 0 ? tp.id() : pp.id());
      *infer.mutable_tokens() = Tokens(c / 2 % 2);
      v1::InferResponse response;
      if (stub_->Infer(Context().get(), infer, &response).ok() && response.outputs_size() == 1) {
        diffs[static_cast<size_t>(c)] = MaxDiff(response.outputs(0), Expected(c / 2 % 2));
      }
    });
  }
  for (auto& t : clients) t.join();
  for (int c = 0; c < 6; ++c) EXPECT_LE(diffs[static_cast<size_t>(c)], 1e-5f) << "client " << c;

  v1::Job cancelled;
  const grpc::Status s = Cancel(tp.id(), &cancelled);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(cancelled.state(), v1::CANCELLED);
  EXPECT_TRUE(WaitUnloadedEverywhere(tp.id()));
  EXPECT_TRUE(PollFor(10, [&] { return HealthyIdle() == 2; })) << Workers().DebugString();
  EXPECT_EQ(GetJob(pp.id()).state(), v1::READY);
  EXPECT_LE(InferDiff(pp.id()), 1e-5f);
  // The survivor's workers still hold it.
  for (int r = 0; r < 2; ++r) {
    std::string id;
    const int i = WorkerServing(pp.id(), r, &id);
    ASSERT_GE(i, 0);
    EXPECT_TRUE(Holds(static_cast<size_t>(i), pp.id())) << "rank " << r;
  }
  v1::InferRequest infer;
  infer.set_job_id(tp.id());
  *infer.mutable_tokens() = Tokens();
  v1::InferResponse response;
  const grpc::Status refused = stub_->Infer(Context().get(), infer, &response);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(refused.error_message().find("is CANCELLED"), std::string::npos) << refused.error_message();
}

// 3. PENDING jobs survive a coordinator restart as PENDING (their history intact) while the READY
// job is taken back, and start once its workers are free. Each worker is listed once after the
// workers registered again with the new coordinator.
TEST_F(BehaviourCluster, PendingJobsStayPendingAcrossACoordinatorRestart) {
  const v1::Job running = Submit(kModel);
  ASSERT_EQ(Watch(running.id()).job().state(), v1::READY);
  const v1::Job pp = Submit(kModel, 1, 2);
  const v1::Job tp = Submit(kModel, 2, 1);
  ASSERT_EQ(pp.state(), v1::PENDING);
  ASSERT_EQ(tp.state(), v1::PENDING);

  StopCoordinator();
  StartCoordinator();
  for (const v1::Job& before : {pp, tp}) {
    const v1::Job after = GetJob(before.id());
    EXPECT_EQ(after.state(), v1::PENDING);
    EXPECT_EQ(after.pending_reason(), before.pending_reason());
    EXPECT_EQ(States(after), (std::vector<v1::JobState>{v1::PENDING}));
  }
  const v1::JobEvent back = Watch(running.id());
  ASSERT_EQ(back.job().state(), v1::READY) << back.job().failure_cause();
  EXPECT_EQ(GetJob(pp.id()).state(), v1::PENDING);  // the workers came back serving the READY job
  EXPECT_EQ(GetJob(tp.id()).state(), v1::PENDING);
  const v1::ListWorkersResponse workers = Workers();
  ExpectListedOnce(workers);
  for (const auto& w : workers.workers()) EXPECT_TRUE(w.healthy()) << w.DebugString();

  v1::Job cancelled;
  ASSERT_TRUE(Cancel(running.id(), &cancelled).ok());
  const v1::JobEvent pp_ready = Watch(pp.id());
  const v1::JobEvent tp_ready = Watch(tp.id());
  ASSERT_EQ(pp_ready.job().state(), v1::READY) << pp_ready.job().failure_cause();
  ASSERT_EQ(tp_ready.job().state(), v1::READY) << tp_ready.job().failure_cause();
  EXPECT_LE(InferDiff(pp.id()), 1e-5f);
  EXPECT_LE(InferDiff(tp.id()), 1e-5f);
}

// 4. Cancel of a PENDING job and of a LOADING one (its workers held before reading a tensor): both
// CANCELLED with their history, the workers idle at once and holding nothing, and the held loads,
// released afterwards, leave no shard behind (no worker ever reports one for the heartbeats to
// drop). A job cancelled while LOADING but before any rank was asked to load (the coordinator's
// call reserving rank 0's rendezvous port held up by stopping that worker) is never loaded once the
// call goes through: no worker is asked to load it (server/cluster.cc LoadJob used to go on and
// load it on workers it had already marked idle). The workers then serve a new job.
// (PLANNED: CancelAndReRegistrationWhileAJobIsPlanned.)
TEST_F(BehaviourCluster, CancelPendingAndLoadingJobs) {
  Hold("worker_load");
  const v1::Job loading = Submit(kModel);
  ASSERT_FALSE(WaitReached("worker_load", 4).empty());
  ASSERT_EQ(WaitState(loading.id(), v1::LOADING).state(), v1::LOADING);

  const v1::Job pending = Submit(kModel);
  ASSERT_EQ(pending.state(), v1::PENDING);
  v1::Job cancelled;
  grpc::Status s = Cancel(pending.id(), &cancelled);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(cancelled.state(), v1::CANCELLED);
  EXPECT_EQ(States(cancelled), (std::vector<v1::JobState>{v1::PENDING, v1::CANCELLED}));
  EXPECT_EQ(cancelled.history(cancelled.history_size() - 1).reason(), "cancelled by request");
  EXPECT_EQ(GetJob(pending.id()).state(), v1::CANCELLED);
  s = Cancel(pending.id(), &cancelled);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(s.error_message(), "job " + pending.id() + " is already CANCELLED");

  s = Cancel(loading.id(), &cancelled);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(cancelled.state(), v1::CANCELLED);
  EXPECT_EQ(States(cancelled), (std::vector<v1::JobState>{v1::PENDING, v1::PLANNED, v1::LOADING, v1::CANCELLED}));
  EXPECT_EQ(cancelled.failure_cause(), "");
  EXPECT_TRUE(PollFor(10, [&] { return HealthyIdle() == 4; })) << Workers().DebugString();
  for (const auto& w : ListedWorkers()) EXPECT_EQ(w.job_id(), "") << w.DebugString();
  EXPECT_TRUE(WaitUnloadedEverywhere(loading.id()));

  // Let the held loads go on: each worker goes past the pause point (it then picks its GEMM path,
  // which it logs once), notices the cancellation and drops what it read.
  Release("worker_load");
  for (size_t i = 0; i < workers_.size(); ++i) {
    EXPECT_TRUE(PollFor(
        20,
        [&] {
          return ReadAll(WorkerLog(static_cast<size_t>(spawn_index_[i]))).find("job " + loading.id() + " rank") !=
                 std::string::npos;
        }))
        << "worker " << i << " did not go on loading after the release";
  }

  // Cancelled while its loading is being set up: LOADING, its rank 0's worker stopped (SIGSTOP) so
  // that the coordinator's call reserving the rendezvous port waits, cancelled, then continued.
  // The call then succeeds, and the coordinator must not go on to load a cancelled job. Rank 0 is
  // the first healthy idle worker in id order (ListWorkers' order, the scheduler's too).
  std::string first_idle;
  for (const auto& w : ListedWorkers()) {
    if (first_idle.empty() && w.healthy() && w.job_id().empty()) first_idle = w.worker_id();
  }
  const int stalled = IndexOfId(first_idle);
  ASSERT_GE(stalled, 0);
  ASSERT_EQ(kill(workers_[static_cast<size_t>(stalled)], SIGSTOP), 0);
  stopped_.push_back(workers_[static_cast<size_t>(stalled)]);
  const v1::Job setting_up = Submit(kModel, 1, 1);
  ASSERT_EQ(setting_up.ranks_size(), 1);
  EXPECT_EQ(setting_up.ranks(0).worker_id(), first_idle);
  EXPECT_EQ(WaitState(setting_up.id(), v1::LOADING).state(), v1::LOADING);
  s = Cancel(setting_up.id(), &cancelled);
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(cancelled.state(), v1::CANCELLED);
  ASSERT_EQ(kill(workers_[static_cast<size_t>(stalled)], SIGCONT), 0);  // well within 3 heartbeats
  stopped_.clear();

  // The same workers serve a new job (loads and a forward: the old loads are long over by then).
  v1::Job next;
  ASSERT_NO_FATAL_FAILURE(SubmitUntilServing(&next));
  EXPECT_LE(InferDiff(next.id()), 1e-5f);
  // Two heartbeats from every worker since: a shard of the cancelled job kept by a finished load
  // would have been reported by the first, and the worker told to unload it (which it logs).
  for (int round = 0; round < 2; ++round) {
    const int64_t since = NowMillis();
    EXPECT_TRUE(PollFor(10, [&] {
      for (const auto& w : ListedWorkers()) {
        if (w.last_heartbeat_unix_millis() <= since) return false;
      }
      return true;
    }));
  }
  for (size_t i = 0; i < workers_.size(); ++i) {
    const std::string log = ReadAll(WorkerLog(static_cast<size_t>(spawn_index_[i])));
    EXPECT_EQ(log.find("unloading job " + loading.id()), std::string::npos)
        << "worker " << i << " kept a shard of the cancelled job until a heartbeat dropped it:\n"
        << log;
    EXPECT_FALSE(Holds(i, loading.id())) << "worker " << i;
    // Never even asked to load it (a load logs the GEMM path it picks for a new shape, here 1 x 1).
    EXPECT_EQ(log.find("job " + setting_up.id() + " rank"), std::string::npos)
        << "worker " << i << " was asked to load a job cancelled before its loads started:\n"
        << log;
    EXPECT_EQ(log.find("unloading job " + setting_up.id()), std::string::npos) << "worker " << i << ":\n" << log;
    EXPECT_FALSE(Holds(i, setting_up.id())) << "worker " << i;
  }
  EXPECT_EQ(GetJob(loading.id()).state(), v1::CANCELLED);
  EXPECT_EQ(GetJob(setting_up.id()).state(), v1::CANCELLED);
}

// 4b. The PLANNED window: workers are assigned, the load has not begun. The coordinator's load
// thread is held at its start ("coordinator_planned"). A job cancelled there is CANCELLED and no
// worker is ever asked to load it. A worker that registers again there under a new id (its entry
// replaced) fails the job naming it; before the fix the load thread looked the old id up with
// std::map::at and the exception ended the coordinator.
TEST_F(BehaviourCluster, CancelAndReRegistrationWhileAJobIsPlanned) {
  Hold("coordinator_planned");
  const v1::Job planned = Submit(kModel);
  ASSERT_FALSE(WaitReached("coordinator_planned", 1).empty());
  ASSERT_EQ(GetJob(planned.id()).state(), v1::PLANNED);
  v1::Job cancelled;
  grpc::Status s = Cancel(planned.id(), &cancelled);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(cancelled.state(), v1::CANCELLED);
  EXPECT_EQ(States(cancelled), (std::vector<v1::JobState>{v1::PENDING, v1::PLANNED, v1::CANCELLED}));
  EXPECT_TRUE(PollFor(10, [&] { return HealthyIdle() == 4; })) << Workers().DebugString();

  // Next: a one-worker job held in the window while its worker registers again, without it.
  ClearReached("coordinator_planned");
  const v1::Job second = Submit(kModel, 1, 1);
  ASSERT_EQ(second.ranks_size(), 1);
  ASSERT_FALSE(WaitReached("coordinator_planned", 1).empty());
  ASSERT_EQ(GetJob(second.id()).state(), v1::PLANNED);
  v1::RegisterWorkerRequest again;
  again.set_address(second.ranks(0).worker_address());
  v1::RegisterWorkerResponse registered;
  s = stub_->RegisterWorker(Context().get(), again, &registered);
  ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_NE(registered.worker_id(), second.ranks(0).worker_id());
  Release("coordinator_planned");  // both held load threads go on

  const v1::Job failed = WaitState(second.id(), v1::FAILED);
  EXPECT_EQ(failed.state(), v1::FAILED);
  EXPECT_NE(failed.failure_cause().find(second.ranks(0).worker_id()), std::string::npos) << failed.failure_cause();
  // The coordinator is alive and the pool usable: a job loads and answers on it.
  v1::Job next;
  ASSERT_NO_FATAL_FAILURE(SubmitUntilServing(&next));
  EXPECT_LE(InferDiff(next.id()), 1e-5f);
  // No worker was ever asked to load the job cancelled while PLANNED (a load logs "job ID rank").
  for (size_t i = 0; i < workers_.size(); ++i) {
    const std::string log = ReadAll(WorkerLog(static_cast<size_t>(spawn_index_[i])));
    EXPECT_EQ(log.find("job " + planned.id() + " rank"), std::string::npos) << "worker " << i << ":\n" << log;
    EXPECT_FALSE(Holds(i, planned.id())) << "worker " << i;
  }
  EXPECT_EQ(GetJob(planned.id()).state(), v1::CANCELLED);
}

// 5. A caller whose deadline passes while its forward is held on the workers gets
// DEADLINE_EXCEEDED, and one that goes away (TryCancel) CANCELLED; either way the job stays READY,
// the held forward finishes once released, and the next requests are answered correctly (the
// ranks' forward sequence is intact).
TEST_F(BehaviourCluster, InferCallersThatLeaveMidForwardLeaveTheJobServing) {
  v1::Job job;
  ASSERT_NO_FATAL_FAILURE(SubmitUntilServing(&job));

  Hold("worker_forward");
  grpc::Status late;
  std::chrono::steady_clock::duration took{};
  std::thread caller([&] {
    v1::InferResponse response;
    const auto start = std::chrono::steady_clock::now();
    late = InferReference(job.id(), &response, Context(4).get());
    took = std::chrono::steady_clock::now() - start;
  });
  const bool reached = !WaitReached("worker_forward", 4).empty();
  caller.join();
  ASSERT_TRUE(reached) << "the forward did not reach the workers";
  EXPECT_EQ(late.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << late.error_message();
  EXPECT_TRUE(DeadlineMessage(late, "the deadline passed while the request's batch ran")) << late.error_message();
  EXPECT_LT(took, std::chrono::seconds(10));
  v1::Job after = GetJob(job.id());
  EXPECT_EQ(after.state(), v1::READY) << after.failure_cause();
  Release("worker_forward");
  v1::InferResponse response;
  grpc::Status s = InferReference(job.id(), &response, Context().get());
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_LE(MaxDiff(response.outputs(0), Expected()), 1e-5f);

  // The held forward ended before the answer above (one forward at a time): hold again.
  ClearReached("worker_forward");
  Hold("worker_forward");
  auto context = Context(60);
  grpc::Status gone;
  caller = std::thread([&] {
    v1::InferResponse ignored;
    gone = InferReference(job.id(), &ignored, context.get());
  });
  const bool reached_again = !WaitReached("worker_forward", 4).empty();
  context->TryCancel();
  caller.join();
  ASSERT_TRUE(reached_again) << "the forward did not reach the workers";
  EXPECT_EQ(gone.error_code(), grpc::StatusCode::CANCELLED) << gone.error_message();
  EXPECT_TRUE(CancelledMessage(gone, "the caller went away while the request's batch ran")) << gone.error_message();
  after = GetJob(job.id());
  EXPECT_EQ(after.state(), v1::READY) << after.failure_cause();
  Release("worker_forward");
  for (int i = 0; i < 2; ++i) {
    s = InferReference(job.id(), &response, Context().get());
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_LE(MaxDiff(response.outputs(0), Expected()), 1e-5f);
  }
  after = GetJob(job.id());
  EXPECT_EQ(after.state(), v1::READY) << after.failure_cause();
  for (const auto& change : after.history()) EXPECT_NE(change.state(), v1::FAILED) << change.reason();
}

// 6. Text pairs and multiple choice through the service, two jobs side by side. Pairs: [CLS] a
// [SEP] b [SEP] with token types 1 on the second segment, and the outputs equal an unsharded run
// (`shardctl run --local`, one rank) of the tokens the service reports. Multiple choice: tokens
// with `choices`, logits [batch, choices] equal to the checked-in reference, one prediction per
// choice group; text input is refused.
TEST_F(BehaviourCluster, TextPairsAndMultipleChoiceThroughTheService) {
  const std::string text_model = testing::CheckpointWithWordVocabulary(kBertModel, "pairs_model");
  const v1::Job pairs_job = Submit(text_model, 1, 2);
  const v1::Job choice_job = Submit(kMultipleChoice, 2, 1);
  ASSERT_EQ(Watch(pairs_job.id()).job().state(), v1::READY);
  ASSERT_EQ(Watch(choice_job.id()).job().state(), v1::READY);

  v1::InferRequest infer;
  infer.set_job_id(pairs_job.id());
  infer.mutable_text()->add_texts("w7 w8");
  infer.mutable_text()->add_text_pairs("w10 w11 w12");
  infer.mutable_text()->add_texts("w9");
  infer.mutable_text()->add_text_pairs("w13");
  v1::InferResponse response;
  grpc::Status s = stub_->Infer(Context().get(), infer, &response);
  ASSERT_TRUE(s.ok()) << s.error_message();
  const v1::TokenInputs& t = response.tokens();
  EXPECT_EQ(t.rows(), 2);
  EXPECT_EQ(t.seq(), 8);
  EXPECT_EQ(std::vector<int64_t>(t.input_ids().begin(), t.input_ids().end()),
            (std::vector<int64_t>{2, 7, 8, 3, 10, 11, 12, 3, 2, 9, 3, 13, 3, 0, 0, 0}));
  EXPECT_EQ(std::vector<int64_t>(t.token_type_ids().begin(), t.token_type_ids().end()),
            (std::vector<int64_t>{0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 1, 1, 0, 0, 0}));
  EXPECT_EQ(std::vector<int64_t>(t.attention_mask().begin(), t.attention_mask().end()),
            (std::vector<int64_t>{1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0}));
  const v1::NamedTensor* hidden = Output(response, "last_hidden_state");
  const v1::NamedTensor* pooled = Output(response, "pooler_output");
  ASSERT_NE(hidden, nullptr);
  ASSERT_NE(pooled, nullptr);
  EXPECT_EQ(Shape(*hidden), (std::vector<int64_t>{2, 8, 32}));
  EXPECT_EQ(Shape(*pooled), (std::vector<int64_t>{2, 32}));
  // The unsharded reference on the same tokens.
  const std::string input = TempDir() + "/pairs_input.json";
  {
    std::ofstream json(input);
    const auto rows = [&](const google::protobuf::RepeatedField<int64_t>& v) {
      std::string out = "[";
      for (int64_t r = 0; r < t.rows(); ++r) {
        out += r == 0 ? "[" : ", [";
        for (int64_t i = 0; i < t.seq(); ++i) {
          out += (i == 0 ? "" : ", ") + std::to_string(v[static_cast<int>(r * t.seq() + i)]);
        }
        out += "]";
      }
      return out + "]";
    };
    json << "{\"input_ids\": " << rows(t.input_ids()) << ", \"attention_mask\": " << rows(t.attention_mask())
         << ", \"token_type_ids\": " << rows(t.token_type_ids()) << "}";
  }
  const std::string reference = TempDir() + "/pairs_reference.safetensors";
  const Cli run = Shardctl({"run", "--local", "--checkpoint", text_model, "--input", input, "--output", reference});
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const auto want_hidden = ReadTensor(reference, "last_hidden_state");
  const auto want_pooled = ReadTensor(reference, "pooler_output");
  EXPECT_EQ(want_hidden.first, Shape(*hidden));
  EXPECT_LE(MaxDiff(*hidden, want_hidden.second), 1e-5f);
  EXPECT_LE(MaxDiff(*pooled, want_pooled.second), 1e-5f);
  // The segments matter: the same tokens as one segment give other hidden states.
  v1::InferRequest one_segment;
  one_segment.set_job_id(pairs_job.id());
  *one_segment.mutable_tokens() = t;
  one_segment.mutable_tokens()->mutable_token_type_ids()->Clear();
  v1::InferResponse flat;
  s = stub_->Infer(Context().get(), one_segment, &flat);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_GT(MaxDiff(*Output(flat, "last_hidden_state"), want_hidden.second), 1e-3f);
  // One pair per text.
  infer.mutable_text()->mutable_text_pairs()->RemoveLast();
  s = stub_->Infer(Context().get(), infer, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(s.error_message(), "text_pairs needs one entry per text: 2 texts, 1 pairs");

  // Multiple choice: [batch 2, choices 2, seq 8] as rows 4 with choices 2.
  const auto j = nlohmann::json::parse(ReadAll(std::string(kMultipleChoice) + "/input.json"));
  v1::InferRequest choose;
  choose.set_job_id(choice_job.id());
  v1::TokenInputs* c = choose.mutable_tokens();
  c->set_choices(2);
  c->set_seq(8);
  for (size_t b = 0; b < j["input_ids"].size(); ++b) {
    for (size_t k = 0; k < j["input_ids"][b].size(); ++k) {
      c->set_rows(c->rows() + 1);
      for (const auto& v : j["input_ids"][b][k]) c->add_input_ids(v.get<int64_t>());
      for (const auto& v : j["attention_mask"][b][k]) c->add_attention_mask(v.get<int64_t>());
      for (const auto& v : j["token_type_ids"][b][k]) c->add_token_type_ids(v.get<int64_t>());
    }
  }
  ASSERT_EQ(c->rows(), 4);
  s = stub_->Infer(Context().get(), choose, &response);
  ASSERT_TRUE(s.ok()) << s.error_message();
  const auto want_logits = ReadTensor(std::string(kMultipleChoice) + "/expected.safetensors", "logits");
  ASSERT_EQ(want_logits.first, (std::vector<int64_t>{2, 2}));
  const v1::NamedTensor* logits = Output(response, "logits");
  ASSERT_NE(logits, nullptr);
  EXPECT_EQ(Shape(*logits), (std::vector<int64_t>{2, 2}));
  EXPECT_LE(MaxDiff(*logits, want_logits.second), 1e-5f);
  ASSERT_EQ(response.predictions_size(), 2);
  for (int b = 0; b < 2; ++b) {
    const auto& labels = response.predictions(b).labels();
    ASSERT_EQ(labels.size(), 2);
    const std::vector<float>& want = want_logits.second;
    const int best = want[static_cast<size_t>(2 * b)] >= want[static_cast<size_t>(2 * b + 1)] ? 0 : 1;
    EXPECT_EQ(labels[0].id(), best);
    EXPECT_EQ(labels[0].label(), std::to_string(best));
    EXPECT_NEAR(labels[0].score() + labels[1].score(), 1.0f, 1e-5f);
  }
  // One choice group alone: its own logits.
  v1::InferRequest second = choose;
  v1::TokenInputs* g = second.mutable_tokens();
  g->set_rows(2);
  for (auto* field : {g->mutable_input_ids(), g->mutable_attention_mask(), g->mutable_token_type_ids()}) {
    field->erase(field->begin(), field->begin() + 16);
  }
  s = stub_->Infer(Context().get(), second, &response);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_LE(MaxDiff(response.outputs(0), {want_logits.second[2], want_logits.second[3]}), 1e-5f);
  // Rows that are no whole choice groups, and text, are refused.
  v1::InferRequest ragged = choose;
  ragged.mutable_tokens()->set_choices(3);
  s = stub_->Infer(Context().get(), ragged, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("rows must be whole choice groups"), std::string::npos) << s.error_message();
  v1::InferRequest text;
  text.set_job_id(choice_job.id());
  text.mutable_text()->add_texts("w7");
  s = stub_->Infer(Context().get(), text, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(s.error_message(), "text input is not supported for BertForMultipleChoice; send tokens");
}

// 7. A worker that registers again is listed once. From the same address while its old entry serves
// a job: holding the rank it keeps the job (the ranks point at its new id, inference goes on); the
// real worker, whose heartbeats then name an id the coordinator no longer knows, registers again
// itself, and keeps it too. Without its shard: the job fails naming it, and every worker ends up idle
// and without the job. A worker stopped past the heartbeat threshold comes back as the same entry.
TEST_F(BehaviourCluster, AWorkerThatRegistersAgainIsListedOnce) {
  const v1::Job job = Submit(kModel);
  ASSERT_EQ(Watch(job.id()).job().state(), v1::READY);
  std::string old_id;
  const int index = WorkerServing(job.id(), 1, &old_id);
  ASSERT_GE(index, 0);
  std::string address;
  for (const auto& w : ListedWorkers()) {
    if (w.worker_id() == old_id) address = w.address();
  }
  ASSERT_FALSE(address.empty());

  // Registers again from the same address, as a worker that lost touch does, holding its rank.
  v1::RegisterWorkerRequest again;
  again.set_address(address);
  v1::HeldShard* held = again.add_held();
  held->set_job_id(job.id());
  held->set_rank(1);
  held->set_world_size(4);
  v1::RegisterWorkerResponse registered;
  grpc::Status s = stub_->RegisterWorker(Context().get(), again, &registered);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_NE(registered.worker_id(), old_id);
  EXPECT_EQ(registered.unload_job_ids_size(), 0);
  v1::ListWorkersResponse workers = Workers();
  ExpectListedOnce(workers);
  for (const auto& w : workers.workers()) {
    if (w.address() != address) continue;
    EXPECT_EQ(w.worker_id(), registered.worker_id());
    EXPECT_EQ(w.job_id(), job.id());
    EXPECT_EQ(w.rank(), 1);
  }
  v1::Job kept = GetJob(job.id());
  EXPECT_EQ(kept.state(), v1::READY) << kept.failure_cause();
  ASSERT_EQ(kept.ranks_size(), 4);
  EXPECT_EQ(kept.ranks(1).worker_id(), registered.worker_id());
  EXPECT_LE(InferDiff(job.id()), 1e-5f);
  // The real worker registers again by itself (its heartbeats get NOT_FOUND).
  const std::string log = WorkerLog(static_cast<size_t>(spawn_index_[static_cast<size_t>(index)]));
  EXPECT_TRUE(PollFor(10, [&] { return Count(ReadAll(log), "registered with") == 2; })) << ReadAll(log);
  const std::string own_id = IdOf(index);
  EXPECT_NE(own_id, registered.worker_id());
  workers = Workers();
  ExpectListedOnce(workers);
  for (const auto& w : workers.workers()) {
    if (w.address() == address) {
      EXPECT_EQ(w.worker_id(), own_id);
    }
  }
  kept = GetJob(job.id());
  EXPECT_EQ(kept.state(), v1::READY) << kept.failure_cause();
  EXPECT_EQ(kept.ranks(1).worker_id(), own_id);
  EXPECT_LE(InferDiff(job.id()), 1e-5f);

  // Again from rank 2's address, without its shard: the job fails naming the worker.
  std::string rank2_id;
  ASSERT_GE(WorkerServing(job.id(), 2, &rank2_id), 0);
  again.set_address(kept.ranks(2).worker_address());
  again.clear_held();
  s = stub_->RegisterWorker(Context().get(), again, &registered);
  ASSERT_TRUE(s.ok()) << s.error_message();
  const v1::Job failed = GetJob(job.id());
  EXPECT_EQ(failed.state(), v1::FAILED);
  EXPECT_EQ(failed.failure_cause(), "worker " + rank2_id + " (rank 2) at " + kept.ranks(2).worker_address() +
                                        " registered again without its shard");
  EXPECT_TRUE(WaitUnloadedEverywhere(job.id()));
  // Its real worker still held rank 2 and was told to drop it when it registered again (what
  // CancelPendingAndLoadingJobs checks no worker had to be told).
  const int rank2 = IndexOfId(rank2_id);
  ASSERT_GE(rank2, 0);
  EXPECT_NE(ReadAll(WorkerLog(static_cast<size_t>(spawn_index_[static_cast<size_t>(rank2)])))
                .find("unloading job " + job.id() + ": the coordinator does not keep it here"),
            std::string::npos);
  EXPECT_TRUE(PollFor(10, [&] { return HealthyIdle() == 4; })) << Workers().DebugString();
  ExpectListedOnce(Workers());

  // Stopped past the threshold (3 heartbeat intervals), then continued: unhealthy, then the same
  // entry healthy again, not a second one.
  const std::string stopped_id = IdOf(0);
  ASSERT_EQ(kill(workers_[0], SIGSTOP), 0);
  stopped_.push_back(workers_[0]);
  const auto state_of = [&](const std::string& id) {
    for (const auto& w : ListedWorkers()) {
      if (w.worker_id() == id) return w.healthy() ? 1 : 0;
    }
    return -1;
  };
  EXPECT_TRUE(PollFor(15, [&] { return state_of(stopped_id) == 0; })) << Workers().DebugString();
  ASSERT_EQ(kill(workers_[0], SIGCONT), 0);
  stopped_.clear();
  EXPECT_TRUE(PollFor(10, [&] { return HealthyIdle() == 4; })) << Workers().DebugString();
  EXPECT_EQ(state_of(stopped_id), 1);
  ExpectListedOnce(Workers());
  v1::Job next;
  ASSERT_NO_FATAL_FAILURE(SubmitUntilServing(&next));
}

// 8. WatchJob: an unknown id is NOT_FOUND; a watch past its deadline ends DEADLINE_EXCEEDED; a
// watcher that goes away ends its call. The coordinator keeps answering throughout, the watched job
// is unaffected and starts as usual, and nothing left over keeps the coordinator from stopping
// promptly.
TEST_F(BehaviourCluster, WatchJobErrorsLeaveTheCoordinatorServing) {
  v1::GetJobRequest unknown;
  unknown.set_job_id("job-that-does-not-exist");
  {
    auto context = Context(10);
    auto reader = stub_->WatchJob(context.get(), unknown);
    v1::JobEvent event;
    EXPECT_FALSE(reader->Read(&event));
    const grpc::Status s = reader->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
    EXPECT_EQ(s.error_message(), "no job job-that-does-not-exist");
  }
  const v1::Job running = Submit(kModel);
  ASSERT_EQ(Watch(running.id()).job().state(), v1::READY);
  const v1::Job waiting = Submit(kModel);
  ASSERT_EQ(waiting.state(), v1::PENDING);
  v1::GetJobRequest request;
  request.set_job_id(waiting.id());
  {
    auto context = Context(2);
    const auto start = std::chrono::steady_clock::now();
    auto reader = stub_->WatchJob(context.get(), request);
    v1::JobEvent event;
    ASSERT_TRUE(reader->Read(&event));
    EXPECT_EQ(event.job().state(), v1::PENDING);
    while (reader->Read(&event)) {
    }
    const grpc::Status s = reader->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << s.error_message();
    EXPECT_TRUE(DeadlineMessage(s, "job " + waiting.id() + " is still PENDING")) << s.error_message();
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  }
  v1::ListJobsResponse jobs;
  ASSERT_TRUE(stub_->ListJobs(Context().get(), v1::ListJobsRequest(), &jobs).ok());
  EXPECT_EQ(jobs.jobs_size(), 2);
  EXPECT_EQ(GetJob(waiting.id()).state(), v1::PENDING);

  // Watchers that go away, several at once.
  for (int w = 0; w < 4; ++w) {
    auto context = Context(60);
    auto reader = stub_->WatchJob(context.get(), request);
    v1::JobEvent event;
    ASSERT_TRUE(reader->Read(&event));  // the call is open on the server
    context->TryCancel();
    while (reader->Read(&event)) {
    }
    const grpc::Status s = reader->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::CANCELLED) << s.error_message();
    EXPECT_TRUE(CancelledMessage(s, "watcher went away")) << s.error_message();
  }
  jobs.Clear();
  ASSERT_TRUE(stub_->ListJobs(Context().get(), v1::ListJobsRequest(), &jobs).ok());
  EXPECT_EQ(jobs.jobs_size(), 2);
  EXPECT_EQ(GetJob(waiting.id()).state(), v1::PENDING);
  EXPECT_LE(InferDiff(running.id()), 1e-5f);
  v1::Job cancelled;
  ASSERT_TRUE(Cancel(running.id(), &cancelled).ok());
  const v1::JobEvent started = Watch(waiting.id());
  ASSERT_EQ(started.job().state(), v1::READY) << started.job().failure_cause();
  EXPECT_LE(InferDiff(waiting.id()), 1e-5f);
  // No watch handler is left behind: the coordinator drains at once (--drain_timeout is 10 s).
  const auto stopping = std::chrono::steady_clock::now();
  StopCoordinator();
  EXPECT_LT(std::chrono::steady_clock::now() - stopping, std::chrono::seconds(5));
}

}  // namespace
}  // namespace bertshard
