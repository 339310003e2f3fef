// An Unload that arrives while the same job's LoadShard still runs (the coordinator lost the
// job's group mid-load, and its cancel of the load may not reach the worker): the load ends
// CANCELLED instead of keeping a stale shard under a job id the coordinator may place here again.
// Its own binary: the pause point reads $BERTSHARD_FAULT_DIR once per process.
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "planner/planner.h"
#include "worker/worker_service.h"

namespace bertshard::worker {
namespace {

constexpr char kModel[] = "tests/testdata/model/masked_lm_untied";
const std::string kSecret(32, 's');

std::unique_ptr<grpc::ClientContext> Context() {
  auto c = std::make_unique<grpc::ClientContext>();
  c->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  return c;
}

// Whether a process reached pause point `name` in `dir` (its "<name>.<pid>.reached" marker).
bool Reached(const std::filesystem::path& dir, const std::string& name) {
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string file = entry.path().filename().string();
    if (file.rfind(name + ".", 0) == 0 && file.size() > 8 && file.substr(file.size() - 8) == ".reached") return true;
  }
  return false;
}

TEST(WorkerService, ALoadUnloadedWhileItRunsIsNotKept) {
  const std::filesystem::path faults = std::filesystem::path(testing::TempDir()) / "faults";
  std::filesystem::create_directories(faults);
  ASSERT_EQ(setenv("BERTSHARD_FAULT_DIR", faults.c_str(), 1), 0);
  std::ofstream(faults / "worker_load.hold") << "";

  WorkerService service{WorkerServiceOptions()};
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  auto stub =
      v1::Worker::NewStub(grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));

  v1::PlanRequest request;
  request.set_checkpoint(kModel);
  auto plan = planner::Plan(request);  // one rank: no peer to wait for
  ASSERT_TRUE(plan.ok()) << plan.status();
  const auto load = [&](grpc::Status* status) {
    v1::ReservePortRequest reserve;
    reserve.set_job_id("job-1");
    reserve.set_rendezvous_secret(kSecret);
    v1::ReservePortResponse reserved;
    ASSERT_TRUE(stub->ReservePort(Context().get(), reserve, &reserved).ok());
    v1::LoadShardRequest shard;
    shard.set_job_id("job-1");
    *shard.mutable_plan() = *plan;
    shard.set_checkpoint(kModel);
    shard.set_master_port(reserved.port());
    shard.set_rendezvous_secret(kSecret);
    shard.set_timeout_seconds(30);
    auto context = Context();
    auto reader = stub->LoadShard(context.get(), shard);
    v1::LoadProgress progress;
    while (reader->Read(&progress)) {
    }
    *status = reader->Finish();
  };

  grpc::Status first;
  std::thread loading([&] { load(&first); });
  // The load is under way (stopped before its first tensor) when the Unload comes.
  while (!Reached(faults, "worker_load")) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  v1::UnloadRequest unload;
  unload.set_job_id("job-1");
  v1::UnloadResponse unloaded;
  ASSERT_TRUE(stub->Unload(Context().get(), unload, &unloaded).ok());
  EXPECT_FALSE(unloaded.was_loaded());  // not loaded yet
  std::filesystem::remove(faults / "worker_load.hold");
  loading.join();
  EXPECT_EQ(first.error_code(), grpc::StatusCode::CANCELLED) << first.error_message();
  EXPECT_NE(first.error_message().find("job job-1 was unloaded while it loaded here"), std::string::npos)
      << first.error_message();
  EXPECT_EQ(service.loaded_jobs(), 0);
  EXPECT_TRUE(service.HeldShards().empty());

  // A load of the same job id after the Unload is kept: nothing of the old one lingers.
  grpc::Status second;
  load(&second);
  EXPECT_TRUE(second.ok()) << second.error_message();
  EXPECT_EQ(service.loaded_jobs(), 1);
  server->Shutdown();
}

}  // namespace
}  // namespace bertshard::worker
