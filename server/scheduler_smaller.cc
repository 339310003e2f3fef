// The Scheduler's smaller shapes (scheduler.h, ClusterOptions::smaller_shapes): a replica that lost
// workers, and finds too few idle ones for its shape, serves in a smaller one meanwhile instead of
// waiting, and grows back when workers return.
//
// How: a recovering replica of the job's serving shape that the idle workers do not fit (and no
// update runs) waits until the workers it kept have unloaded (placed on fewer, it would take fewer
// than it may have), then takes the largest smaller shape (smaller_shapes.h) the idle workers fit.
// It is placed, loaded and served like any replica, with that shape's plan (GroupRuntime::smaller):
// its requests are prepared for the job's shape, and every forward's outputs are the same whatever
// the layout (the head stage answers whole rows). It does not count as served (GroupRestarts keeps
// it recovering: Job.degraded says so, and its requests wait for it while it grows back). Whenever
// the pool changes, a smaller replica whose own shape fits its workers and the idle ones again
// grows back: once its forward in flight has ended (it takes no other meanwhile) it unloads and is
// placed again in its own shape, ahead of the replicas waiting for their first placement. A smaller
// shape whose load fails (the workers cannot hold it, say) is not tried again until the replica
// serves in its own shape; a loss while smaller places it again in its own shape first.
//
// What each worker reads: the whole of its new shard, both ways (a survivor does not keep the
// tensors it held). A coordinator restart places a smaller replica again rather than re-adopting it
// (its workers hold a plan of another world size).
//
// One class split over several files to keep each readable; the lock and its rules are scheduler.h's.
#include <algorithm>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/placement.h"
#include "server/replica_keys.h"
#include "server/scheduler.h"
#include "server/smaller_shapes.h"

namespace bertshard::server {

std::vector<IdleWorker> Scheduler::PlaceSmallerLocked(const JobRuntime& runtime, GroupRuntime& group,
                                                      const std::vector<IdleWorker>& idle) {
  if (!options_.smaller_shapes || group.smaller_refused || !group.restarts.recovering() || group.retiring ||
      !runtime.Current(group) || runtime.next != nullptr || idle.empty()) {
    return {};
  }
  // The workers it kept are about to be idle: wait for them (their unload ends in ScheduleLocked).
  for (const std::string& id : group.survivors) {
    if (pool_->Unloading(id)) return {};
  }
  const JobShape& own = *group.shape;
  for (int most = std::min<int>(static_cast<int>(idle.size()), own.plan.world_size() - 1); most >= 1; --most) {
    std::optional<SmallerShape> smaller = LargestSmallerShape(own.request, own.plan, most);
    if (!smaller.has_value()) return {};  // nothing smaller fits fewer either
    const Placement placement = PlaceRanks(own.backend, smaller->plan.world_size(), idle);
    if (placement.ranks.empty()) {
      // The idle workers do not all suit it (CPU ones for an NCCL job, two on one GPU): fewer.
      most = std::min(most, smaller->plan.world_size());
      continue;
    }
    auto shape = std::make_shared<JobShape>(own);
    shape->request = std::move(smaller->request);
    shape->plan = std::move(smaller->plan);
    group.smaller = std::move(shape);
    std::vector<IdleWorker> workers;
    for (size_t i : placement.ranks) workers.push_back(idle[i]);
    return workers;
  }
  return {};
}

void Scheduler::GrowBackWhereRoomLocked() {
  if (!options_.smaller_shapes || stopping_ || draining_) return;
  const std::vector<IdleWorker> idle = pool_->Idle();
  if (idle.empty()) return;
  std::vector<std::pair<std::string, GroupRuntime*>> growing;
  for (const auto& [job_id, runtime] : runtimes_) {
    if (runtime->ended || runtime->next != nullptr) continue;
    for (const auto& [replica, group] : runtime->groups) {
      if (group->smaller == nullptr || !group->serving() || group->retiring || group->growing_back ||
          !runtime->Current(*group)) {
        continue;
      }
      // Its own workers first, in rank order, then the idle ones: would its shape fit them?
      std::vector<IdleWorker> candidates;
      for (const std::string& id : group->WorkerIds()) {
        if (std::optional<v1::WorkerInfo> w = pool_->Find(id); w.has_value() && w->healthy()) {
          candidates.push_back({w->worker_id(), w->address(), w->device(), w->gpu_bus_id()});
        }
      }
      candidates.insert(candidates.end(), idle.begin(), idle.end());
      if (PlaceRanks(group->shape->backend, group->shape->plan.world_size(), candidates).ranks.empty()) continue;
      growing.emplace_back(job_id, group.get());
      // One at a time: the idle workers it counted are not there for the next one.
      break;
    }
    if (!growing.empty()) break;
  }
  for (auto& [job_id, group] : growing) {
    JobRuntime& runtime = *runtimes_.at(job_id);
    if (group->forwarding) {
      group->growing_back = true;  // EndForward grows it back
    } else {
      GrowBackLocked(job_id, runtime, *group);
    }
  }
}

void Scheduler::GrowBackLocked(const std::string& job_id, JobRuntime& runtime, GroupRuntime& group) {
  const std::string was = ShapeText(group.smaller->request);
  // Cut off as a loss would (no load or forward of the smaller placement counts after), but not
  // counted as one: it still recovers from the loss that made it smaller.
  group.lost_from = group.generation;
  group.generation = ++generations_;
  for (auto& context : group.load_contexts) context->TryCancel();
  group.load_contexts.clear();
  group.forward_abort->Abort(absl::StrCat("replica ", group.replica, " of job ", job_id, " grows back"));
  group.forward_abort = std::make_shared<ForwardAbort>();
  group.phase = GroupRuntime::Phase::kPending;
  group.growing_back = false;
  group.forwarding = false;
  group.survivors = group.WorkerIds();
  group.smaller.reset();
  group.ranks.clear();
  group.progress.clear();
  UnloadGroupLocked(ReplicaKey(job_id, group.replica));
  group.pending_note = absl::StrCat("growing back from ", was, " to its own shape, ", ShapeText(group.shape->request),
                                    "; recovering: ", group.restarts.Describe());
  group.reason = group.pending_note;
  if (absl::Status recorded = RecordJobLocked(job_id, runtime, group.pending_note); !recorded.ok()) {
    StoreErrorLocked(absl::StrCat("putting job ", job_id, " back to PENDING to grow back"), recorded);
    FailJobLocked(job_id, absl::StrCat("the job database could not record it growing back: ", recorded.message()));
    return;
  }
  QueueForPlacementLocked(job_id, group.replica, /*first=*/true);
  UpdateLanesLocked(runtime);
  changed_.SignalAll();
  // Placed once its workers have unloaded (their unload calls schedule).
}

}  // namespace bertshard::server
