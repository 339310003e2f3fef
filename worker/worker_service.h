// File: worker/worker_service.h
// -----------------------------------------------------------------------------
// The Worker gRPC service of a worker daemon (shard-worker): loads ranks of jobs' plans (streaming
// progress), runs their forwards in the order the coordinator numbers them, and unloads them.
// Each loaded job holds its BertShard and its process groups (Gloo, or NCCL in CUDA builds).
//
// It uses gRPC's synchronous API on purpose: loading a shard and running a forward block for
// seconds, and a callback reactor must not block.
//
// Thread safety: thread-safe. Calls for different jobs run concurrently; a job's forwards run one
// at a time, in sequence order.
#ifndef BERTSHARD_WORKER_WORKER_SERVICE_H_
#define BERTSHARD_WORKER_WORKER_SERVICE_H_

#include <map>
#include <memory>
#include <string>

#include "absl/synchronization/mutex.h"
#include "bertshard/v1/worker.grpc.pb.h"

namespace bertshard::worker {

struct WorkerServiceOptions {
  int default_threads = 1;  // LibTorch threads per job when the request leaves it 0
};

class WorkerService final : public v1::Worker::Service {
 public:
  explicit WorkerService(WorkerServiceOptions options);
  ~WorkerService() override;

  grpc::Status LoadShard(grpc::ServerContext* context, const v1::LoadShardRequest* request,
                         grpc::ServerWriter<v1::LoadProgress>* writer) override;
  grpc::Status Forward(grpc::ServerContext* context, const v1::ForwardRequest* request,
                       v1::ForwardResponse* response) override;
  grpc::Status Unload(grpc::ServerContext* context, const v1::UnloadRequest* request,
                      v1::UnloadResponse* response) override;
  grpc::Status ReservePort(grpc::ServerContext* context, const v1::ReservePortRequest* request,
                           v1::ReservePortResponse* response) override;

  // Jobs loaded now.
  int loaded_jobs();

 private:
  struct LoadedJob;
  const WorkerServiceOptions options_;
  absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<LoadedJob>> jobs_ ABSL_GUARDED_BY(mu_);
};

}  // namespace bertshard::worker

#endif  // BERTSHARD_WORKER_WORKER_SERVICE_H_
