// File: worker/worker_service.h
// -----------------------------------------------------------------------------
// The Worker gRPC service of a worker daemon (shard-worker): loads ranks of jobs' plans (streaming
// progress), runs their forwards in the order the coordinator numbers them, and unloads them.
// Each loaded job holds its BertShard and its collectives (Gloo, or NCCL in CUDA builds), loaded
// and connected as every rank is (worker/shard_loader.h).
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
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "bertshard/v1/worker.grpc.pb.h"
#include "common/metrics.h"
#include "common/model_root.h"
#include "model/gemm.h"

namespace bertshard::worker {

// The worker's own figures, by job and rank (see common/metrics.h):
//   bertshard_worker_loaded_bytes_total{job,rank}        checkpoint bytes read loading the shard
//   bertshard_worker_forward_duration_seconds{job,rank}  histogram of successful forwards' time
//   bertshard_worker_forward_rows{job,rank}              histogram of rows per forward (batch size)
// A job's series exist while it loads or is loaded here: made once its LoadShard request has been
// checked, removed when the load fails or the shard is let go (so refused or made-up loads leave
// nothing behind in /metrics).
struct WorkerMetrics {
  // Registers the families in `registry` (which must outlive the service). Errors as
  // MetricsRegistry::AddCounter (ALREADY_EXISTS if the names are taken by something else).
  static absl::StatusOr<WorkerMetrics> Register(common::MetricsRegistry* registry);

  common::CounterFamily* loaded_bytes = nullptr;
  common::HistogramFamily* forward_seconds = nullptr;
  common::HistogramFamily* forward_rows = nullptr;
  // How many loads and shards hold each job's series (worker_service.cc); shared by copies.
  struct SeriesHolders;
  std::shared_ptr<SeriesHolders> holders;
};

struct WorkerServiceOptions {
  int default_threads = 1;  // LibTorch threads per job when the request leaves it 0
  // This host's name or address as the other ranks reach it (the --advertise host): the Gloo
  // transport binds to it, and the rendezvous stores ReservePort hosts listen there only. Empty:
  // the rendezvous master's address for Gloo, 127.0.0.1 for the stores (single-host loopback only).
  std::string bind_host;
  const WorkerMetrics* metrics = nullptr;  // optional; must outlive the service
  // How loaded shards multiply (model/gemm.h); nullopt ("auto"): the faster on this machine for
  // the job's shape and threads, measured at its first load and remembered.
  std::optional<model::GemmPath> gemm;
  // Where checkpoints may be read (--model_root; common/model_root.h): a load request's path is
  // resolved under it. Unconfined by default.
  common::ModelRoot model_root;
  // The cluster's bearer token (common/grpc_auth.h): every RPC needs it; empty: none does.
  std::string token;
  // How long the rendezvous store a ReservePort hosts waits for its job's rank 0 LoadShard (which
  // the coordinator sends right after it) before it is closed: a coordinator that dies in between
  // must not leave the port bound for good.
  absl::Duration port_reservation_ttl = absl::Minutes(2);
  // The GPU this worker serves (--device=cuda:N): its jobs load there and talk over NCCL, and
  // need a --config=cuda build. -1 (--device=cpu): CPU, Gloo. A load whose backend is not the
  // worker's is INVALID_ARGUMENT.
  int gpu = -1;
};

class ReservedStores;  // worker/rendezvous.h

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
  // Hosts a job's rendezvous store now, on bind_host and a port the system picks, for the
  // request's secret (INVALID_ARGUMENT without one), and answers that port; the job's rank 0
  // LoadShard with that master_port and secret then takes the store over (unclaimed, it is closed
  // after options.port_reservation_ttl). A port merely found free could be taken before rank 0
  // bound it.
  grpc::Status ReservePort(grpc::ServerContext* context, const v1::ReservePortRequest* request,
                           v1::ReservePortResponse* response) override;

  // Jobs loaded now.
  int loaded_jobs();

  // What this worker holds, for its registration and heartbeats. Never waits for a running
  // forward (that shard is reported with forward_running set).
  std::vector<v1::HeldShard> HeldShards();
  // Drops a job's shard and groups, as Unload does; false if it was not loaded. A load of the job
  // still running then ends CANCELLED instead of keeping the shard.
  bool UnloadJob(const std::string& job_id);

  // Registers the gauge bertshard_worker_shards_loaded (loaded_jobs(), read when scraped) in
  // `registry`; the handle must go before the service. Errors as MetricsRegistry::AddCollector.
  absl::StatusOr<common::MetricsRegistry::CollectorHandle> ExportLoadedShards(common::MetricsRegistry* registry);

 private:
  // OK when the call carries the cluster token (or none is configured).
  grpc::Status Authorize(const grpc::ServerContext& context) const;
  struct LoadedJob;
  // LoadShard's refusals made before anything is read: a malformed request, or a backend this
  // worker does not serve (or this build lacks).
  absl::Status CheckLoadRequest(const v1::LoadShardRequest& request) const;
  // Loads and connects the request's rank (worker/shard_loader.h), streaming `progress` to `writer`,
  // taking what `held` (the shard it replaces, may be null) holds alike when it is of the same checkpoint.
  absl::StatusOr<std::shared_ptr<LoadedJob>> LoadJob(const v1::LoadShardRequest& request, grpc::ServerContext& context,
                                                     grpc::ServerWriter<v1::LoadProgress>& writer,
                                                     v1::LoadProgress& progress,
                                                     const std::shared_ptr<LoadedJob>& held);
  // options_.gemm, or under "auto" the measured choice for a plan's rank at `threads`.
  model::GemmPath GemmPathFor(const v1::ShardPlan& plan, int rank, const std::string& job_id, int threads);

  const WorkerServiceOptions options_;
  absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<LoadedJob>> jobs_ ABSL_GUARDED_BY(mu_);
  // Loads running, by job id (erased when the last ends), and the Unload calls for that id seen
  // meanwhile: a load that saw one is not kept.
  struct LoadsInProgress {
    int loads = 0;
    int64_t unloads = 0;
  };
  std::map<std::string, LoadsInProgress> loading_ ABSL_GUARDED_BY(mu_);
  // "auto" choices by (threads, hidden size, intermediate size, tp size), which fix the product
  // PickGemmPathForPlan times: measured once each.
  absl::Mutex gemm_mu_;
  std::map<std::tuple<int, int64_t, int64_t, int>, model::GemmChoice> gemm_choices_ ABSL_GUARDED_BY(gemm_mu_);
  const std::unique_ptr<ReservedStores> reserved_stores_;  // ReservePort's, until rank 0 claims them
};

}  // namespace bertshard::worker

#endif  // BERTSHARD_WORKER_WORKER_SERVICE_H_
