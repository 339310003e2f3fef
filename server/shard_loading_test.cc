#include "server/shard_loading.h"

#include <map>
#include <set>

#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"
#include "server/fake_worker.h"

namespace bertshard::server {
namespace {

constexpr char kNobody[] = "127.0.0.1:1";  // nothing listens: calls fail UNAVAILABLE at once
const std::string kSecret(32, 's');

RankStub Rank(const std::string& id, const std::string& address) {
  auto channel = grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
  return {id, address, v1::Worker::NewStub(channel), "", grpc::health::v1::Health::NewStub(channel)};
}

std::vector<std::shared_ptr<grpc::ClientContext>> Contexts(size_t n) {
  std::vector<std::shared_ptr<grpc::ClientContext>> contexts;
  for (size_t i = 0; i < n; ++i) {
    contexts.push_back(std::make_shared<grpc::ClientContext>());
    contexts.back()->set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
  }
  return contexts;
}

// What LoadShardsOnRanks reported, per rank.
struct Reported {
  absl::Mutex mu;
  std::map<size_t, int> progress ABSL_GUARDED_BY(mu);
  std::map<size_t, std::string> causes ABSL_GUARDED_BY(mu);
  std::map<size_t, absl::StatusCode> codes ABSL_GUARDED_BY(mu);
  std::map<size_t, std::string> unreachable ABSL_GUARDED_BY(mu);  // kUnreachableWorkerPayload
};

bool Load(const std::vector<RankStub>& ranks, Reported* reported,
          std::vector<std::shared_ptr<grpc::ClientContext>> contexts = {}) {
  if (contexts.empty()) contexts = Contexts(ranks.size());
  v1::LoadShardRequest request;
  request.set_job_id("job-1");
  request.set_master_port(4321);
  return LoadShardsOnRanks(
      ranks, request, contexts,
      [&](size_t rank, const v1::LoadProgress& progress) {
        absl::MutexLock lock(&reported->mu);
        if (progress.phase() == v1::LoadProgress::READY) ++reported->progress[rank];
      },
      [&](size_t rank, const absl::Status& failure) {
        absl::MutexLock lock(&reported->mu);
        reported->causes[rank] = std::string(failure.message());
        reported->codes[rank] = failure.code();
        const absl::optional<absl::Cord> unreachable = failure.GetPayload(kUnreachableWorkerPayload);
        if (unreachable.has_value()) reported->unreachable[rank] = std::string(*unreachable);
      });
}

TEST(ReserveRendezvousPort, RankZerosWorkerGivesThePortOrIsNamed) {
  FakeWorker worker;
  const absl::StatusOr<int32_t> port = ReserveRendezvousPort(Rank("w0", worker.Address()), "job-1", kSecret);
  ASSERT_TRUE(port.ok()) << port.status();
  EXPECT_EQ(*port, 4321);
  ASSERT_EQ(worker.Reservations().size(), 1u);
  EXPECT_EQ(worker.Reservations()[0].rendezvous_secret(), kSecret);  // the worker learns the secret
  const absl::Status refused = ReserveRendezvousPort(Rank("w0", kNobody), "job-1", kSecret).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kUnavailable) << refused;
  EXPECT_EQ(refused.message().rfind("worker w0 (rank 0): ", 0), 0u) << refused;
}

TEST(LoadShardsOnRanks, LoadsEveryRankWithItsNumberAndReportsProgress) {
  FakeWorker a, b;
  Reported reported;
  EXPECT_TRUE(Load({Rank("w0", a.Address()), Rank("w1", b.Address())}, &reported));
  absl::MutexLock lock(&reported.mu);
  EXPECT_EQ(reported.progress, (std::map<size_t, int>{{0, 1}, {1, 1}}));
  EXPECT_TRUE(reported.causes.empty());
  ASSERT_EQ(b.Loads().size(), 1u);
  EXPECT_EQ(a.Loads()[0].rank(), 0);
  EXPECT_EQ(b.Loads()[0].rank(), 1);
  EXPECT_EQ(b.Loads()[0].job_id(), "job-1");
  EXPECT_EQ(b.Loads()[0].master_port(), 4321);
}

// A rank's own error is the cause while every worker answers; once one does not, it is the cause
// of every rank's failure (its peers fail because it died).
TEST(LoadShardsOnRanks, FailuresAreBlamedOnTheWorkerThatNoLongerAnswers) {
  FakeWorker failing(grpc::Status(grpc::StatusCode::INTERNAL, "the disk is on fire")), fine;
  Reported alive;
  EXPECT_FALSE(Load({Rank("w0", failing.Address()), Rank("w1", fine.Address())}, &alive));
  {
    absl::MutexLock lock(&alive.mu);
    EXPECT_EQ(alive.causes, (std::map<size_t, std::string>{{0, "worker w0 (rank 0): the disk is on fire"}}));
    EXPECT_EQ(alive.codes[0], absl::StatusCode::kInternal);  // the worker's own code
    EXPECT_TRUE(alive.unreachable.empty());
  }
  Reported dead;
  EXPECT_FALSE(Load({Rank("w0", failing.Address()), Rank("w1", kNobody)}, &dead));
  absl::MutexLock lock(&dead.mu);
  ASSERT_EQ(dead.causes.size(), 2u);
  for (const auto& [rank, cause] : dead.causes) {
    EXPECT_EQ(cause.rfind(std::string("worker w1 (rank 1) at ") + kNobody + " is unreachable: ", 0), 0u)
        << "rank " << rank << ": " << cause;
    EXPECT_EQ(dead.codes[rank], absl::StatusCode::kUnavailable);  // a lost worker: worth placing again
    EXPECT_EQ(dead.unreachable[rank], "w1");
  }
}

TEST(LoadShardsOnRanks, ACancelledLoadSaysSo) {
  FakeWorker worker;
  auto contexts = Contexts(1);
  contexts[0]->TryCancel();
  Reported reported;
  EXPECT_FALSE(Load({Rank("w0", worker.Address())}, &reported, contexts));
  absl::MutexLock lock(&reported.mu);
  EXPECT_EQ(reported.causes, (std::map<size_t, std::string>{{0, "worker w0 (rank 0): cancelled"}}));
}

// A load refused for what it asks (the checkpoint, the request) fails on any workers: the job ends
// at once instead of being placed again; a lost or short-of-memory worker is worth another try.
TEST(LoadCanNeverSucceed, OnlyForRefusalsOfTheRequestItself) {
  EXPECT_TRUE(LoadCanNeverSucceed(absl::NotFoundError("model.safetensors: no such file")));
  EXPECT_TRUE(LoadCanNeverSucceed(absl::InvalidArgumentError("tensor shape")));
  EXPECT_TRUE(LoadCanNeverSucceed(absl::DataLossError("truncated")));
  EXPECT_FALSE(LoadCanNeverSucceed(absl::UnavailableError("worker w1 is unreachable")));
  EXPECT_FALSE(LoadCanNeverSucceed(absl::ResourceExhaustedError("out of memory")));
  EXPECT_FALSE(LoadCanNeverSucceed(absl::InternalError("gloo: connection reset")));
  EXPECT_FALSE(LoadCanNeverSucceed(absl::DeadlineExceededError("rendezvous")));
  EXPECT_FALSE(LoadCanNeverSucceed(absl::PermissionDeniedError("rank 1's proof of the rendezvous secret is wrong")));
}

TEST(UnloadShard, WaitsForTheWorkersAnswer) {
  FakeWorker worker;
  EXPECT_TRUE(UnloadShard(*Rank("w0", worker.Address()).stub, "job-8", "").ok());
  EXPECT_TRUE(worker.WaitForUnload("job-8"));
  EXPECT_FALSE(UnloadShard(*Rank("w0", kNobody).stub, "job-8", "").ok());
}

TEST(UnloadInBackground, TheWorkerIsToldToDropTheJob) {
  FakeWorker worker;
  UnloadInBackground(Rank("w0", worker.Address()).stub, "job-7", "");
  EXPECT_TRUE(worker.WaitForUnload("job-7"));
}

}  // namespace
}  // namespace bertshard::server
