// Jobs found by name (SubmitJobRequest.name) and Cluster::ResolveJob, with fake worker daemons on
// loopback (fake_worker.h): a name is stored with the job, unique among the jobs that have not
// ended, free again once its job ends; requests that name no job get --default_job or the only
// serving one.
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include "gtest/gtest.h"
#include "server/cluster.h"
#include "server/fake_worker.h"

namespace bertshard::server {
namespace {

class JobLookupTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::filesystem::path dir = std::filesystem::path(testing::TempDir()) / "lookup_model";
    std::filesystem::create_directories(dir);
    std::ofstream(dir / "config.json") << R"({"architectures": ["BertForMaskedLM"]})";
    checkpoint_ = dir.string();
    ClusterOptions options;
    options.database_path = (std::filesystem::path(testing::TempDir()) / "lookup_jobs.db").string();
    std::filesystem::remove(options.database_path);
    options.heartbeat_interval = absl::Hours(1);  // the fakes never heartbeat
    auto cluster = Cluster::Create(options);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = *std::move(cluster);
  }

  // A one-rank job on a new fake worker, READY (or its error).
  absl::StatusOr<v1::Job> Serve(const std::string& name) {
    v1::SubmitJobRequest submit;
    submit.mutable_request()->set_checkpoint(checkpoint_);
    submit.set_name(name);
    absl::StatusOr<v1::Job> job = cluster_->SubmitJob(submit, "test");
    if (!job.ok()) return job;
    workers_.push_back(std::make_unique<FakeWorker>());
    v1::RegisterWorkerRequest request;
    request.set_address(workers_.back()->Address());
    cluster_->RegisterWorker(request);
    v1::Job last;
    const absl::Status watched = cluster_->WatchJob(
        job->id(), absl::Now() + absl::Seconds(60),
        [&](const v1::JobEvent& e) {
          last = e.job();
          return true;
        },
        nullptr);
    if (!watched.ok()) return watched;
    return last;
  }

  std::string checkpoint_;
  std::vector<std::unique_ptr<FakeWorker>> workers_;
  std::unique_ptr<Cluster> cluster_;  // last: goes first
};

TEST_F(JobLookupTest, FindsAJobByIdNameOrAsTheOnlyServingOne) {
  absl::StatusOr<v1::Job> minilm = Serve("minilm");
  ASSERT_TRUE(minilm.ok()) << minilm.status();
  ASSERT_EQ(minilm->state(), v1::READY) << minilm->DebugString();
  EXPECT_EQ(minilm->name(), "minilm");
  EXPECT_EQ(cluster_->GetJob(minilm->id())->name(), "minilm");  // stored with the job
  EXPECT_EQ(*cluster_->ResolveJob("minilm"), minilm->id());
  EXPECT_EQ(*cluster_->ResolveJob(minilm->id()), minilm->id());
  EXPECT_EQ(*cluster_->ResolveJob(""), minilm->id());  // the only serving job
  const absl::Status unknown = cluster_->ResolveJob("bge").status();
  EXPECT_EQ(unknown.code(), absl::StatusCode::kNotFound) << unknown;

  absl::StatusOr<v1::Job> other = Serve("");
  ASSERT_TRUE(other.ok()) << other.status();
  const absl::Status ambiguous = cluster_->ResolveJob("").status();
  EXPECT_EQ(ambiguous.code(), absl::StatusCode::kFailedPrecondition) << ambiguous;
  EXPECT_NE(ambiguous.message().find("minilm"), std::string::npos) << ambiguous;
  EXPECT_NE(ambiguous.message().find(other->id()), std::string::npos) << ambiguous;
  EXPECT_EQ(*cluster_->ResolveJob("", "minilm"), minilm->id());  // --default_job
  EXPECT_EQ(*cluster_->ResolveJob("", other->id()), other->id());
  EXPECT_EQ(cluster_->ResolveJob("", "bge").status().code(), absl::StatusCode::kNotFound);
  // Infer and Embed take the name for the id: the request reaches the job (which then refuses an
  // Embed on a masked LM: it got that far).
  v1::EmbedRequest embed;
  embed.set_job_id("minilm");
  embed.mutable_text()->add_texts("x");
  const absl::Status by_name = cluster_->Embed(embed, absl::Now() + absl::Seconds(10)).status();
  EXPECT_EQ(by_name.code(), absl::StatusCode::kFailedPrecondition) << by_name;
  EXPECT_NE(by_name.message().find("BertModel"), std::string::npos) << by_name;
  const std::vector<Cluster::ServingJob> serving = cluster_->ServingJobs();
  ASSERT_EQ(serving.size(), 2u);
  EXPECT_TRUE(serving[0].name == "minilm" || serving[1].name == "minilm");
}

TEST_F(JobLookupTest, ANameIsUniqueAmongLiveJobsAndFreeOnceItsJobEnds) {
  absl::StatusOr<v1::Job> first = Serve("minilm");
  ASSERT_TRUE(first.ok()) << first.status();
  v1::SubmitJobRequest again;
  again.mutable_request()->set_checkpoint(checkpoint_);
  again.set_name("minilm");
  const absl::Status taken = cluster_->SubmitJob(again, "test").status();
  EXPECT_EQ(taken.code(), absl::StatusCode::kAlreadyExists) << taken;
  EXPECT_NE(taken.message().find(first->id()), std::string::npos) << taken;
  again.set_name("job-7");
  EXPECT_EQ(cluster_->SubmitJob(again, "test").status().code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(cluster_->CancelJob(first->id()).ok());
  // Ended: its id is still found (the store says what became of it), its name no more.
  EXPECT_EQ(*cluster_->ResolveJob(first->id()), first->id());
  EXPECT_EQ(cluster_->ResolveJob("minilm").status().code(), absl::StatusCode::kNotFound);
  absl::StatusOr<v1::Job> second = Serve("minilm");
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(*cluster_->ResolveJob("minilm"), second->id());
}

}  // namespace
}  // namespace bertshard::server
