#include "client/cluster_commands.h"

#include <unistd.h>

#include <algorithm>
#include <functional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bertshard/v1/coordinator.grpc.pb.h"
#include "client/coordinator_connection.h"
#include "client/load_progress.h"
#include "client/plan_command.h"
#include "common/proto_json.h"
#include "common/status_macros.h"
#include "planner/model_config.h"
#include "planner/plan_format.h"

namespace bertshard::client {
namespace {

std::string JobId(const CommandLine& cl) { return cl.positional.size() > 1 ? cl.positional[1] : ""; }

// "READY/WANTED" replicas, e.g. 2/3 (jobs stored before replicas ran one).
std::string Replicas(const v1::Job& job) {
  int ready = 0;
  for (const v1::ReplicaStatus& r : job.replica_status()) ready += r.state() == v1::READY ? 1 : 0;
  return absl::StrCat(ready, "/", std::max(1, job.replicas()));
}

// --replicas N: 1 or more.
absl::StatusOr<int32_t> ReplicasFlag(const CommandLine& cl, const std::string& flag = "replicas") {
  int32_t n = 0;
  if (!absl::SimpleAtoi(cl.values.at(flag), &n) || n < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, " must be a whole number of 1 or more, not '", cl.values.at(flag), "'"));
  }
  return n;
}

// --min-replicas and --max-replicas, both or neither (checked against each other by the coordinator).
absl::Status ApplyBounds(const CommandLine& cl, std::function<void(int32_t, int32_t)> set) {
  const bool min = cl.values.count("min-replicas") > 0, max = cl.values.count("max-replicas") > 0;
  if (!min && !max) return absl::OkStatus();
  if (min != max) return absl::InvalidArgumentError("--min-replicas and --max-replicas go together");
  ASSIGN_OR_RETURN(const int32_t lo, ReplicasFlag(cl, "min-replicas"));
  ASSIGN_OR_RETURN(const int32_t hi, ReplicasFlag(cl, "max-replicas"));
  set(lo, hi);
  return absl::OkStatus();
}

std::string Age(int64_t unix_millis) {
  const absl::Duration age = absl::Now() - absl::FromUnixMillis(unix_millis);
  if (age < absl::Minutes(1)) return absl::StrCat(absl::ToInt64Seconds(age), "s");
  if (age < absl::Hours(1)) return absl::StrCat(absl::ToInt64Minutes(age), "m");
  return absl::StrCat(absl::ToInt64Hours(age), "h");
}

// One line per event; on a terminal a progress bar redrawn in place.
void PrintEvent(const v1::JobEvent& e, const LoadReading& progress, std::FILE* out) {
  const bool tty = isatty(fileno(out));
  const std::string state = v1::JobState_Name(e.job().state());
  if (e.job().state() == v1::LOADING && progress.total > 0) {
    const int width = 30;
    const int filled = width * progress.percent / 100;
    std::fprintf(out, "%s%s [%s%s] %3d%% %s / %s (%d ranks)%s", tty ? "\r" : "", state.c_str(),
                 std::string(static_cast<size_t>(filled), '#').c_str(),
                 std::string(static_cast<size_t>(width - filled), '.').c_str(), progress.percent,
                 planner::HumanBytes(progress.loaded).c_str(), planner::HumanBytes(progress.total).c_str(),
                 e.ranks_size(), tty ? "" : "\n");
  } else if (e.job().state() == v1::READY && e.job().replicas() > 1) {
    std::fprintf(out, "%sREADY (%s replicas)\n", tty ? "\n" : "", Replicas(e.job()).c_str());
  } else {
    std::fprintf(out, "%s%s%s%s\n", tty ? "\n" : "", state.c_str(),
                 e.job().failure_cause().empty() ? "" : (": " + e.job().failure_cause()).c_str(),
                 e.job().state() == v1::PENDING && !e.job().pending_reason().empty()
                     ? (" (" + e.job().pending_reason() + ")").c_str()
                     : "");
  }
  std::fflush(out);
}

// The job's bytes from its plan, as the coordinator plans its request (the plan it placed); 0
// when the coordinator will not say, and the bar then measures what the ranks have reported.
// What the whole job loads: its plan's bytes on each of its replicas.
int64_t JobBytes(const CoordinatorConnection& c, const v1::Job& job) {
  v1::ShardPlan plan;
  if (!c.stub()->Plan(c.Context(10).get(), job.request(), &plan).ok()) return 0;
  return PlanBytes(plan) * std::max(1, job.replicas());
}

// Until the job settles; with `all_replicas`, until every replica it wants is READY too.
absl::Status Watch(const CoordinatorConnection& c, const std::string& id, std::FILE* out, bool all_replicas = false) {
  v1::GetJobRequest request;
  request.set_job_id(id);
  request.set_all_replicas(all_replicas);
  auto context = c.Context(3600);
  auto reader = c.stub()->WatchJob(context.get(), request);
  v1::JobEvent event, last;
  v1::JobState printed = v1::JOB_STATE_UNSPECIFIED;
  std::string printed_replicas;
  std::string printed_update;
  int64_t printed_percent = -1;
  std::unique_ptr<JobLoadProgress> progress;  // made at the first event of a job not yet READY
  const bool tty = isatty(fileno(out));
  while (reader->Read(&event)) {
    const v1::JobState state = event.job().state();
    if (progress == nullptr && (state == v1::PLANNED || state == v1::LOADING)) {
      progress = std::make_unique<JobLoadProgress>(JobBytes(c, event.job()));
    }
    const LoadReading reading = progress != nullptr ? progress->Update(event) : LoadReading{};
    // A log gets a line per state and per quarter loaded; a terminal gets the bar redrawn.
    const bool progressed = state == v1::LOADING && (tty || reading.percent / 25 != printed_percent / 25);
    const std::string replicas = Replicas(event.job());
    if (state != printed || progressed || (state == v1::READY && replicas != printed_replicas)) {
      PrintEvent(event, reading, out);
      printed_percent = reading.percent;
      printed_replicas = replicas;
    }
    // A live update keeps the job READY: what it does is its progress.
    if (const std::string& now = event.job().update().progress(); !now.empty() && now != printed_update) {
      std::fprintf(out, "update: %s\n", now.c_str());
      std::fflush(out);
      printed_update = now;
    }
    printed = state;
    last = event;
  }
  RETURN_IF_ERROR(c.Check(reader->Finish()));
  if (last.job().state() == v1::FAILED)
    return absl::AbortedError(absl::StrCat("job ", id, " failed: ", last.job().failure_cause()));
  return absl::OkStatus();
}

}  // namespace

absl::Status SubmitCommand(const CommandLine& cl, std::FILE* out) {
  v1::SubmitJobRequest submit;
  RETURN_IF_ERROR(ApplyPlanFlags(cl, submit.mutable_request()));
  if (submit.request().checkpoint().empty()) {
    return absl::InvalidArgumentError("submit needs --checkpoint DIR (as the workers see it)");
  }
  submit.set_fail_if_no_workers(cl.switches.count("no-wait") > 0);
  // Checked by the coordinator (INVALID_ARGUMENT, exit 2), which knows the backends it places.
  if (cl.values.count("backend")) submit.set_backend(cl.values.at("backend"));
  // Checked by the coordinator too (INVALID_ARGUMENT, ALREADY_EXISTS while a live job has it).
  if (cl.values.count("name")) submit.set_name(cl.values.at("name"));
  if (cl.values.count("replicas")) {
    ASSIGN_OR_RETURN(const int32_t replicas, ReplicasFlag(cl));
    submit.set_replicas(replicas);
  }
  RETURN_IF_ERROR(ApplyBounds(cl, [&](int32_t lo, int32_t hi) {
    submit.set_min_replicas(lo);
    submit.set_max_replicas(hi);
  }));
  ASSIGN_OR_RETURN(const CoordinatorConnection c, CoordinatorConnection::Open(cl, ResolveServerAddress(cl)));
  v1::Job job;
  RETURN_IF_ERROR(c.Check(c.stub()->SubmitJob(c.Context(60).get(), submit, &job)));
  std::fprintf(out, "%s\n", job.id().c_str());
  std::fflush(out);
  if (cl.switches.count("watch")) return Watch(c, job.id(), out, /*all_replicas=*/true);
  return absl::OkStatus();
}

absl::Status ScaleCommand(const CommandLine& cl, std::FILE* out) {
  v1::ScaleJobRequest scale;
  scale.set_job_id(JobId(cl));
  if (scale.job_id().empty()) return absl::InvalidArgumentError("scale needs a job id (or name)");
  RETURN_IF_ERROR(ApplyBounds(cl, [&](int32_t lo, int32_t hi) {
    scale.set_min_replicas(lo);
    scale.set_max_replicas(hi);
  }));
  if (!cl.values.count("replicas") && scale.max_replicas() == 0) {
    return absl::InvalidArgumentError("scale needs --replicas N, or --min-replicas A --max-replicas B");
  }
  if (cl.values.count("replicas")) {
    ASSIGN_OR_RETURN(const int32_t replicas, ReplicasFlag(cl));
    scale.set_replicas(replicas);
  }
  ASSIGN_OR_RETURN(const CoordinatorConnection c, CoordinatorConnection::Open(cl, ResolveServerAddress(cl)));
  v1::Job job;
  RETURN_IF_ERROR(c.Check(c.stub()->ScaleJob(c.Context(30).get(), scale, &job)));
  std::fprintf(out, "%s %s, %s replicas\n", job.id().c_str(), v1::JobState_Name(job.state()).c_str(),
               Replicas(job).c_str());
  std::fflush(out);
  if (cl.switches.count("watch")) return Watch(c, job.id(), out, /*all_replicas=*/true);
  return absl::OkStatus();
}

absl::Status UpdateCommand(const CommandLine& cl, std::FILE* out) {
  v1::UpdateJobRequest update;
  update.set_job_id(JobId(cl));
  if (update.job_id().empty()) return absl::InvalidArgumentError("update needs a job id (or name)");
  update.set_abort(cl.switches.count("abort") > 0);
  ASSIGN_OR_RETURN(const CoordinatorConnection c, CoordinatorConnection::Open(cl, ResolveServerAddress(cl)));
  if (!update.abort()) {
    // The job's request, changed where the flags say: what is not named stays as it runs.
    v1::GetJobRequest get;
    get.set_job_id(update.job_id());
    v1::Job job;
    RETURN_IF_ERROR(c.Check(c.stub()->GetJob(c.Context(30).get(), get, &job)));
    v1::PlanRequest request = job.request();
    const auto& v = cl.values;
    if (v.count("checkpoint") && !v.count("variant") && !v.count("config")) {
      // A new model version: its own config.json says its class and sizes.
      request.clear_variant();
      request.clear_config();
    }
    // Explicit layer counts fit the old pipeline only.
    if ((v.count("pp") || v.count("chunks") || v.count("pp-style")) && !v.count("layers-per-stage")) {
      request.mutable_parallel()->clear_num_layers_per_stage();
    }
    RETURN_IF_ERROR(ApplyPlanFlags(cl, &request));
    if (request.SerializeAsString() == job.request().SerializeAsString() && !v.count("checkpoint")) {
      return absl::InvalidArgumentError(
          "update changes nothing: name a new --tp, --pp, --pp-style, --sp-mode, --dtype or --checkpoint");
    }
    *update.mutable_request() = std::move(request);
  }
  v1::Job job;
  RETURN_IF_ERROR(c.Check(c.stub()->UpdateJob(c.Context(60).get(), update, &job)));
  if (update.abort()) {
    std::fprintf(out, "%s: %s\n", job.id().c_str(), job.last_update().c_str());
    return absl::OkStatus();
  }
  std::fprintf(out, "%s updating: %s\n", job.id().c_str(), job.update().progress().c_str());
  std::fflush(out);
  if (!cl.switches.count("watch")) return absl::OkStatus();
  const int32_t target = job.update().version();
  RETURN_IF_ERROR(Watch(c, job.id(), out, /*all_replicas=*/true));
  v1::GetJobRequest get;
  get.set_job_id(job.id());
  RETURN_IF_ERROR(c.Check(c.stub()->GetJob(c.Context(30).get(), get, &job)));
  // Ended without switching (aborted, or its new shape refused): the old shape serves on, exit 1.
  if (job.version() < target) {
    return absl::AbortedError(absl::StrCat("job ", job.id(), " did not switch over: ", job.last_update()));
  }
  std::fprintf(out, "%s\n", job.last_update().c_str());
  return absl::OkStatus();
}

absl::Status JobsCommand(const CommandLine& cl, std::FILE* out) {
  ASSIGN_OR_RETURN(const CoordinatorConnection c, CoordinatorConnection::Open(cl, ResolveServerAddress(cl)));
  // Every page, in order (a coordinator of before pages sends one answer with no token).
  v1::ListJobsResponse jobs;
  v1::ListJobsRequest request;
  for (int pages = 0; pages < 10000; ++pages) {
    v1::ListJobsResponse page;
    RETURN_IF_ERROR(c.Check(c.stub()->ListJobs(c.Context(30).get(), request, &page)));
    for (v1::Job& j : *page.mutable_jobs()) *jobs.add_jobs() = std::move(j);
    if (page.next_page_token().empty() || page.next_page_token() == request.page_token()) break;
    request.set_page_token(page.next_page_token());
  }
  std::fputs(absl::StrFormat("%-26s %-10s %-32s %-8s %-8s %-5s %s\n", "JOB", "STATE", "VARIANT", "TPxPP", "REPLICAS",
                             "AGE", "DETAIL")
                 .c_str(),
             out);
  for (const v1::Job& j : jobs.jobs()) {
    const auto& p = j.request().parallel();
    // Jobs submitted before the coordinator stored the resolved class have none.
    const std::string variant = j.request().variant() == v1::MODEL_VARIANT_UNSPECIFIED
                                    ? "(from checkpoint)"
                                    : std::string(planner::HfClassName(j.request().variant()));
    std::fputs(
        absl::StrFormat("%-26s %-10s %-32s %-8s %-8s %-5s %s\n", j.id(), v1::JobState_Name(j.state()), variant,
                        absl::StrCat(std::max<int64_t>(1, p.tp_size()), "x", std::max<int64_t>(1, p.pp_size())),
                        Replicas(j), Age(j.created_unix_millis()),
                        j.state() == v1::FAILED ? j.failure_cause()
                                                : (!j.pending_reason().empty() ? j.pending_reason() : j.degraded()))
            .c_str(),
        out);
  }
  return absl::OkStatus();
}

absl::Status JobCommand(const CommandLine& cl, std::FILE* out) {
  v1::GetJobRequest get;
  get.set_job_id(JobId(cl));
  if (get.job_id().empty()) return absl::InvalidArgumentError("job needs a job id");
  ASSIGN_OR_RETURN(const CoordinatorConnection c, CoordinatorConnection::Open(cl, ResolveServerAddress(cl)));
  v1::Job job;
  RETURN_IF_ERROR(c.Check(c.stub()->GetJob(c.Context(30).get(), get, &job)));
  std::fprintf(out, "%s\n", common::ProtoToJson(job).c_str());
  return absl::OkStatus();
}

absl::Status CancelCommand(const CommandLine& cl, std::FILE* out) {
  v1::GetJobRequest get;
  get.set_job_id(JobId(cl));
  if (get.job_id().empty()) return absl::InvalidArgumentError("cancel needs a job id");
  ASSIGN_OR_RETURN(const CoordinatorConnection c, CoordinatorConnection::Open(cl, ResolveServerAddress(cl)));
  v1::Job job;
  RETURN_IF_ERROR(c.Check(c.stub()->CancelJob(c.Context(30).get(), get, &job)));
  std::fprintf(out, "%s %s\n", job.id().c_str(), v1::JobState_Name(job.state()).c_str());
  return absl::OkStatus();
}

absl::Status WorkersCommand(const CommandLine& cl, std::FILE* out) {
  ASSIGN_OR_RETURN(const CoordinatorConnection c, CoordinatorConnection::Open(cl, ResolveServerAddress(cl)));
  v1::ListWorkersResponse workers;
  RETURN_IF_ERROR(c.Check(c.stub()->ListWorkers(c.Context(30).get(), v1::ListWorkersRequest(), &workers)));
  std::fputs(absl::StrFormat("%-12s %-22s %-7s %-8s %-10s %-26s %s\n", "WORKER", "ADDRESS", "DEVICE", "HEALTHY",
                             "FREE MEM", "JOB", "RANK")
                 .c_str(),
             out);
  for (const auto& w : workers.workers()) {
    std::fputs(
        absl::StrFormat("%-12s %-22s %-7s %-8s %-10s %-26s %s\n", w.worker_id(), w.address(), w.device(),
                        w.healthy() ? "yes" : "no", planner::HumanBytes(w.free_memory_bytes()),
                        w.job_id().empty() ? "-" : w.job_id(), w.job_id().empty() ? "-" : std::to_string(w.rank()))
            .c_str(),
        out);
  }
  return absl::OkStatus();
}

const std::vector<Flag>& SubmitFlags() {
  static const auto* flags = new std::vector<Flag>(
      JoinFlags({PlanRequestFlags(),
                 ConnectionFlags(),
                 {
                     {"backend", "gloo|nccl",
                      "nccl: GPU workers (shard-worker --device=cuda:N), one rank per GPU (default gloo)"},
                     {"name", "NAME",
                      "a name to find the job by beside its id (HTTP's `model`, docs/http.md): letters,\n"
                      "digits and ._-/: (e.g. minilm), unique among the jobs that have not ended"},
                     {"replicas", "N",
                      "independent replicas of the plan, each on its own tp x pp workers, behind the one\n"
                      "job (default 1, or --min-replicas; the coordinator's --max_replicas bounds it)"},
                     {"min-replicas", "A",
                      "with --max-replicas B: the coordinator scales the job between A and\n"
                      "B replicas by how busy they are (docs/service.md, Autoscaling)"},
                     {"max-replicas", "B", "see --min-replicas"},
                     {"watch", "",
                      "then print its states until it settles (every replica READY): exits 0; FAILED 1\n"
                      "with the cause"},
                     {"no-wait", "",
                      "refuse the job (FAILED_PRECONDITION, exit 1) instead of queueing it PENDING when\n"
                      "too few workers are idle; submit never waits for loading without --watch"},
                 }}));
  return *flags;
}

const std::vector<Flag>& UpdateFlags() {
  static const auto* flags = new std::vector<Flag>(
      JoinFlags({PlanRequestFlags(),
                 ConnectionFlags(),
                 {
                     {"watch", "", "then follow it until it has switched over (or ended) and say how"},
                     {"abort", "", "end the update that runs instead: its new replicas unload"},
                 }}));
  return *flags;
}

const std::vector<Flag>& ScaleFlags() {
  static const auto* flags = new std::vector<Flag>(
      JoinFlags({ConnectionFlags(),
                 {
                     {"replicas", "N",
                      "the job's new replica count (1 or more); without bounds it also\n"
                      "ends autoscaling"},
                     {"min-replicas", "A", "with --max-replicas B: autoscale the job between A and B from now on"},
                     {"max-replicas", "B", "see --min-replicas"},
                     {"watch", "", "then wait until every replica is READY"},
                 }}));
  return *flags;
}

absl::Status WatchCommand(const CommandLine& cl, std::FILE* out) {
  if (JobId(cl).empty()) return absl::InvalidArgumentError("watch needs a job id");
  ASSIGN_OR_RETURN(const CoordinatorConnection c, CoordinatorConnection::Open(cl, ResolveServerAddress(cl)));
  return Watch(c, JobId(cl), out);
}

int RunCoordinatorCommand(const CommandLine& cl, absl::Status (*command)(const CommandLine&, std::FILE*),
                          std::FILE* out, std::FILE* err) {
  // A token file or TLS files that cannot be used are the caller's mistake, said before any call.
  if (absl::StatusOr<std::string> token = ClientToken(cl); !token.ok()) {
    std::fprintf(err, "shardctl: %s\n", std::string(token.status().message()).c_str());
    return kExitInvalidInput;
  }
  if (auto credentials = ClientCredentials(cl); !credentials.ok()) {
    std::fprintf(err, "shardctl: %s\n", std::string(credentials.status().message()).c_str());
    return kExitInvalidInput;
  }
  const absl::Status status = command(cl, out);
  return status.ok() ? kExitOk : ReportError(err, status);
}

}  // namespace bertshard::client
