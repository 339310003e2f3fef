// The Scheduler's live updates (scheduler.h, UpdateJob): a READY job moves to a new shape (TP, PP,
// pipeline style, SP mode, dtype) or a new checkpoint while it serves, and no request fails for it.
//
// How: the new shape (JobRuntime::next) gets as many replicas as the job runs, placed and loaded
// beside the old ones on idle workers by the code that places any replica (they take the lowest
// free replica indices, so the workers tell them apart by key: replica_keys.h). Requests keep
// going to the old shape meanwhile. When every new replica serves, the job switches over: the
// store takes the new request, version and plan in one write, new requests go to a new request
// path (JobServing) made for the new shape (its tokenizer and assets, its plan's padding), and the
// old path, with the requests it holds, keeps the old replicas until nothing holds it any more;
// then they unload. A request is prepared for one shape and every forward of it (a retry after a
// loss too) goes to that shape's replicas (NextForward by version): it is answered wholly by the
// old shape or by the new.
//
// Short of workers, an update of a job with several replicas takes old replicas away, as few as
// free one new replica's workers (the next ones only once that new replica serves, and never the
// last old one), and switches over once no more room can be made and the new replicas placed
// serve; the rest of the new replicas take the old ones' workers once they have drained. A job with one replica and no
// idle workers for the new one waits, and Job.update.progress says for what. A new replica whose load is refused for
// what it asks, or that loses workers past --max_restarts, ends the update (aborted, the old shape serving on); so does
// UpdateJobRequest.abort. A restarted coordinator finds the update in the store and starts its replicas again.
//
// One class split over four files to keep each readable; the lock and its rules are scheduler.h's.
#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "planner/planner.h"
#include "server/placement.h"
#include "server/scheduler.h"
#include "server/smaller_shapes.h"

namespace bertshard::server {

namespace {

std::string UtcNow() { return absl::FormatTime("%Y-%m-%d %H:%M:%E3S UTC", absl::Now(), absl::UTCTimeZone()); }

}  // namespace

absl::StatusOr<std::shared_ptr<const JobShape>> Scheduler::ReadShape(const v1::PlanRequest& request,
                                                                     std::string backend, int32_t version) const {
  // The checkpoint opened once under the model root: config.json for the plan and the serving
  // assets are read through its descriptors.
  ASSIGN_OR_RETURN(const LocalCheckpoint local, OpenLocalCheckpoint(options_.model_root, request));
  ASSIGN_OR_RETURN(v1::ShardPlan plan, planner::Plan(local.request));
  auto shape = std::make_shared<JobShape>();
  shape->version = version;
  shape->request = request;
  // The class the plan resolved (from the checkpoint's config.json when the request named none),
  // so that listings say what runs.
  shape->request.set_variant(plan.variant());
  shape->checkpoint = request.checkpoint();
  shape->assets = LoadJobAssets(plan, *local.dir);
  shape->plan = std::move(plan);
  shape->backend = std::move(backend);
  return shape;
}

namespace {

// Why job `id` cannot take an update now, if it cannot.
absl::Status CheckUpdatable(const std::string& id, const v1::Job& job, const JobRuntime* runtime) {
  if (TerminalState(job.state()) || runtime == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat("job ", id, " is ", v1::JobState_Name(job.state())));
  }
  if (runtime->next != nullptr) {
    return absl::FailedPreconditionError(absl::StrCat("job ", id, " runs an update to version ", runtime->next->version,
                                                      " already (", job.update().progress(),
                                                      "): wait for it, or abort it"));
  }
  if (!runtime->draining.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", id, " has just switched to version ", runtime->shape->version,
                     " and its old shape still finishes the requests queued for it: retry in a moment"));
  }
  bool readopting = false;
  for (const auto& [replica, group] : runtime->groups) readopting |= group->phase == GroupRuntime::Phase::kReadopting;
  if (job.state() != v1::READY || readopting) {
    return absl::FailedPreconditionError(absl::StrCat("job ", id, " is ", v1::JobState_Name(job.state()),
                                                      readopting ? " and taking its replicas back after a restart" : "",
                                                      "; update it once it is READY"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<v1::Job> Scheduler::UpdateJob(const v1::UpdateJobRequest& request) {
  const std::string& id = request.job_id();
  if (request.abort()) {
    absl::MutexLock lock(&mu_);
    ASSIGN_OR_RETURN(const v1::Job job, GetJobLocked(id));
    auto found = runtimes_.find(id);
    if (found == runtimes_.end() || found->second->next == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat("job ", id, " runs no update to abort"));
    }
    AbortUpdateLocked(id, *found->second, "aborted by request");
    return GetJobLocked(id);
  }
  if (request.request().checkpoint().empty()) {
    return absl::InvalidArgumentError(
        "UpdateJob needs request.checkpoint: the model directory the new shape loads (the job's own, or a new one)");
  }
  std::string backend;
  int32_t version = 0;
  {
    absl::MutexLock lock(&mu_);
    ASSIGN_OR_RETURN(const v1::Job job, GetJobLocked(id));
    auto found = runtimes_.find(id);
    RETURN_IF_ERROR(CheckUpdatable(id, job, found == runtimes_.end() ? nullptr : found->second.get()));
    backend = found->second->shape->backend;
    version = found->second->shape->version + 1;
  }
  // Read and planned off the lock; refused here (INVALID_ARGUMENT), nothing has changed.
  ASSIGN_OR_RETURN(std::shared_ptr<const JobShape> next, ReadShape(request.request(), backend, version));
  absl::MutexLock lock(&mu_);
  // Checked again: the job may have ended, or taken another update, while its files were read.
  ASSIGN_OR_RETURN(const v1::Job job, GetJobLocked(id));
  auto found = runtimes_.find(id);
  RETURN_IF_ERROR(CheckUpdatable(id, job, found == runtimes_.end() ? nullptr : found->second.get()));
  if (found->second->shape->version + 1 != version) {
    return absl::AbortedError(absl::StrCat("job ", id, " changed while the update was read; retry"));
  }
  RETURN_IF_ERROR(StartUpdateLocked(id, *found->second, std::move(next), absl::ToUnixMillis(absl::Now())));
  ScheduleLocked();
  return GetJobLocked(id);
}

absl::Status Scheduler::StartUpdateLocked(const std::string& job_id, JobRuntime& runtime,
                                          std::shared_ptr<const JobShape> next, int64_t started_unix_millis) {
  v1::JobUpdate update;
  *update.mutable_request() = next->request;
  update.set_version(next->version);
  update.set_started_unix_millis(started_unix_millis);
  // Stored first: a restart goes on with it.
  RETURN_IF_ERROR(store_->SetUpdate(job_id, &update, "").status());
  runtime.next = std::move(next);
  runtime.update_started_unix_millis = started_unix_millis;
  runtime.room_made_at = -1;
  for (int32_t k = 0; k < runtime.replicas; ++k) {
    AddGroupLocked(job_id, runtime, runtime.FreeReplicaIndex(), runtime.next).reason = "placing its ranks";
  }
  changed_.SignalAll();
  return absl::OkStatus();
}

void Scheduler::AdvanceUpdatesLocked() {
  std::vector<std::pair<std::string, std::shared_ptr<JobRuntime>>> updating;
  for (const auto& [id, runtime] : runtimes_) {
    if (runtime->next != nullptr || !runtime->draining.empty()) updating.emplace_back(id, runtime);
  }
  for (auto& [id, runtime] : updating) AdvanceUpdateLocked(id, *runtime);
}

void Scheduler::AdvanceUpdateLocked(const std::string& job_id, JobRuntime& runtime) {
  if (runtime.ended || stopping_) return;
  // The shapes switched away from unload once nothing holds their request path: the scheduler's
  // is the only reference left when no call is inside it, and none can enter it now (ServingFor
  // hands out the job's shape's only).
  for (auto it = runtime.draining.begin(); it != runtime.draining.end();) {
    if (it->second != nullptr && it->second.use_count() > 1) {
      ++it;
      continue;
    }
    const int32_t version = it->first;
    if (std::shared_ptr<JobServing> drained = std::move(it->second)) {
      drained->Close(absl::StrCat("job ", job_id, " switched to version ", runtime.shape->version));
      threads_.Start([drained = std::move(drained)]() mutable { drained.reset(); });
    }
    it = runtime.draining.erase(it);
    std::vector<int32_t> old;
    for (const auto& [replica, group] : runtime.groups) {
      if (group->shape->version == version) old.push_back(replica);
    }
    for (int32_t replica : old) {
      GroupRuntime& group = *runtime.Group(replica);
      if (group.forwarding) {
        group.retiring = true;  // EndForward drops it
      } else {
        DropGroupLocked(job_id, runtime, replica);
      }
    }
    ScheduleLocked();
  }
  if (runtime.next == nullptr) return;
  const int32_t version = runtime.next->version;
  int placed = 0;  // new replicas past PENDING
  bool short_of_workers = false;
  GroupRuntime* waiting = nullptr;  // the first new replica that no idle workers fit
  const std::vector<IdleWorker> idle = pool_->Idle();
  for (const auto& [replica, group] : runtime.groups) {
    if (group->shape != runtime.next) continue;
    if (group->phase != GroupRuntime::Phase::kPending) {
      ++placed;
    } else if (PlaceRanks(group->shape->backend, group->shape->plan.world_size(), idle).ranks.empty()) {
      short_of_workers = true;
      if (waiting == nullptr) waiting = group.get();
    }
  }
  const int serving_new = runtime.ServingGroups(version);
  const int serving_old = runtime.ServingGroups(runtime.shape->version);
  if (serving_new >= runtime.replicas || (serving_new > 0 && serving_old == 0)) {
    SwitchShapeLocked(job_id, runtime);
    return;
  }
  if (!short_of_workers || waiting == nullptr) return;
  // Room for the waiting new replica: as few old replicas as free enough workers with the idle
  // ones (idle the longest first; one running a forward finishes it first), always leaving one old
  // replica serving, and only once the room made last time has a new replica serving (so capacity
  // falls by one step at a time). Their workers unload, then go to the waiting replica (queued
  // first for them).
  if (serving_new > runtime.room_made_at) {
    std::vector<GroupRuntime*> old;
    for (auto& [replica, group] : runtime.groups) {
      if (runtime.Current(*group) && group->serving() && !group->retiring) old.push_back(group.get());
    }
    std::sort(old.begin(), old.end(), [](const GroupRuntime* a, const GroupRuntime* b) {
      return a->forwarding != b->forwarding ? !a->forwarding : a->idle_since < b->idle_since;
    });
    const size_t needed = static_cast<size_t>(runtime.next->plan.world_size());
    size_t freed = idle.size();
    std::vector<GroupRuntime*> chosen;
    for (GroupRuntime* group : old) {
      if (freed >= needed || chosen.size() + 1 >= old.size()) break;
      chosen.push_back(group);
      freed += group->ranks.size();
    }
    if (freed >= needed && !chosen.empty()) {
      runtime.room_made_at = serving_new;
      QueueForPlacementLocked(job_id, waiting->replica, /*first=*/true);
      for (GroupRuntime* group : chosen) {
        if (group->forwarding) {
          group->retiring = true;  // EndForward drops it
        } else {
          DropGroupLocked(job_id, runtime, group->replica);
        }
      }
      return;
    }
  }
  // No more room can be made (the old shape is down to one replica, or what it could free would
  // not hold a new one) and the new replicas placed serve: requests move to them, and the old
  // replicas' workers take the rest once they have drained.
  if (serving_new > 0 && placed == serving_new) SwitchShapeLocked(job_id, runtime);
}

bool Scheduler::SwitchShapeLocked(const std::string& job_id, JobRuntime& runtime) {
  const std::shared_ptr<const JobShape> next = runtime.next;
  const std::string note = absl::StrCat("version ", next->version, ": ", ShapeText(runtime.shape->request), " -> ",
                                        ShapeText(next->request), ", switched over at ", UtcNow());
  // The new shape's ranks in the same write: a restart must never find the new plan with the old
  // shape's workers (it would take them back as the new shape).
  std::vector<v1::RankAssignment> ranks;
  for (const auto& [replica, group] : runtime.groups) {
    if (group->shape == next) ranks.insert(ranks.end(), group->ranks.begin(), group->ranks.end());
  }
  if (absl::Status s = store_->SwitchShape(job_id, next->request, next->version, next->plan, ranks, note).status();
      !s.ok()) {
    // The old shape serves on; the monitor tries again.
    StoreErrorLocked(absl::StrCat("switching job ", job_id, " to version ", next->version), s);
    return false;
  }
  const int32_t old_version = runtime.shape->version;
  runtime.draining[old_version] = std::move(runtime.job_serving);  // null when no request came
  runtime.job_serving = nullptr;  // made for the new shape by the next request (Cluster::ServingFor)
  runtime.shape = next;
  runtime.next = nullptr;
  runtime.room_made_at = -1;
  RecordLocked(RecordJobLocked(job_id, runtime, note), absl::StrCat("recording job ", job_id, "'s new shape"));
  UpdateLanesLocked(runtime);
  AdvanceUpdateLocked(job_id, runtime);  // nothing may hold the old path: it unloads now
  changed_.SignalAll();
  return true;
}

void Scheduler::AbortUpdateLocked(const std::string& job_id, JobRuntime& runtime, const std::string& why) {
  if (runtime.next == nullptr) return;
  const std::shared_ptr<const JobShape> next = std::move(runtime.next);
  runtime.next = nullptr;
  runtime.room_made_at = -1;
  RecordLocked(
      store_->SetUpdate(job_id, nullptr, absl::StrCat("version ", next->version, ": ", why, " at ", UtcNow())).status(),
      absl::StrCat("ending the update of job ", job_id));
  std::vector<int32_t> dropped;
  for (const auto& [replica, group] : runtime.groups) {
    if (group->shape == next) dropped.push_back(replica);
  }
  // Not one has served a request (none goes to a shape before it is switched to).
  for (int32_t replica : dropped) DropGroupLocked(job_id, runtime, replica);
  // Old replicas taken away to make room come back (those still finishing a forward first), as a
  // scale to the job's count brings them.
  ScaleJobLocked(job_id, runtime, runtime.replicas);
}

std::string Scheduler::UpdateProgressLocked(const JobRuntime& runtime) {
  if (runtime.next == nullptr) return "";
  const int32_t version = runtime.next->version;
  std::string progress = absl::StrCat("version ", version, ": ", runtime.ServingGroups(version), " of ",
                                      runtime.replicas, " new replicas READY");
  std::vector<std::string> waiting;
  for (const auto& [replica, group] : runtime.groups) {
    if (group->shape != runtime.next || group->serving()) continue;
    waiting.push_back(
        absl::StrCat("replica ", replica, " ",
                     group->phase == GroupRuntime::Phase::kPending
                         ? absl::StrCat("waits: ", group->reason)
                         : std::string(group->phase == GroupRuntime::Phase::kLoading ? "loads" : "is placed")));
  }
  if (!waiting.empty()) absl::StrAppend(&progress, "; ", absl::StrJoin(waiting, "; "));
  int old = 0;
  for (const auto& [replica, group] : runtime.groups) old += runtime.Current(*group) && !group->retiring ? 1 : 0;
  if (old < runtime.replicas) {
    absl::StrAppend(&progress, "; the old shape runs ", old, " of its ", runtime.replicas,
                    " replicas (the others' workers were given to the new shape)");
  }
  return progress;
}

}  // namespace bertshard::server
