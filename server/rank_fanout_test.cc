#include "server/rank_fanout.h"

#include <thread>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "server/fake_worker.h"

namespace bertshard::server {
namespace {

// Answers with one output named after the worker, so a test can tell the responses apart.
FakeWorker::ForwardFn NamedAnswer(const std::string& name) {
  return [name](grpc::ServerContext*, const v1::ForwardRequest& request, v1::ForwardResponse* response) {
    v1::NamedTensor* t = response->add_outputs();
    t->set_name(name);
    t->add_shape(1);
    t->add_values(static_cast<float>(request.sequence()));
    return grpc::Status::OK;
  };
}

// Blocks until the call is cancelled or `release` is notified.
FakeWorker::ForwardFn Stuck(absl::Notification* release) {
  return [release](grpc::ServerContext* context, const v1::ForwardRequest&, v1::ForwardResponse*) {
    while (!context->IsCancelled() && !release->WaitForNotificationWithTimeout(absl::Milliseconds(10))) {
    }
    return grpc::Status::OK;
  };
}

absl::Time Soon() { return absl::Now() + absl::Seconds(30); }

v1::ForwardRequest Numbered(int64_t sequence) {
  v1::ForwardRequest forward;
  forward.set_job_id("job-1");
  forward.set_sequence(sequence);
  return forward;
}

TEST(ForwardOnAllRanks, EveryRankAnswersInRankOrder) {
  FakeWorker a(NamedAnswer("a")), b(NamedAnswer("b"));
  ForwardOutcome out = ForwardOnAllRanks({a.Rank("wa"), b.Rank("wb")}, Numbered(7), Soon());
  ASSERT_EQ(out.failed_rank, -1) << out.status.error_message();
  ASSERT_EQ(out.responses.size(), 2u);
  EXPECT_EQ(out.responses[0].outputs(0).name(), "a");
  EXPECT_EQ(out.responses[1].outputs(0).name(), "b");
  EXPECT_EQ(out.responses[1].outputs(0).values(0), 7.0f);
  ASSERT_EQ(b.requests().size(), 1u);
  EXPECT_EQ(b.requests()[0].job_id(), "job-1");
}

TEST(ForwardOnAllRanks, ReturnsAtTheFirstFailureWithoutWaitingForTheOthers) {
  absl::Notification release;
  FakeWorker stuck(Stuck(&release));
  FakeWorker failing([](grpc::ServerContext*, const v1::ForwardRequest&, v1::ForwardResponse*) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "out of order");
  });
  ForwardOutcome out = ForwardOnAllRanks({stuck.Rank("w0"), failing.Rank("w1")}, Numbered(0), Soon());
  release.Notify();  // only now: the fan-out returned while rank 0 was still in its call
  EXPECT_EQ(out.failed_rank, 1);
  EXPECT_FALSE(out.aborted);
  EXPECT_EQ(out.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(out.status.error_message(), "out of order");
  EXPECT_TRUE(out.responses.empty());
}

TEST(ForwardOnAllRanks, AbortEndsTheForwardInFlightAndEveryLaterOne) {
  absl::Notification release;
  FakeWorker stuck(Stuck(&release));
  ForwardAbort abort;
  std::thread aborter([&abort, &stuck] {
    // Abort once the forward is on the worker, so it is the one in flight that ends.
    while (stuck.requests().empty()) absl::SleepFor(absl::Milliseconds(5));
    abort.Abort("job job-1 is FAILED: worker gone");
  });
  ForwardOutcome out = ForwardOnAllRanks({stuck.Rank("w0")}, Numbered(0), Soon(), &abort);
  aborter.join();
  release.Notify();
  EXPECT_TRUE(out.aborted);
  EXPECT_EQ(out.failed_rank, -1);
  EXPECT_EQ(out.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(out.status.error_message(), "job job-1 is FAILED: worker gone");

  FakeWorker fine(NamedAnswer("fine"));
  ForwardOutcome later = ForwardOnAllRanks({fine.Rank("w1")}, Numbered(1), Soon(), &abort);
  EXPECT_TRUE(later.aborted);
  EXPECT_EQ(later.status.error_message(), "job job-1 is FAILED: worker gone");
  EXPECT_TRUE(fine.requests().empty());  // never sent
}

FakeWorker::ForwardFn Refusing(const std::string& why) {
  return [why](grpc::ServerContext*, const v1::ForwardRequest&, v1::ForwardResponse*) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, why);
  };
}

// A request every rank refuses before any collective (each taking its number) leaves the ranks in
// step: the outcome says refused, naming the first rank that refused, and no call is cancelled.
TEST(ForwardOnAllRanks, ARequestEveryRankRefusesIsARefusalNotAFailure) {
  FakeWorker a(Refusing("token id 99999 is outside the vocabulary")), b(Refusing("token id 99999 again"));
  ForwardOutcome out = ForwardOnAllRanks({a.Rank("wa"), b.Rank("wb")}, Numbered(3), Soon());
  EXPECT_TRUE(out.refused);
  EXPECT_FALSE(out.aborted);
  EXPECT_GE(out.failed_rank, 0);
  EXPECT_EQ(out.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(a.requests().size(), 1u);
  EXPECT_EQ(b.requests().size(), 1u);
  // One rank refusing what the rank holding the outputs answered (a want only it checks) is a
  // refusal too: both took the number.
  FakeWorker fine(NamedAnswer("fine"));
  out = ForwardOnAllRanks({fine.Rank("w0"), a.Rank("wa")}, Numbered(4), Soon());
  EXPECT_TRUE(out.refused);
  EXPECT_EQ(out.failed_rank, 1);
}

// A refusal while another rank is still in its call (a collective the refusing rank never joins)
// is a failure once the others have had their grace: the ranks may be out of step.
TEST(ForwardOnAllRanks, ARefusalWhileAnotherRankHangsIsAFailure) {
  absl::Notification release;
  FakeWorker stuck(Stuck(&release)), refusing(Refusing("bad"));
  ForwardOutcome out = ForwardOnAllRanks({stuck.Rank("w0"), refusing.Rank("w1")}, Numbered(0), Soon());
  release.Notify();
  EXPECT_FALSE(out.refused);
  EXPECT_EQ(out.failed_rank, 1);
  EXPECT_EQ(out.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  // And a failure of another kind beside a refusal is the failure, at once.
  FakeWorker failing([](grpc::ServerContext*, const v1::ForwardRequest&, v1::ForwardResponse*) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "out of order");
  });
  out = ForwardOnAllRanks({refusing.Rank("w1"), failing.Rank("w2")}, Numbered(1), Soon());
  EXPECT_FALSE(out.refused);
  EXPECT_EQ(out.failed_rank, 1);
  EXPECT_EQ(out.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
}

TEST(Blame, NamesTheWorkerThatNoLongerAnswers) {
  FakeWorker alive(NamedAnswer("a")), gone(NamedAnswer("b"));
  const std::vector<RankStub> ranks = {alive.Rank("wa"), gone.Rank("wb")};
  EXPECT_EQ(Blame(ranks, "first failure"), "first failure");
  const std::string address = ranks[1].address;
  gone.Shutdown();
  const std::string cause = Blame(ranks, "first failure");
  EXPECT_EQ(cause.rfind("worker wb (rank 1) at " + address + " is unreachable: ", 0), 0u) << cause;
}

}  // namespace
}  // namespace bertshard::server
