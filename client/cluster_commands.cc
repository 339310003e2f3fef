#include "client/cluster_commands.h"

#include <unistd.h>

#include <chrono>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bertshard/v1/coordinator.grpc.pb.h"
#include "checkpoint/safetensors.h"
#include "client/plan_command.h"
#include "client/run_command.h"
#include "common/file.h"
#include "common/grpc_status.h"
#include "common/proto_json.h"
#include "common/status_macros.h"
#include "grpcpp/grpcpp.h"
#include "planner/model_config.h"
#include "planner/plan_format.h"

namespace bertshard::client {
namespace {

std::unique_ptr<v1::Coordinator::Stub> Connect(const CommandLine& cl) {
  std::string server = "127.0.0.1:50051";
  if (const char* env = std::getenv("BERTSHARD_SERVER")) server = env;
  if (auto it = cl.values.find("server"); it != cl.values.end()) server = it->second;
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(1 << 30);
  return v1::Coordinator::NewStub(grpc::CreateCustomChannel(server, grpc::InsecureChannelCredentials(), args));
}

std::unique_ptr<grpc::ClientContext> Context(const CommandLine& cl, int default_seconds) {
  int64_t seconds = default_seconds;
  if (auto it = cl.values.find("timeout"); it != cl.values.end()) seconds = std::max<int64_t>(1, std::atoll(it->second.c_str()));
  auto context = std::make_unique<grpc::ClientContext>();
  context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(seconds));
  return context;
}

std::string JobId(const CommandLine& cl) { return cl.positional.size() > 1 ? cl.positional[1] : ""; }

std::string Age(int64_t unix_millis) {
  const absl::Duration age = absl::Now() - absl::FromUnixMillis(unix_millis);
  if (age < absl::Minutes(1)) return absl::StrCat(absl::ToInt64Seconds(age), "s");
  if (age < absl::Hours(1)) return absl::StrCat(absl::ToInt64Minutes(age), "m");
  return absl::StrCat(absl::ToInt64Hours(age), "h");
}

// One line per event; on a terminal a progress bar redrawn in place.
void PrintEvent(const v1::JobEvent& e, std::FILE* out) {
  int64_t loaded = 0, total = 0;
  for (const auto& r : e.ranks()) {
    loaded += r.progress().bytes_loaded();
    total += r.progress().bytes_total();
  }
  const bool tty = isatty(fileno(out));
  const std::string state = v1::JobState_Name(e.job().state());
  if (e.job().state() == v1::LOADING && total > 0) {
    const int width = 30;
    const int filled = static_cast<int>(width * loaded / total);
    std::fprintf(out, "%s%s [%s%s] %3d%% %s / %s (%d ranks)%s", tty ? "\r" : "", state.c_str(),
                 std::string(static_cast<size_t>(filled), '#').c_str(), std::string(static_cast<size_t>(width - filled), '.').c_str(),
                 static_cast<int>(100 * loaded / total), planner::HumanBytes(loaded).c_str(),
                 planner::HumanBytes(total).c_str(), e.ranks_size(), tty ? "" : "\n");
  } else {
    std::fprintf(out, "%s%s%s%s\n", tty ? "\n" : "", state.c_str(),
                 e.job().failure_cause().empty() ? "" : (": " + e.job().failure_cause()).c_str(),
                 e.job().state() == v1::PENDING && !e.job().pending_reason().empty()
                     ? (" (" + e.job().pending_reason() + ")").c_str()
                     : "");
  }
  std::fflush(out);
}

absl::Status Watch(v1::Coordinator::Stub* stub, const std::string& id, const CommandLine& cl, std::FILE* out) {
  v1::GetJobRequest request;
  request.set_job_id(id);
  auto context = Context(cl, 3600);
  auto reader = stub->WatchJob(context.get(), request);
  v1::JobEvent event, last;
  v1::JobState printed = v1::JOB_STATE_UNSPECIFIED;
  int64_t printed_percent = -1;
  const bool tty = isatty(fileno(out));
  while (reader->Read(&event)) {
    int64_t loaded = 0, total = 0;
    for (const auto& r : event.ranks()) {
      loaded += r.progress().bytes_loaded();
      total += r.progress().bytes_total();
    }
    const int64_t percent = total > 0 ? 100 * loaded / total : 0;
    // A log gets a line per state and per quarter loaded; a terminal gets the bar redrawn.
    const bool progressed = event.job().state() == v1::LOADING && (tty || percent / 25 != printed_percent / 25);
    if (event.job().state() != printed || progressed) {
      PrintEvent(event, out);
      printed_percent = percent;
    }
    printed = event.job().state();
    last = event;
  }
  RETURN_IF_ERROR(common::FromGrpcStatus(reader->Finish()));
  if (last.job().state() == v1::FAILED) return absl::AbortedError(absl::StrCat("job ", id, " failed: ", last.job().failure_cause()));
  return absl::OkStatus();
}

absl::Status Submit(const CommandLine& cl, std::FILE* out) {
  v1::SubmitJobRequest submit;
  RETURN_IF_ERROR(ApplyPlanFlags(cl, submit.mutable_request()));
  if (submit.request().checkpoint().empty()) {
    return absl::InvalidArgumentError("submit needs --checkpoint DIR (as the workers see it)");
  }
  submit.set_fail_if_no_workers(cl.switches.count("no-wait") > 0);
  auto stub = Connect(cl);
  v1::Job job;
  RETURN_IF_ERROR(common::FromGrpcStatus(stub->SubmitJob(Context(cl, 60).get(), submit, &job)));
  std::fprintf(out, "%s\n", job.id().c_str());
  std::fflush(out);
  if (cl.switches.count("watch")) return Watch(stub.get(), job.id(), cl, out);
  return absl::OkStatus();
}

absl::Status Jobs(const CommandLine& cl, std::FILE* out) {
  v1::ListJobsResponse jobs;
  RETURN_IF_ERROR(common::FromGrpcStatus(Connect(cl)->ListJobs(Context(cl, 30).get(), v1::ListJobsRequest(), &jobs)));
  std::fputs(absl::StrFormat("%-26s %-10s %-32s %-8s %-5s %s\n", "JOB", "STATE", "VARIANT", "TPxPP", "AGE", "DETAIL").c_str(), out);
  for (const v1::Job& j : jobs.jobs()) {
    const auto& p = j.request().parallel();
    const std::string variant = j.request().variant() == v1::MODEL_VARIANT_UNSPECIFIED
                                    ? "(from checkpoint)"
                                    : std::string(planner::HfClassName(j.request().variant()));
    std::fputs(absl::StrFormat("%-26s %-10s %-32s %-8s %-5s %s\n", j.id(), v1::JobState_Name(j.state()), variant,
                               absl::StrCat(std::max<int64_t>(1, p.tp_size()), "x", std::max<int64_t>(1, p.pp_size())),
                               Age(j.created_unix_millis()),
                               j.state() == v1::FAILED ? j.failure_cause() : j.pending_reason())
                   .c_str(),
               out);
  }
  return absl::OkStatus();
}

absl::Status Job(const CommandLine& cl, std::FILE* out) {
  v1::GetJobRequest get;
  get.set_job_id(JobId(cl));
  if (get.job_id().empty()) return absl::InvalidArgumentError("job needs a job id");
  v1::Job job;
  RETURN_IF_ERROR(common::FromGrpcStatus(Connect(cl)->GetJob(Context(cl, 30).get(), get, &job)));
  std::fprintf(out, "%s\n", common::ProtoToJson(job).c_str());
  return absl::OkStatus();
}

absl::Status Cancel(const CommandLine& cl, std::FILE* out) {
  v1::GetJobRequest get;
  get.set_job_id(JobId(cl));
  if (get.job_id().empty()) return absl::InvalidArgumentError("cancel needs a job id");
  v1::Job job;
  RETURN_IF_ERROR(common::FromGrpcStatus(Connect(cl)->CancelJob(Context(cl, 30).get(), get, &job)));
  std::fprintf(out, "%s %s\n", job.id().c_str(), v1::JobState_Name(job.state()).c_str());
  return absl::OkStatus();
}

absl::Status Workers(const CommandLine& cl, std::FILE* out) {
  v1::ListWorkersResponse workers;
  RETURN_IF_ERROR(common::FromGrpcStatus(Connect(cl)->ListWorkers(Context(cl, 30).get(), v1::ListWorkersRequest(), &workers)));
  std::fputs(absl::StrFormat("%-12s %-22s %-7s %-8s %-10s %-26s %s\n", "WORKER", "ADDRESS", "DEVICE", "HEALTHY",
                             "FREE MEM", "JOB", "RANK")
                 .c_str(),
             out);
  for (const auto& w : workers.workers()) {
    std::fputs(absl::StrFormat("%-12s %-22s %-7s %-8s %-10s %-26s %s\n", w.worker_id(), w.address(), w.device(),
                               w.healthy() ? "yes" : "no", planner::HumanBytes(w.free_memory_bytes()),
                               w.job_id().empty() ? "-" : w.job_id(), w.job_id().empty() ? "-" : std::to_string(w.rank()))
                   .c_str(),
               out);
  }
  return absl::OkStatus();
}

absl::Status Infer(const CommandLine& cl, std::FILE* out) {
  v1::InferRequest infer;
  infer.set_job_id(JobId(cl));
  if (infer.job_id().empty()) return absl::InvalidArgumentError("infer needs a job id");
  const auto& v = cl.values;
  if (v.count("text") == v.count("input")) return absl::InvalidArgumentError("infer needs exactly one of --text or --input");
  if (auto it = v.find("text"); it != v.end()) {
    infer.mutable_text()->add_texts(it->second);
    if (auto pair = v.find("text-pair"); pair != v.end()) infer.mutable_text()->add_text_pairs(pair->second);
  } else {
    ASSIGN_OR_RETURN(std::string text, common::ReadFileToString(v.at("input"), "input file"));
    ASSIGN_OR_RETURN(RunInputs inputs, ParseTokenJson(text, 0));
    v1::TokenInputs* t = infer.mutable_tokens();
    t->set_rows(inputs.batch * inputs.choices);
    t->set_seq(inputs.seq);
    t->set_choices(inputs.choices);
    t->mutable_input_ids()->Add(inputs.input_ids.begin(), inputs.input_ids.end());
    t->mutable_attention_mask()->Add(inputs.attention_mask.begin(), inputs.attention_mask.end());
    t->mutable_token_type_ids()->Add(inputs.token_type_ids.begin(), inputs.token_type_ids.end());
  }
  if (auto it = v.find("micro-batches"); it != v.end()) infer.set_micro_batches(std::atoi(it->second.c_str()));
  v1::InferResponse response;
  RETURN_IF_ERROR(common::FromGrpcStatus(Connect(cl)->Infer(Context(cl, 600).get(), infer, &response)));
  std::fprintf(out, "input_ids: [%s]\n", absl::StrJoin(response.tokens().input_ids(), ", ").c_str());
  std::vector<checkpoint::TensorData> tensors;
  for (const v1::NamedTensor& t : response.outputs()) {
    std::vector<float> head(t.values().begin(), t.values().begin() + std::min(6, t.values_size()));
    std::fprintf(out, "%s [%s]: %s%s\n", t.name().c_str(), absl::StrJoin(t.shape(), ", ").c_str(),
                 absl::StrJoin(head, ", ", [](std::string* o, float f) { absl::StrAppend(o, absl::StrFormat("%.4f", f)); }).c_str(),
                 t.values_size() > 6 ? ", ..." : "");
    tensors.push_back({t.name(), {t.shape().begin(), t.shape().end()}, {t.values().begin(), t.values().end()}});
  }
  if (auto it = v.find("output"); it != v.end()) {
    RETURN_IF_ERROR(checkpoint::WriteSafetensors(it->second, tensors, {{"format", "pt"}}));
    std::fprintf(out, "outputs -> %s\n", it->second.c_str());
  }
  std::fprintf(out, "forward %.3f s\n", response.forward_seconds());
  return absl::OkStatus();
}

}  // namespace

bool IsClusterCommand(const std::string& c) {
  return c == "submit" || c == "jobs" || c == "job" || c == "watch" || c == "cancel" || c == "workers" || c == "infer";
}

const std::set<std::string>& ClusterValueFlags(const std::string& command) {
  static const auto* submit = [] {
    auto* f = new std::set<std::string>(PlanValueFlags());
    for (const char* drop : {"request", "output", "batch"}) f->erase(drop);
    return f;
  }();
  static const auto* infer = new std::set<std::string>{"server", "timeout", "text", "text-pair", "input", "output",
                                                        "micro-batches"};
  static const auto* plain = new std::set<std::string>{"server", "timeout"};
  if (command == "submit") return *submit;
  if (command == "infer") return *infer;
  return *plain;
}

const std::set<std::string>& ClusterSwitchFlags(const std::string& command) {
  static const auto* submit = [] {
    auto* f = new std::set<std::string>(PlanSwitchFlags());
    f->erase("local");
    f->insert("watch");
    f->insert("no-wait");
    return f;
  }();
  static const auto* plain = new std::set<std::string>{"help"};
  return command == "submit" ? *submit : *plain;
}

int RunClusterCommand(const CommandLine& cl, std::FILE* out, std::FILE* err) {
  const std::string& command = cl.positional[0];
  absl::Status status;
  if (command == "submit") {
    status = Submit(cl, out);
  } else if (command == "jobs") {
    status = Jobs(cl, out);
  } else if (command == "job") {
    status = Job(cl, out);
  } else if (command == "watch") {
    if (JobId(cl).empty()) {
      status = absl::InvalidArgumentError("watch needs a job id");
    } else {
      status = Watch(Connect(cl).get(), JobId(cl), cl, out);
    }
  } else if (command == "cancel") {
    status = Cancel(cl, out);
  } else if (command == "workers") {
    status = Workers(cl, out);
  } else {
    status = Infer(cl, out);
  }
  return status.ok() ? kExitOk : ReportError(err, status);
}

}  // namespace bertshard::client
