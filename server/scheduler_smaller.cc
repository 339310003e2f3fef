// The Scheduler's smaller shapes (scheduler.h, ClusterOptions::smaller_shapes): a replica that lost
// workers, and finds too few idle ones for its shape, serves in a smaller one meanwhile instead of
// waiting, and grows back when workers return; its workers keep what they hold across each change.
//
// How: a replica of the job's serving shape that loses a worker (no update running) keeps its
// healthy workers (GroupRuntime::kept): they stay assigned to it in the pool with their shards
// loaded, and only the others are released. Its next placement, in its own shape or a smaller one,
// gives each rank the kept worker whose held table shares the most of the rank's tensors
// (AssignKeptWorkers: a rank placed again in the same shape gets its own worker back, a stage
// folded into fewer keeps each worker's TP slice), idle workers the rest, and releases the kept
// workers it does not need. Every rank's load asks to keep the shard held under the replica's key
// (LoadShardRequest.keep_held): a kept worker takes from it the tensors its new table has alike and
// reads only the others. ReplicaStatus says what the last load kept and read.
//
// When the idle workers with the kept ones do not fit its shape, a recovering replica takes the
// largest smaller shape (smaller_shapes.h) they fit. It is placed, loaded and served like any
// replica, with that shape's plan (GroupRuntime::smaller): its requests are prepared for the job's
// shape, and every forward's outputs are the same whatever the layout (the head stage answers
// whole rows). It does not count as served (GroupRestarts keeps it recovering: Job.degraded says
// so, and its requests wait for it while it grows back). Whenever the pool changes, a smaller
// replica whose own shape fits its workers and the idle ones again grows back: once its forward in
// flight has ended (it takes no other meanwhile) it keeps its workers and is placed in its own shape,
// ahead of the replicas waiting for their first placement. A smaller shape whose load fails (the
// workers cannot hold it, say) costs no restart but is not tried again until the replica serves in
// its own shape (its workers unload: a loss in a load keeps none); a loss while smaller places it
// again in its own shape first. While smaller it counts as recovering from its loss: a loss then is
// the next in a row (--restart_reset_after counts from when it serves in its own shape again).
//
// Kept workers wait with their replica and serve no other job meanwhile. A replica's ranks are
// stored with its smaller shape (RankAssignment.smaller_tp/pp): a restarted coordinator takes it
// back in it (StoredSmallerShapeLocked), still recovering. It keeps nothing of a waiting replica
// (its workers unload what they hold).
//
// One class split over several files to keep each readable; the lock and its rules are scheduler.h's.
#include <algorithm>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/placement.h"
#include "server/replica_keys.h"
#include "server/scheduler.h"
#include "server/shard_loading.h"
#include "server/smaller_shapes.h"

namespace bertshard::server {

void Scheduler::MarkSmallerLocked(const GroupRuntime& group, v1::RankAssignment& a) {
  if (group.smaller == nullptr) return;
  a.set_smaller_tp(static_cast<int32_t>(std::max<int64_t>(1, group.smaller->request.parallel().tp_size())));
  a.set_smaller_pp(static_cast<int32_t>(std::max<int64_t>(1, group.smaller->request.parallel().pp_size())));
}

std::shared_ptr<const JobShape> Scheduler::StoredSmallerShapeLocked(
    const JobShape& own, const std::vector<v1::RankAssignment>& stored) const {
  // Without --smaller_shapes it would never grow back; under --max_restarts=0 the loss that made it
  // smaller ends the job, as a restart resumes every recovery (its workers unload, readoption fails).
  if (!options_.smaller_shapes || options_.restarts.max_restarts == 0 || stored.empty() ||
      stored.front().smaller_tp() <= 0) {
    return nullptr;
  }
  std::optional<SmallerShape> smaller =
      SmallerShapeOf(own.request, own.plan, stored.front().smaller_tp(), stored.front().smaller_pp());
  if (!smaller.has_value()) return nullptr;
  auto shape = std::make_shared<JobShape>(own);
  shape->request = std::move(smaller->request);
  shape->plan = std::move(smaller->plan);
  return shape;
}

bool Scheduler::KeepsWorkersLocked(const JobRuntime& runtime, const GroupRuntime& group) const {
  return options_.smaller_shapes && runtime.Current(group) && runtime.next == nullptr && !group.retiring;
}

void Scheduler::KeepWorkersLocked(const std::string& job_id, GroupRuntime& group) {
  const std::string key = ReplicaKey(job_id, group.replica);
  group.kept.clear();
  group.kept_from = group.smaller != nullptr ? group.smaller : group.shape;
  std::set<std::string> keep;
  for (const v1::RankAssignment& a : group.ranks) {
    const std::optional<v1::WorkerInfo> w = pool_->Find(a.worker_id());
    if (w.has_value() && w->healthy() && w->job_id() == key) {
      group.kept.push_back(a);
      keep.insert(a.worker_id());
    }
  }
  // Every other worker assigned to it (a lost one, a rank that came back to a restarted
  // coordinator) goes, as UnloadGroupLocked lets them go; the kept ones are its own again.
  for (const WorkerStub& w : pool_->Release(key)) {
    if (keep.count(w.worker_id) == 0) UnloadWorkerLocked(w, key);
  }
  for (const v1::RankAssignment& a : group.kept) pool_->Assign(a.worker_id(), key, a.rank());
}

void Scheduler::ReleaseWorkerLocked(const std::string& worker_id, const std::string& key) {
  const std::optional<v1::WorkerInfo> w = pool_->Find(worker_id);
  if (!w.has_value() || w->job_id() != key) return;  // left, or serves another replica now
  pool_->Unassign(worker_id);
  // A silent one is told at its next heartbeat (its shard's replica does not claim it).
  if (!w->healthy()) return;
  if (absl::StatusOr<std::vector<WorkerStub>> stubs = pool_->Stubs({worker_id}); stubs.ok()) {
    UnloadWorkerLocked((*stubs)[0], key);
  }
}

std::optional<IdleWorker> Scheduler::HealthyWorkerLocked(const std::string& id) const {
  const std::optional<v1::WorkerInfo> w = pool_->Find(id);
  if (!w.has_value() || !w->healthy()) return std::nullopt;
  return IdleWorker{w->worker_id(), w->address(), w->device(), w->gpu_bus_id()};
}

std::vector<IdleWorker> Scheduler::PlaceKeepingLocked(const GroupRuntime& group, const JobShape& shape,
                                                      const std::vector<IdleWorker>& idle) {
  // The kept workers still healthy, as placement candidates, with the ranks they held.
  std::vector<IdleWorker> kept;
  std::vector<int32_t> held_ranks;
  for (const v1::RankAssignment& a : group.kept) {
    if (std::optional<IdleWorker> w = HealthyWorkerLocked(a.worker_id())) {
      kept.push_back(*std::move(w));
      held_ranks.push_back(a.rank());
    }
  }
  const std::vector<int> assigned = AssignKeptWorkers(group.kept_from->plan, held_ranks, shape.plan);
  const int missing = static_cast<int>(std::count(assigned.begin(), assigned.end(), -1));
  std::vector<IdleWorker> fill;
  if (missing > 0) {
    // Not on a GPU a kept worker that takes a rank is on (NCCL: one rank per GPU).
    std::vector<IdleWorker> others;
    for (const IdleWorker& w : idle) {
      bool shares = false;
      for (int a : assigned) {
        if (a < 0) continue;
        const std::vector<IdleWorker> pair = {kept[static_cast<size_t>(a)], w};
        shares |= PlaceRanks(shape.backend, 2, pair).ranks.size() != 2;
      }
      if (!shares) others.push_back(w);
    }
    const Placement more = PlaceRanks(shape.backend, missing, others);
    if (more.ranks.empty()) return {};
    for (size_t i : more.ranks) fill.push_back(others[i]);
  }
  std::vector<IdleWorker> workers;
  size_t next_fill = 0;
  for (int a : assigned) workers.push_back(a >= 0 ? kept[static_cast<size_t>(a)] : fill[next_fill++]);
  // Together they must suit the backend too (NCCL: no two ranks on one GPU).
  if (PlaceRanks(shape.backend, static_cast<int>(workers.size()), workers).ranks.size() != workers.size()) return {};
  return workers;
}

std::vector<IdleWorker> Scheduler::PlaceSmallerLocked(const JobRuntime& runtime, GroupRuntime& group,
                                                      const std::vector<IdleWorker>& idle) {
  if (!options_.smaller_shapes || group.smaller_refused || !group.restarts.recovering() || group.retiring ||
      !runtime.Current(group) || runtime.next != nullptr) {
    return {};
  }
  int candidates = static_cast<int>(idle.size());
  for (const v1::RankAssignment& a : group.kept) candidates += HealthyWorkerLocked(a.worker_id()).has_value() ? 1 : 0;
  const JobShape& own = *group.shape;
  for (int most = std::min(candidates, own.plan.world_size() - 1); most >= 1; --most) {
    std::optional<SmallerShape> smaller = LargestSmallerShape(own.request, own.plan, most);
    if (!smaller.has_value()) return {};  // nothing smaller fits fewer either
    auto shape = std::make_shared<JobShape>(own);
    shape->request = std::move(smaller->request);
    shape->plan = std::move(smaller->plan);
    std::vector<IdleWorker> workers;
    if (group.kept.empty()) {
      const Placement placement = PlaceRanks(own.backend, shape->plan.world_size(), idle);
      for (size_t i : placement.ranks) workers.push_back(idle[i]);
    } else {
      workers = PlaceKeepingLocked(group, *shape, idle);
    }
    if (workers.empty()) {
      // The workers do not all suit it (CPU ones for an NCCL job, two on one GPU): fewer.
      most = std::min(most, shape->plan.world_size());
      continue;
    }
    group.smaller = std::move(shape);
    return workers;
  }
  return {};
}

bool Scheduler::RoomToGrowBackLocked(const JobRuntime& runtime, const GroupRuntime& group,
                                     const std::vector<IdleWorker>& idle) {
  if (group.smaller == nullptr || !group.serving() || group.retiring || runtime.ended || runtime.next != nullptr ||
      !runtime.Current(group)) {
    return false;
  }
  // Its own workers first, then the idle ones: would its own shape fit them?
  std::vector<IdleWorker> candidates;
  for (const std::string& id : group.WorkerIds()) {
    if (std::optional<IdleWorker> w = HealthyWorkerLocked(id)) candidates.push_back(*std::move(w));
  }
  candidates.insert(candidates.end(), idle.begin(), idle.end());
  return !PlaceRanks(group.shape->backend, group.shape->plan.world_size(), candidates).ranks.empty();
}

void Scheduler::GrowBackWhereRoomLocked() {
  if (!options_.smaller_shapes || stopping_ || draining_) return;
  const std::vector<IdleWorker> idle = pool_->Idle();
  if (idle.empty()) return;
  // One at a time: the idle workers one counts are not there for the next, also while the one
  // marked to grow back waits for its forward to end.
  for (const auto& [job_id, runtime] : runtimes_) {
    for (const auto& [replica, group] : runtime->groups) {
      if (group->growing_back) return;
    }
  }
  for (const auto& [job_id, runtime] : runtimes_) {
    for (const auto& [replica, group] : runtime->groups) {
      if (!RoomToGrowBackLocked(*runtime, *group, idle)) continue;
      if (group->forwarding) {
        group->growing_back = true;  // EndForward grows it back, if there is room still
      } else {
        GrowBackLocked(job_id, *runtime, *group);
      }
      return;
    }
  }
}

void Scheduler::GrowBackLocked(const std::string& job_id, JobRuntime& runtime, GroupRuntime& group) {
  const std::string was = ShapeText(group.smaller->request);
  // Cut off as a loss would (no load or forward of the smaller placement counts after), but not
  // counted as one: it still recovers from the loss that made it smaller.
  CutOffLocked(group, absl::StrCat("replica ", group.replica, " of job ", job_id, " grows back"));
  KeepWorkersLocked(job_id, group);  // before the shape and ranks it held go
  group.smaller.reset();
  group.ranks.clear();
  group.progress.clear();
  group.pending_note = absl::StrCat("growing back from ", was, " to its own shape, ", ShapeText(group.shape->request),
                                    "; recovering: ", group.restarts.Describe());
  group.reason = group.pending_note;
  // Unrecorded, the store keeps it READY in the smaller shape, where a restarted coordinator takes
  // it back (or, its workers holding nothing of it, places it again). Nothing here ends a job: this
  // runs from ScheduleLocked, which callers run while they hold iterators into a job's runtime.
  RecordLocked(RecordJobLocked(job_id, runtime, group.pending_note),
               absl::StrCat("putting job ", job_id, " back to PENDING to grow back"));
  QueueForPlacementLocked(job_id, group.replica, /*first=*/true);
  UpdateLanesLocked(runtime);
  ScheduleLocked();  // placed now, on the workers it kept and idle ones; signals
}

void Scheduler::GiveUpSmallerLocked(const std::string& job_id, JobRuntime& runtime, GroupRuntime& group,
                                    const std::string& cause, const std::string& unreachable_worker) {
  if (!unreachable_worker.empty()) pool_->MarkUnhealthy(unreachable_worker);
  if (group.retiring || (!runtime.Current(group) && group.shape != runtime.next)) {
    // Scaled away, or of a shape an update switched away from meanwhile: gone, as LoseGroupLocked
    // lets such a replica go.
    DropGroupLocked(job_id, runtime, group.replica);
    ScheduleLocked();
    return;
  }
  group.smaller_refused = true;
  CutOffLocked(group, absl::StrCat("replica ", group.replica, " of job ", job_id, ": ", cause));
  group.kept.clear();  // what its workers held went with the failed load
  group.smaller.reset();
  group.ranks.clear();
  group.progress.clear();
  UnloadGroupLocked(ReplicaKey(job_id, group.replica));
  group.pending_note = absl::StrCat("recovering: ", group.restarts.Describe(), "; not in a smaller shape: ", cause);
  group.reason = group.pending_note;
  if (absl::Status recorded = RecordJobLocked(job_id, runtime, group.pending_note); !recorded.ok()) {
    // As LoseGroupLocked: a recovery the database cannot follow would be lost at the next restart.
    StoreErrorLocked(absl::StrCat("putting job ", job_id, " back to PENDING"), recorded);
    FailJobLocked(job_id,
                  absl::StrCat(cause, "; the job database could not record its recovery: ", recorded.message()));
    return;
  }
  QueueForPlacementLocked(job_id, group.replica, /*first=*/true);
  UpdateLanesLocked(runtime);
  ScheduleLocked();
}

}  // namespace bertshard::server
