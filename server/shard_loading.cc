#include "server/shard_loading.h"

#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/grpc_auth.h"

namespace bertshard::server {

absl::StatusOr<int32_t> ReserveRendezvousPort(const RankStub& rank0, const std::string& job_id,
                                              const std::string& secret) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  common::AttachToken(&context, rank0.token);
  v1::ReservePortRequest reserve;
  reserve.set_job_id(job_id);
  reserve.set_rendezvous_secret(secret);
  v1::ReservePortResponse port;
  grpc::Status status = rank0.stub->ReservePort(&context, reserve, &port);
  if (!status.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                        absl::StrCat("worker ", rank0.worker_id, " (rank 0): ", status.error_message()));
  }
  return port.port();
}

bool LoadShardsOnRanks(const std::vector<RankStub>& ranks, const v1::LoadShardRequest& request,
                       const std::vector<std::shared_ptr<grpc::ClientContext>>& contexts,
                       const std::function<void(size_t rank, const v1::LoadProgress&)>& on_progress,
                       const std::function<void(size_t rank, const absl::Status& failure)>& on_failure) {
  std::vector<std::thread> threads;
  std::vector<char> loaded(ranks.size(), 0);  // each written by its rank's thread only
  for (size_t r = 0; r < ranks.size(); ++r) {
    threads.emplace_back([&, r] {
      v1::LoadShardRequest load = request;
      load.set_rank(static_cast<int32_t>(r));
      auto reader = ranks[r].stub->LoadShard(contexts[r].get(), load);
      v1::LoadProgress progress;
      while (reader->Read(&progress)) on_progress(r, progress);
      grpc::Status status = reader->Finish();
      if (status.ok()) {
        loaded[r] = 1;
        return;
      }
      const std::string rank = absl::StrCat("worker ", ranks[r].worker_id, " (rank ", r, "): ");
      if (status.error_code() == grpc::StatusCode::CANCELLED) {
        on_failure(r, absl::CancelledError(absl::StrCat(rank, "cancelled")));
        return;
      }
      const UnreachableRank down = FindUnreachableRank(ranks);
      if (down.rank < 0) {
        on_failure(r, absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                                   absl::StrCat(rank, status.error_message())));
        return;
      }
      absl::Status lost = absl::UnavailableError(down.cause);
      lost.SetPayload(kUnreachableWorkerPayload, absl::Cord(ranks[static_cast<size_t>(down.rank)].worker_id));
      on_failure(r, lost);
    });
  }
  for (auto& t : threads) t.join();
  for (char l : loaded) {
    if (!l) return false;
  }
  return true;
}

bool LoadCanNeverSucceed(const absl::Status& failure) {
  switch (failure.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kNotFound:
    // Not PERMISSION_DENIED: the rendezvous says it when a rank's proof fails, which is a mix-up of
    // that attempt (an old group's rank on a reused port), not of the checkpoint.
    case absl::StatusCode::kUnimplemented:
    case absl::StatusCode::kDataLoss:
      return true;
    default:
      return false;
  }
}

grpc::Status UnloadShard(v1::Worker::Stub& stub, const std::string& job_id, const std::string& token) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  common::AttachToken(&context, token);
  v1::UnloadRequest unload;
  unload.set_job_id(job_id);
  v1::UnloadResponse ignored;
  return stub.Unload(&context, unload, &ignored);
}

void UnloadInBackground(std::shared_ptr<v1::Worker::Stub> stub, const std::string& job_id, const std::string& token) {
  std::thread([stub = std::move(stub), job_id, token] { UnloadShard(*stub, job_id, token); }).detach();
}

}  // namespace bertshard::server
