#include "server/worker_pool.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"

namespace bertshard::server {

WorkerPool::WorkerPool(const ClusterOptions& options, std::string incarnation)
    : options_(options), incarnation_(std::move(incarnation)) {}

std::optional<v1::WorkerInfo> WorkerPool::RemoveByAddress(const std::string& address) {
  absl::MutexLock lock(&mu_);
  for (auto it = workers_.begin(); it != workers_.end(); ++it) {
    if (it->second.info.address() != address) continue;
    v1::WorkerInfo info = std::move(it->second.info);
    workers_.erase(it);
    return info;
  }
  return std::nullopt;
}

v1::WorkerInfo WorkerPool::Add(const v1::RegisterWorkerRequest& request) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(1 << 30);
  args.SetMaxSendMessageSize(1 << 30);
  auto channel = grpc::CreateCustomChannel(
      request.address(),
      options_.worker_credentials != nullptr ? options_.worker_credentials : grpc::InsecureChannelCredentials(), args);
  absl::MutexLock lock(&mu_);
  std::string id = request.previous_worker_id();
  if (id.empty() || workers_.count(id)) id = absl::StrCat("worker-", ++next_worker_, "-", incarnation_);
  Worker& worker = workers_[id];
  worker.info.set_worker_id(id);
  worker.info.set_address(request.address());
  worker.info.set_device(request.device().empty() ? "cpu" : request.device());
  worker.info.set_gpu_bus_id(request.gpu_bus_id());
  worker.info.set_free_memory_bytes(request.free_memory_bytes());
  worker.info.set_healthy(true);
  worker.last_heartbeat = absl::Now();
  worker.channel = {id, request.address(), v1::Worker::NewStub(channel), grpc::health::v1::Health::NewStub(channel)};
  return worker.info;
}

absl::StatusOr<v1::WorkerInfo> WorkerPool::Beat(const std::string& worker_id, int64_t free_memory_bytes) {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(worker_id);
  if (it == workers_.end()) return absl::NotFoundError(absl::StrCat("unknown worker ", worker_id, "; register again"));
  v1::WorkerInfo before = it->second.info;
  it->second.last_heartbeat = absl::Now();
  it->second.info.set_free_memory_bytes(free_memory_bytes);
  return before;
}

std::optional<v1::WorkerInfo> WorkerPool::Find(const std::string& worker_id) const {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(worker_id);
  if (it == workers_.end()) return std::nullopt;
  return it->second.info;
}

std::optional<v1::WorkerInfo> WorkerPool::MarkUnhealthy(const std::string& worker_id) {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(worker_id);
  if (it == workers_.end()) return std::nullopt;
  v1::WorkerInfo before = it->second.info;
  it->second.info.set_healthy(false);
  return before;
}

void WorkerPool::MarkHealthy(const std::string& worker_id) {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(worker_id);
  if (it != workers_.end()) it->second.info.set_healthy(true);
}

std::vector<WorkerDeparture> WorkerPool::TakeSilent(absl::Time now) {
  absl::MutexLock lock(&mu_);
  std::vector<WorkerDeparture> silent;
  for (auto& [id, w] : workers_) {
    if (!w.info.healthy() || now - w.last_heartbeat <= options_.heartbeat_interval * options_.missed_heartbeats) {
      continue;
    }
    silent.push_back({w.info, now - w.last_heartbeat});
    w.info.set_healthy(false);
  }
  return silent;
}

bool WorkerPool::Assign(const std::string& worker_id, const std::string& job_id, int32_t rank) {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(worker_id);
  if (it == workers_.end()) return false;
  it->second.info.set_job_id(job_id);
  it->second.info.set_rank(rank);
  return true;
}

void WorkerPool::Unassign(const std::string& worker_id) {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(worker_id);
  if (it == workers_.end()) return;
  it->second.info.clear_job_id();
  it->second.info.set_rank(0);
}

std::vector<WorkerStub> WorkerPool::Release(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  std::vector<WorkerStub> holding;
  for (auto& [id, w] : workers_) {
    if (w.info.job_id() != job_id) continue;
    w.info.clear_job_id();
    w.info.set_rank(0);
    if (w.info.healthy()) holding.push_back(w.channel);  // a dead worker has nothing to drop
  }
  return holding;
}

bool WorkerPool::SetUnloading(const std::string& worker_id, bool unloading) {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(worker_id);
  if (it == workers_.end()) return false;
  const bool was = it->second.unloading;
  it->second.unloading = unloading;
  return was;
}

void WorkerPool::BeginUnloadCall(const std::string& worker_id) {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(worker_id);
  if (it != workers_.end()) ++it->second.unload_calls;
}

bool WorkerPool::EndUnloadCall(const std::string& worker_id, bool unloaded) {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(worker_id);
  if (it == workers_.end()) return false;
  if (it->second.unload_calls > 0) --it->second.unload_calls;
  if (!unloaded) it->second.unloading = true;
  return it->second.unload_calls == 0 && !it->second.unloading;
}

std::vector<IdleWorker> WorkerPool::Idle() const {
  absl::MutexLock lock(&mu_);
  std::vector<IdleWorker> idle;
  for (const auto& [id, w] : workers_) {
    if (w.info.healthy() && w.info.job_id().empty() && !w.unloading && w.unload_calls == 0) {
      idle.push_back({id, w.info.address(), w.info.device(), w.info.gpu_bus_id()});
    }
  }
  return idle;
}

absl::StatusOr<std::vector<WorkerStub>> WorkerPool::Stubs(const std::vector<std::string>& worker_ids) const {
  absl::MutexLock lock(&mu_);
  std::vector<WorkerStub> stubs;
  for (const std::string& id : worker_ids) {
    auto it = workers_.find(id);
    if (it == workers_.end()) return absl::NotFoundError(absl::StrCat("worker ", id, " left the pool"));
    stubs.push_back(it->second.channel);
  }
  return stubs;
}

v1::ListWorkersResponse WorkerPool::List() const {
  absl::MutexLock lock(&mu_);
  v1::ListWorkersResponse response;
  for (const auto& [id, w] : workers_) {
    v1::WorkerInfo* info = response.add_workers();
    *info = w.info;
    info->set_last_heartbeat_unix_millis(absl::ToUnixMillis(w.last_heartbeat));
  }
  return response;
}

}  // namespace bertshard::server
