// Smaller shapes (ClusterOptions::smaller_shapes, scheduler_smaller.cc): a replica that lost a
// worker and finds no spare serves in a smaller shape on the workers it has, and grows back when
// workers return. Fake workers on loopback; the plans they are sent say the shape.
#include <filesystem>
#include <thread>

#include "gtest/gtest.h"
#include "server/replica_keys.h"
#include "server/scheduler_test_fixture.h"

namespace bertshard::server {
namespace {

class SmallerShapesTest : public SchedulerTest {
 protected:
  void SetUp() override {
    SchedulerTest::SetUp();
    options_.smaller_shapes = true;
    Start();
  }
  // Watches the job until `done` holds for it (or it is READY or ended); returns the last seen.
  v1::Job WatchUntil(const std::string& id, const std::function<bool(const v1::Job&)>& done) {
    v1::Job last;
    const absl::Status watched = scheduler_->WatchJob(
        id, absl::Now() + absl::Seconds(60),
        [&](const v1::JobEvent& e) {
          last = e.job();
          return !done(last);
        },
        nullptr);
    // Ended by `emit`: CANCELLED.
    EXPECT_TRUE(watched.ok() || watched.code() == absl::StatusCode::kCancelled) << watched;
    return last;
  }
  static int LastWorld(const FakeWorker& worker) {
    const std::vector<v1::LoadShardRequest> loads = worker.Loads();
    return loads.empty() ? 0 : loads.back().plan().world_size();
  }
};

TEST_F(SmallerShapesTest, ALostReplicaServesSmallerOnTheWorkerItKeptAndGrowsBackWhenOneReturns) {
  FakeWorker a, b;
  const std::string a_id = Register(a);
  const std::string b_id = Register(b);
  const v1::Job ready = Settled(Submit(2).id());
  ASSERT_EQ(ready.state(), v1::READY);
  ASSERT_TRUE(Leave(b_id));
  // No spare: `a` serves alone, TP 1, keeping what it holds (it is never told to unload).
  const v1::Job smaller = Settled(ready.id());
  ASSERT_EQ(smaller.state(), v1::READY) << smaller.DebugString();
  ASSERT_EQ(smaller.replica_status_size(), 1);
  EXPECT_EQ(smaller.replica_status(0).smaller_shape(), "TP 1 x PP 1, FP32, " + checkpoint_);
  EXPECT_NE(smaller.degraded().find("serves in a smaller shape (TP 1 x PP 1"), std::string::npos) << smaller.degraded();
  EXPECT_NE(smaller.degraded().find("until 2 workers can hold its own: lost worker " + b_id), std::string::npos)
      << smaller.degraded();
  ASSERT_EQ(smaller.ranks_size(), 1);
  EXPECT_EQ(smaller.ranks(0).worker_id(), a_id);
  EXPECT_EQ(LastWorld(a), 1);
  EXPECT_TRUE(a.Loads().back().keep_held());
  EXPECT_NE(smaller.history(smaller.history_size() - 3).reason().find("in a smaller shape, TP 1 x PP 1"),
            std::string::npos)
      << smaller.DebugString();
  // Its forwards go to the one worker.
  absl::StatusOr<ForwardTarget> target = scheduler_->NextForward(ready.id(), 0, absl::Now() + absl::Seconds(5));
  ASSERT_TRUE(target.ok()) << target.status();
  EXPECT_EQ(target->ranks.size(), 1u);
  scheduler_->EndForward(ready.id(), target->replica, target->generation);

  // A worker comes: the replica unloads and is placed in its own shape on both.
  FakeWorker c;
  const std::string c_id = Register(c);
  const v1::Job back = Settled(ready.id());
  ASSERT_EQ(back.state(), v1::READY) << back.DebugString();
  EXPECT_EQ(back.replica_status(0).smaller_shape(), "");
  EXPECT_EQ(back.degraded(), "");
  ASSERT_EQ(back.ranks_size(), 2);
  EXPECT_EQ(back.ranks(0).worker_id(), a_id);
  EXPECT_EQ(back.ranks(1).worker_id(), c_id);
  EXPECT_EQ(LastWorld(a), 2);
  EXPECT_EQ(LastWorld(c), 2);
  EXPECT_TRUE(a.Loads().back().keep_held());
  EXPECT_EQ(a.Unloads(), 0);
  bool grew_back = false;
  for (const v1::StateChange& change : back.history()) {
    grew_back |= change.reason().find("growing back from TP 1 x PP 1") != std::string::npos;
  }
  EXPECT_TRUE(grew_back) << back.DebugString();
}

TEST_F(SmallerShapesTest, GrowingBackWaitsForTheForwardInFlightAndTakesNoOther) {
  FakeWorker a, b;
  Register(a);
  const std::string b_id = Register(b);
  const v1::Job ready = Settled(Submit(2).id());
  ASSERT_TRUE(Leave(b_id));
  ASSERT_EQ(Settled(ready.id()).replica_status(0).smaller_shape(), "TP 1 x PP 1, FP32, " + checkpoint_);
  absl::StatusOr<ForwardTarget> held = scheduler_->NextForward(ready.id(), 0, absl::Now() + absl::Seconds(5));
  ASSERT_TRUE(held.ok()) << held.status();
  FakeWorker c;
  Register(c);
  // Room to grow, but its forward runs: it serves on, and the next batch waits for the whole shape.
  EXPECT_EQ(scheduler_->GetJob(ready.id())->state(), v1::READY);
  absl::StatusOr<ForwardTarget> next = absl::UnknownError("not returned");
  std::thread batch([&] { next = scheduler_->NextForward(ready.id(), 0, absl::Now() + absl::Seconds(60)); });
  scheduler_->EndForward(ready.id(), held->replica, held->generation);
  batch.join();
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->ranks.size(), 2u);
  EXPECT_NE(next->generation, held->generation);
}

TEST_F(SmallerShapesTest, ASmallerShapeThatCannotLoadIsNotTriedAgain) {
  FakeWorker a, b;
  Register(a);
  const std::string b_id = Register(b);
  const v1::Job ready = Settled(Submit(2).id());
  a.SetLoadStatus(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "out of memory"));
  ASSERT_TRUE(Leave(b_id));
  const v1::Job waiting = WatchUntil(ready.id(), [](const v1::Job& job) {
    return job.pending_reason().find("waiting for 2") != std::string::npos &&
           job.pending_reason().find("loading the smaller shape") != std::string::npos;
  });
  EXPECT_EQ(waiting.state(), v1::PENDING) << waiting.DebugString();
  EXPECT_NE(waiting.pending_reason().find("(loading the smaller shape TP 1 x PP 1"), std::string::npos)
      << waiting.pending_reason();
  EXPECT_NE(waiting.pending_reason().find("out of memory"), std::string::npos) << waiting.pending_reason();
  EXPECT_EQ(waiting.restarts(), 1);  // the loss that made it smaller: none spent on the smaller load
  EXPECT_EQ(a.Loads().size(), 2u);   // the first, and the smaller one: not again
  // Its own shape when a worker comes.
  a.SetLoadStatus(grpc::Status::OK);
  FakeWorker c;
  Register(c);
  const v1::Job back = Settled(ready.id());
  ASSERT_EQ(back.state(), v1::READY) << back.DebugString();
  EXPECT_EQ(back.ranks_size(), 2);
  EXPECT_EQ(LastWorld(a), 2);
}

// A worker lost during a smaller load is a loss like any: counted, and the smaller shape tried
// again (only a refusal of the shape itself rules it out); past --max_restarts (2) the job ends.
TEST_F(SmallerShapesTest, ASmallerLoadLostToAPassingFailureIsALossLikeAny) {
  FakeWorker a, b;
  Register(a);
  const std::string b_id = Register(b);
  const v1::Job ready = Settled(Submit(2).id());
  a.SetLoadStatus(grpc::Status(grpc::StatusCode::UNAVAILABLE, "a peer went away"));
  ASSERT_TRUE(Leave(b_id));
  const v1::Job ended = Settled(ready.id());
  EXPECT_EQ(ended.state(), v1::FAILED) << ended.DebugString();
  EXPECT_EQ(a.Loads().size(), 3u);  // its first, and the smaller shape twice
  EXPECT_NE(ended.failure_cause().find("loading the smaller shape TP 1 x PP 1"), std::string::npos)
      << ended.failure_cause();
}

// Placed again in its own shape on a spare: the worker it kept takes its own rank back and keeps
// its shard (no unload); the spare takes the lost rank.
TEST_F(SmallerShapesTest, AKeptWorkerTakesItsOwnRankBackBesideASpare) {
  FakeWorker a, b, spare;
  const std::string a_id = Register(a);
  const std::string b_id = Register(b);
  const v1::Job ready = Settled(Submit(2).id());
  ASSERT_EQ(ready.ranks(0).worker_id(), a_id);
  const std::string spare_id = Register(spare);
  ASSERT_TRUE(Leave(a_id));  // rank 0's worker
  const v1::Job back = Settled(ready.id());
  ASSERT_EQ(back.state(), v1::READY) << back.DebugString();
  ASSERT_EQ(back.ranks_size(), 2);
  EXPECT_EQ(back.ranks(0).worker_id(), spare_id);
  EXPECT_EQ(back.ranks(1).worker_id(), b_id);  // its rank, not rank 0 (the first free)
  EXPECT_EQ(back.replica_status(0).smaller_shape(), "");
  EXPECT_EQ(b.Unloads(), 0);
  ASSERT_EQ(b.Loads().size(), 2u);
  EXPECT_EQ(b.Loads().back().rank(), 1);
  EXPECT_TRUE(b.Loads().back().keep_held());
}

// Kept workers that a smaller shape does not need go back to the pool, told to drop their shards.
TEST_F(SmallerShapesTest, KeptWorkersTheSmallerShapeDoesNotNeedAreReleased) {
  FakeWorker a, b, c;
  const std::string a_id = Register(a);
  const std::string b_id = Register(b);
  const std::string c_id = Register(c);
  const v1::Job ready = Settled(Submit(3).id());  // TP 3: only TP 1 is smaller
  ASSERT_EQ(ready.state(), v1::READY);
  ASSERT_TRUE(Leave(c_id));
  const v1::Job smaller = Settled(ready.id());
  ASSERT_EQ(smaller.state(), v1::READY) << smaller.DebugString();
  ASSERT_EQ(smaller.ranks_size(), 1);
  EXPECT_EQ(smaller.ranks(0).worker_id(), a_id);  // a tie: the lower rank it held
  EXPECT_TRUE(b.WaitForUnload(ReplicaKey(ready.id(), 0)));
  EXPECT_EQ(a.Unloads(), 0);
  // Idle once the coordinator has its answer (polled: nothing signals it to the test).
  for (int i = 0; i < 10000 && pool_->Idle().empty(); ++i) absl::SleepFor(absl::Milliseconds(1));
  ASSERT_EQ(pool_->Idle().size(), 1u);
  EXPECT_EQ(pool_->Idle().front().worker_id, b_id);
}

// Marked to grow back while its forward ran, and the room gone when it ended (the worker it would
// have taken left): it serves on in the smaller shape, not cut off for a placement that cannot be.
TEST_F(SmallerShapesTest, AGrowBackWhoseRoomWentWhileItsForwardRanDoesNotHappen) {
  FakeWorker a, b;
  Register(a);
  const std::string b_id = Register(b);
  const v1::Job ready = Settled(Submit(2).id());
  ASSERT_TRUE(Leave(b_id));
  ASSERT_NE(Settled(ready.id()).replica_status(0).smaller_shape(), "");
  absl::StatusOr<ForwardTarget> held = scheduler_->NextForward(ready.id(), 0, absl::Now() + absl::Seconds(5));
  ASSERT_TRUE(held.ok()) << held.status();
  FakeWorker c;
  const std::string c_id = Register(c);  // room: marked to grow back
  ASSERT_TRUE(Leave(c_id));              // and gone
  const size_t loads = a.Loads().size();
  scheduler_->EndForward(ready.id(), held->replica, held->generation);
  const v1::Job after = *scheduler_->GetJob(ready.id());
  EXPECT_EQ(after.state(), v1::READY) << after.DebugString();
  EXPECT_NE(after.replica_status(0).smaller_shape(), "");
  EXPECT_EQ(a.Loads().size(), loads);
  absl::StatusOr<ForwardTarget> next = scheduler_->NextForward(ready.id(), 0, absl::Now() + absl::Seconds(5));
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->generation, held->generation);  // the same placement serves on
}

// A kept worker that registers again holding its shard (a restarted worker process that kept its
// state, or a new id after a network blip) stays kept under its new id, and takes its rank back.
TEST_F(SmallerShapesTest, AKeptWorkerThatRegistersAgainWithItsShardIsKeptUnderItsNewId) {
  options_.restarts.backoff_initial = absl::Milliseconds(300);
  options_.restarts.max_restarts = 5;
  Start();
  FakeWorker a, b, spare, second_spare;
  const std::string a_id = Register(a);
  const std::string b_id = Register(b);
  const v1::Job ready = Settled(Submit(2).id());
  ASSERT_TRUE(Leave(b_id));  // restart 1, at once: TP 1 on a
  ASSERT_NE(Settled(ready.id()).replica_status(0).smaller_shape(), "");
  const std::string spare_id = Register(spare);  // grows back on a and the spare
  const v1::Job grown = Settled(ready.id());
  ASSERT_EQ(grown.ranks_size(), 2) << grown.DebugString();
  ASSERT_EQ(grown.ranks(0).worker_id(), a_id);
  ASSERT_TRUE(Leave(spare_id));  // restart 2: it waits out its backoff, keeping a
  ASSERT_EQ(scheduler_->GetJob(ready.id())->state(), v1::PENDING);
  v1::RegisterWorkerRequest again;
  again.set_address(a.Address());
  v1::HeldShard* shard = again.add_held();
  shard->set_job_id(ReplicaKey(ready.id(), 0));
  shard->set_rank(0);
  shard->set_world_size(2);
  const std::string a_again = scheduler_->RegisterWorker(again).worker_id();
  ASSERT_NE(a_again, a_id);
  Register(second_spare);
  const v1::Job back = Settled(ready.id());
  ASSERT_EQ(back.state(), v1::READY) << back.DebugString();
  EXPECT_EQ(back.replica_status(0).smaller_shape(), "") << back.DebugString();
  ASSERT_EQ(back.ranks_size(), 2);
  EXPECT_EQ(back.ranks(0).worker_id(), a_again);
}

// A loss in a load keeps no worker: the one whose load failed may fail again. It is told to unload
// before anything else reaches it, as without --smaller_shapes (kept, it would be loaded again at
// once, and again, until --max_restarts ended the job).
TEST_F(SmallerShapesTest, ALossInALoadKeepsNoWorker) {
  FakeWorker a, b, spare;
  const std::string a_id = Register(a);
  Register(b);
  const v1::Job ready = Settled(Submit(2).id());
  Register(spare);
  b.SetLoadStatus(grpc::Status(grpc::StatusCode::INTERNAL, "the disk is on fire"));
  ASSERT_TRUE(Leave(a_id));  // b kept, placed again with the spare: its load fails
  Settled(ready.id());       // READY on the spare, or FAILED past --max_restarts: either
  ASSERT_TRUE(b.WaitForUnload(ReplicaKey(ready.id(), 0)));
  const std::vector<std::string> events = b.Events();
  ASSERT_GE(events.size(), 3u);
  EXPECT_EQ(events[0], "load");
  EXPECT_EQ(events[1], "load");  // the one that failed
  EXPECT_EQ(events[2], "unload");
}

// A coordinator restart takes a replica back in the smaller shape it served in (its ranks are
// stored with it), still degraded; it grows back when a worker comes, keeping what it holds.
TEST_F(SmallerShapesTest, ARestartTakesASmallerReplicaBackInItsShape) {
  store_path_ = std::string(testing::TempDir()) + "/smaller_restart.db";
  std::filesystem::remove(store_path_);
  options_.readopt_grace = absl::Hours(1);  // only the workers' own reports decide
  Start();
  FakeWorker a, b, spare;
  Register(a);
  const std::string b_id = Register(b);
  const v1::Job ready = Settled(Submit(2).id());
  ASSERT_TRUE(Leave(b_id));
  const v1::Job smaller = Settled(ready.id());
  ASSERT_EQ(smaller.replica_status(0).smaller_shape(), "TP 1 x PP 1, FP32, " + checkpoint_);
  ASSERT_EQ(smaller.ranks_size(), 1);
  EXPECT_EQ(smaller.ranks(0).smaller_tp(), 1);
  EXPECT_EQ(smaller.ranks(0).smaller_pp(), 1);
  Start();  // the coordinator restarts; the store stays
  v1::RegisterWorkerRequest back;
  back.set_address(a.Address());
  v1::HeldShard* held = back.add_held();
  held->set_job_id(ReplicaKey(ready.id(), 0));
  held->set_rank(0);
  held->set_world_size(1);  // the smaller shape's world
  held->set_next_sequence(3);
  const v1::RegisterWorkerResponse registered = scheduler_->RegisterWorker(back);
  EXPECT_EQ(registered.unload_job_ids_size(), 0);
  const v1::Job adopted = Settled(ready.id());
  ASSERT_EQ(adopted.state(), v1::READY) << adopted.DebugString();
  EXPECT_EQ(adopted.recovering(), "");
  EXPECT_EQ(adopted.replica_status(0).smaller_shape(), "TP 1 x PP 1, FP32, " + checkpoint_);
  EXPECT_NE(adopted.degraded().find("serves in a smaller shape"), std::string::npos) << adopted.degraded();
  EXPECT_EQ(a.Loads().size(), 2u);  // taken back, not loaded again
  absl::StatusOr<ForwardTarget> next = scheduler_->NextForward(ready.id(), 0, absl::Now() + absl::Seconds(5));
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->sequence, 3);
  EXPECT_EQ(next->ranks.size(), 1u);
  scheduler_->EndForward(ready.id(), next->replica, next->generation);
  Register(spare);
  const v1::Job grown = Settled(ready.id());
  ASSERT_EQ(grown.state(), v1::READY) << grown.DebugString();
  EXPECT_EQ(grown.replica_status(0).smaller_shape(), "");
  EXPECT_EQ(grown.ranks_size(), 2);
  EXPECT_EQ(grown.ranks(0).smaller_tp(), 0);
  EXPECT_TRUE(a.Loads().back().keep_held());
}

TEST_F(SmallerShapesTest, WithoutTheOptionAReplicaWaitsForItsOwnShape) {
  options_.smaller_shapes = false;
  Start();
  FakeWorker a, b;
  Register(a);
  const std::string b_id = Register(b);
  const v1::Job ready = Settled(Submit(2).id());
  ASSERT_TRUE(Leave(b_id));
  EXPECT_TRUE(a.WaitForUnload(ReplicaKey(ready.id(), 0)));
  FakeWorker c;
  Register(c);
  const v1::Job back = Settled(ready.id());
  ASSERT_EQ(back.state(), v1::READY) << back.DebugString();
  EXPECT_EQ(back.ranks_size(), 2);
  EXPECT_EQ(a.Loads().size(), 2u);  // its first load, and its own shape again: nothing between
  EXPECT_EQ(LastWorld(a), 2);
}

}  // namespace
}  // namespace bertshard::server
