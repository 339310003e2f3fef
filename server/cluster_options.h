// File: server/cluster_options.h
// -----------------------------------------------------------------------------
// What a coordinator's Cluster is configured with (server/main.cc fills it from flags; tests set
// the timings they need). Its own header so that the parts of the cluster (worker_pool.h,
// scheduler.h) take the same options the front does without including the front.
//
// Example:
//   ClusterOptions options;
//   options.heartbeat_interval = absl::Seconds(2);
//   auto cluster = Cluster::Create(options);
//
// Thread safety: a plain struct; copied into each part at construction.
#ifndef BERTSHARD_SERVER_CLUSTER_OPTIONS_H_
#define BERTSHARD_SERVER_CLUSTER_OPTIONS_H_

#include <memory>
#include <string>

#include "absl/time/time.h"
#include "common/model_root.h"
#include "grpcpp/security/credentials.h"
#include "server/batch_queue.h"
#include "server/group_restarts.h"
#include "server/replica_autoscaler.h"

namespace bertshard::server {

struct ClusterOptions {
  std::string database_path = ":memory:";
  absl::Duration heartbeat_interval = absl::Seconds(1);
  // A worker silent for this many heartbeat intervals is dead (its job fails). Workers beat on a
  // fixed schedule, so a healthy one is silent for one interval at most; the rest is the margin
  // for a loaded machine or a brief stall.
  int missed_heartbeats = 3;
  absl::Duration load_timeout = absl::Minutes(10);
  int collective_timeout_seconds = 60;  // rendezvous and collectives on the workers
  // How long one (batched) forward may take on the ranks before its job is failed: the callers'
  // own deadlines end their calls, never the forward (see Infer).
  absl::Duration forward_timeout = absl::Minutes(10);
  // After a start, how long READY and LOADING jobs from the database wait for their ranks to
  // come back (workers register again within about a heartbeat interval of the start).
  absl::Duration readopt_grace = absl::Seconds(10);
  // What a job does when its group loses a worker (killed, silent, leaving, a failed forward or
  // load): placed and loaded again on idle workers, with backoff, at most max_restarts times in a
  // row (--max_restarts, --restart_backoff, --restart_backoff_max, --restart_reset_after); then FAILED.
  RestartPolicy restarts;
  // A replica that lost workers and finds too few idle ones for its shape comes back in the largest
  // smaller shape they fit (server/smaller_shapes.h: the same TP over fewer stages, else a smaller
  // TP), and grows back to its shape when enough workers are idle again; the workers it keeps reuse
  // the tensors they hold (--smaller_shapes, server/scheduler_smaller.cc). Off by default: each
  // worker of a smaller shape holds more of the model (on a GPU it may not fit; such a load fails,
  // and the replica then waits for its shape).
  bool smaller_shapes = false;
  // Dynamic batching of each job's Infer and Embed calls (see BatchQueue).
  BatchLimits batching;
  // Called for every merged forward, on the job's batch thread (metrics); may be null.
  BatchObserver batch_observer;
  // Where checkpoints may be read (--model_root); unconfined by default. Requests name their
  // checkpoint as workers will see it; the coordinator resolves it under its own root for what it
  // reads itself (config.json, the tokenizer and head files).
  common::ModelRoot model_root;
  // Jobs one client may have that have not ended (PENDING to READY); 0: no limit. Ended jobs do
  // not count, so cancelling one makes room. A client is the common name of its verified TLS
  // certificate, else its host: every client of one host (or one certificate) shares the quota.
  // (Tokens name no client: every submitter holds the one cluster token.)
  int max_jobs_per_client = 16;
  // The most replicas a job may ask for (SubmitJobRequest.replicas, ScaleJob): more is
  // INVALID_ARGUMENT. Each replica takes a whole TP x PP group of workers.
  int max_replicas = 16;
  // How jobs with replica bounds are scaled (replica_autoscaler.h; --autoscale_*).
  AutoscalePolicy autoscale;
  // Ended jobs (FAILED, CANCELLED) stay in the job database this long after they ended (GetJob,
  // ListJobs show them), then the monitor deletes them; absl::InfiniteDuration(): kept for good.
  // Jobs that have not ended are never deleted. The memory a job takes in the coordinator is freed
  // when it ends, whatever this is.
  absl::Duration job_retention = absl::Hours(24 * 7);
  // How often the monitor looks for ended jobs past job_retention.
  absl::Duration retention_sweep_interval = absl::Minutes(1);
  // Sent with every call to a worker (their --auth_token_file); empty: none.
  std::string worker_token;
  // The channels to the workers (TLS, common/grpc_tls.h); null: plaintext.
  std::shared_ptr<grpc::ChannelCredentials> worker_credentials;
};
}  // namespace bertshard::server

#endif  // BERTSHARD_SERVER_CLUSTER_OPTIONS_H_
