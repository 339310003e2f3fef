#include "client/run_command.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "checkpoint/safetensors.h"
#include "client/plan_command.h"
#include "common/file.h"
#include "common/secure_random.h"
#include "common/status_macros.h"
#include "model/gemm_flag.h"
#include "nlohmann/json.hpp"
#include "planner/model_config.h"
#include "planner/plan_format.h"
#include "planner/planner.h"
#include "planner/token_check.h"

extern char** environ;

namespace bertshard::client {
namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

absl::Status Invalid(absl::string_view message) { return absl::InvalidArgumentError(message); }

// Flattens a nested array of `depth` levels, checking it is rectangular and integral.
absl::Status Flatten(const json& value, const std::string& key, int depth, std::vector<int64_t>* shape,
                     std::vector<int64_t>* out, size_t level = 0) {
  if (level == static_cast<size_t>(depth)) {
    if (!value.is_number_integer()) {
      return Invalid(absl::StrCat(key, " must hold integers, found ", value.dump()));
    }
    out->push_back(value.get<int64_t>());
    return absl::OkStatus();
  }
  if (!value.is_array() || value.empty()) {
    return Invalid(absl::StrCat(key, " must be a non-empty ", depth, "-level nested array"));
  }
  if (shape->size() == level) shape->push_back(static_cast<int64_t>(value.size()));
  if ((*shape)[level] != static_cast<int64_t>(value.size())) {
    return Invalid(absl::StrCat(key, " is ragged: rows of different lengths"));
  }
  for (const auto& v : value) RETURN_IF_ERROR(Flatten(v, key, depth, shape, out, level + 1));
  return absl::OkStatus();
}

// The rank binary: --rank-binary, $BERTSHARD_RANK_BINARY, or next to this executable (installed
// side by side, or bazel-bin/client/../worker).
std::string FindRankBinary(const std::map<std::string, std::string>& flags) {
  if (auto it = flags.find("rank-binary"); it != flags.end()) return it->second;
  if (const char* env = std::getenv("BERTSHARD_RANK_BINARY")) return env;
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  std::string dir = n > 0 ? std::string(self, static_cast<size_t>(n)) : std::string();
  dir = dir.substr(0, dir.rfind('/'));
  for (const std::string& candidate : {dir + "/shard-rank", dir + "/../worker/shard-rank"}) {
    if (access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return dir + "/shard-rank";
}

std::string Tail(const std::string& path, size_t bytes = 2000) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  std::string s = text.str();
  return s.size() > bytes ? s.substr(s.size() - bytes) : s;
}

struct RankProcess {
  int rank = 0;
  pid_t pid = -1;
  bool done = false;
  int exit_code = 0;
  std::string log;
};

int ExitCode(int wait_status) {
  return WIFEXITED(wait_status) ? WEXITSTATUS(wait_status) : 128 + WTERMSIG(wait_status);
}

// Stops the ranks still running: SIGTERM, then SIGKILL to those not gone 3 s later; reaps them all.
void StopRanks(std::vector<RankProcess>& ranks) {
  for (RankProcess& r : ranks) {
    if (!r.done) kill(r.pid, SIGTERM);
  }
  const auto grace = Clock::now() + std::chrono::seconds(3);
  for (RankProcess& r : ranks) {
    while (!r.done) {
      int status = 0;
      if (waitpid(r.pid, &status, WNOHANG) == r.pid) {
        r.done = true;
      } else if (Clock::now() > grace) {
        kill(r.pid, SIGKILL);
        waitpid(r.pid, &status, 0);
        r.done = true;
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    }
  }
}

// Waits for every rank; the first failure (or the deadline) stops all the others.
absl::Status WaitForRanks(std::vector<RankProcess>& ranks, Clock::time_point deadline, int64_t timeout_s) {
  size_t remaining = ranks.size();
  std::string failure;
  while (remaining > 0) {
    bool progressed = false;
    for (RankProcess& r : ranks) {
      if (r.done) continue;
      int status = 0;
      const pid_t got = waitpid(r.pid, &status, WNOHANG);
      if (got != r.pid) continue;
      r.done = true;
      --remaining;
      progressed = true;
      r.exit_code = ExitCode(status);
      if (r.exit_code != 0 && failure.empty()) {
        failure = absl::StrCat("rank ", r.rank, " failed (exit ", r.exit_code, "):\n", Tail(r.log));
      }
    }
    if (failure.empty() && Clock::now() > deadline) {
      failure = absl::StrCat("ranks did not finish within ", timeout_s, " s");
    }
    if (!failure.empty()) break;
    if (!progressed) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (failure.empty()) return absl::OkStatus();
  StopRanks(ranks);
  return absl::AbortedError(failure);
}

// The port in rank 0's port file; NOT_FOUND while there is none yet. Rank 0 renames the file into
// place, so one that is there is whole.
absl::StatusOr<int> ReadPortFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("no port file ", path));
  std::stringstream text;
  text << in.rdbuf();
  int port = 0;
  if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(text.str()), &port) || port < 1 || port > 65535) {
    return absl::InternalError(absl::StrCat("rank 0 wrote a bad port file: '", text.str(), "'"));
  }
  return port;
}

// The port rank 0 bound for the rendezvous, once it has written it to `port_file`. Rank 0 exiting
// first, or the deadline passing, is ABORTED with what rank 0 printed; the caller stops it.
absl::StatusOr<int> WaitForRendezvousPort(const RankProcess& rank0, const std::string& port_file,
                                          Clock::time_point deadline, int64_t timeout_s) {
  while (true) {
    absl::StatusOr<int> port = ReadPortFile(port_file);
    if (!absl::IsNotFound(port.status())) return port;
    // WNOWAIT: rank 0 stays unreaped, for WaitForRanks or StopRanks to collect as any rank.
    siginfo_t info{};
    if (waitid(P_PID, static_cast<id_t>(rank0.pid), &info, WEXITED | WNOHANG | WNOWAIT) == 0 &&
        info.si_pid == rank0.pid) {
      // It may have written the port and ended (a world of one) since the read above.
      port = ReadPortFile(port_file);
      if (!absl::IsNotFound(port.status())) return port;
      const int exit_code = info.si_code == CLD_EXITED ? info.si_status : 128 + info.si_status;
      return absl::AbortedError(
          absl::StrCat("rank 0 failed (exit ", exit_code, ") before it hosted the rendezvous:\n", Tail(rank0.log)));
    }
    if (Clock::now() > deadline) {
      const std::string printed = Tail(rank0.log);
      return absl::AbortedError(absl::StrCat("rank 0 did not host the rendezvous within ", timeout_s, " s",
                                             printed.empty() ? "" : ":\n", printed));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

// "blas", "onednn", or under --gemm auto what was picked with the figures it was picked on:
// "onednn (auto: blas 80.1, onednn 95.3 GFLOP/s)".
std::string GemmColumn(const json& report) {
  std::string column = report.value("gemm", std::string("?"));
  if (auto it = report.find("gemm_gflops"); it != report.end() && it->is_object()) {
    std::vector<std::string> figures;
    for (const auto& [path, gflops] : it->items()) {
      if (gflops.is_number()) figures.push_back(absl::StrFormat("%s %.1f", path, gflops.get<double>()));
    }
    absl::StrAppend(&column, " (auto: ", absl::StrJoin(figures, ", "), " GFLOP/s)");
  }
  return column;
}

absl::Status Run(const CommandLine& cl, std::FILE* out) {
  const auto& v = cl.values;
  if (!cl.switches.count("local")) {
    return Invalid("run needs --local (ranks on this machine); running on workers is `shardctl submit`");
  }
  for (const char* required : {"checkpoint", "input", "output"}) {
    if (!v.count(required)) return Invalid(absl::StrCat("run needs --", required));
  }
  const std::string backend = v.count("backend") ? v.at("backend") : "gloo";
  if (backend != "gloo" && backend != "nccl") {
    return Invalid(absl::StrCat("--backend '", backend, "' is not one of gloo, nccl"));
  }
  int64_t micro_batches = 1, threads = 0, timeout_s = 600, iterations = 1;
  if (v.count("iterations") &&
      (!absl::SimpleAtoi(v.at("iterations"), &iterations) || iterations < 1 || iterations > 1000)) {
    return Invalid("--iterations needs an integer in 1..1000");
  }
  if (v.count("micro-batches") && (!absl::SimpleAtoi(v.at("micro-batches"), &micro_batches) || micro_batches < 1)) {
    return Invalid("--micro-batches needs a positive integer");
  }
  if (v.count("threads") && (!absl::SimpleAtoi(v.at("threads"), &threads) || threads < 1)) {
    return Invalid("--threads needs a positive integer (LibTorch threads per rank)");
  }
  if (v.count("timeout") && (!absl::SimpleAtoi(v.at("timeout"), &timeout_s) || timeout_s < 1)) {
    return Invalid("--timeout needs a positive number of seconds");
  }
  // Checked here, before any rank starts; each rank resolves "auto" itself (its own threads).
  const std::string gemm = v.count("gemm") ? v.at("gemm") : "auto";
  RETURN_IF_ERROR(model::ParseGemmFlag(gemm).status());
  const std::string tp_transport = v.count("tp-transport") ? v.at("tp-transport") : "auto";
  if (tp_transport != "auto" && tp_transport != "gloo") {
    return Invalid(absl::StrCat("--tp-transport ", tp_transport,
                                " is not one of auto (shared memory between ranks on one host), gloo"));
  }

  v1::PlanRequest request;
  RETURN_IF_ERROR(ApplyPlanFlags(cl, &request));
  ASSIGN_OR_RETURN(v1::ShardPlan plan, planner::Plan(request));
  ASSIGN_OR_RETURN(std::string input_text, common::ReadFileToString(v.at("input"), "input file"));
  ASSIGN_OR_RETURN(RunInputs inputs, ParseRunInputs(input_text, plan));
  if (micro_batches > inputs.batch) {
    return Invalid(absl::StrCat("--micro-batches ", micro_batches, " exceeds the batch size ", inputs.batch));
  }
  const int world = plan.world_size();
  if (threads == 0) threads = std::max<int64_t>(1, std::thread::hardware_concurrency() / world);

  char dir_template[] = "/tmp/shardctl-run-XXXXXX";
  const char* tmp = mkdtemp(dir_template);
  if (tmp == nullptr) return absl::InternalError("cannot create a temporary directory");
  const std::string dir = tmp;
  // The plan, inputs, logs and reports live here for the run only.
  struct RemoveDir {
    std::string path;
    ~RemoveDir() {
      std::error_code ignored;
      std::filesystem::remove_all(path, ignored);
    }
  } cleanup{dir};
  {
    std::ofstream plan_out(dir + "/plan.pb", std::ios::binary);
    plan.SerializeToOstream(&plan_out);
    json normalised = {{"rows", inputs.batch * inputs.choices},
                       {"seq", inputs.seq},
                       {"choices", inputs.choices},
                       {"input_ids", inputs.input_ids},
                       {"attention_mask", inputs.attention_mask},
                       {"token_type_ids", inputs.token_type_ids}};
    std::ofstream(dir + "/inputs.json") << normalised.dump();
  }
  const std::string binary = FindRankBinary(v);
  if (access(binary.c_str(), X_OK) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("rank binary ", binary, " not found; build //worker:shard-rank or pass --rank-binary"));
  }
  std::string checkpoint = request.checkpoint();
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry = *e;
    if (entry.rfind("OMP_NUM_THREADS=", 0) == 0 || entry.rfind("OPENBLAS_NUM_THREADS=", 0) == 0) continue;
    env_strings.push_back(entry);
  }
  env_strings.push_back(absl::StrCat("OMP_NUM_THREADS=", threads));
  env_strings.push_back(absl::StrCat("OPENBLAS_NUM_THREADS=", threads));
  std::vector<char*> envp;
  for (auto& e : env_strings) envp.push_back(e.data());
  envp.push_back(nullptr);

  // The run's rendezvous secret, for the ranks only: in a 0600 file of the run's 0700 directory,
  // never in argv (which any user of the host can read).
  const std::string secret_file = dir + "/rendezvous_secret";
  ASSIGN_OR_RETURN(const std::string secret, common::SecureRandomBytes(32));
  RETURN_IF_ERROR(common::WriteSecretFile(secret_file, secret));
  // `port` 0: rank 0 hosts the rendezvous on a port the system picks and writes it to port_file.
  const std::string port_file = dir + "/master_port";
  auto spawn = [&](int rank, int port) -> absl::StatusOr<RankProcess> {
    RankProcess r;
    r.rank = rank;
    r.log = absl::StrCat(dir, "/rank_", rank, ".log");
    std::vector<std::string> args = {
        binary,
        absl::StrCat("--plan=", dir, "/plan.pb"),
        absl::StrCat("--rank=", rank),
        "--master_addr=127.0.0.1",
        absl::StrCat("--master_port=", port),
        absl::StrCat("--rendezvous_secret_file=", secret_file),
        absl::StrCat("--checkpoint=", checkpoint),
        absl::StrCat("--inputs=", dir, "/inputs.json"),
        absl::StrCat("--micro_batches=", micro_batches),
        absl::StrCat("--output=", v.at("output")),
        absl::StrCat("--report=", dir, "/rank_", rank, ".json"),
        absl::StrCat("--threads=", threads),
        absl::StrCat("--timeout_s=", std::min<int64_t>(timeout_s, 600)),
        absl::StrCat("--iterations=", iterations),
        absl::StrCat("--backend=", backend),
        absl::StrCat("--gemm=", gemm),
        absl::StrCat("--tp_transport=", tp_transport),
    };
    if (port == 0) args.push_back(absl::StrCat("--port_file=", port_file));
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 1, r.log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&actions, 1, 2);
    const int rc = posix_spawn(&r.pid, binary.c_str(), &actions, nullptr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&actions);
    if (rc != 0) return absl::InternalError(absl::StrCat("cannot start ", binary, ": ", strerror(rc)));
    return r;
  };

  // Rank 0 first: it binds the rendezvous port itself and tells it, and only then do the others
  // start, with that port. A port found free here and bound by rank 0 later could be taken in
  // between (by anything on this host, such as another run doing the same).
  const auto deadline = Clock::now() + std::chrono::seconds(timeout_s);
  std::vector<RankProcess> ranks;
  ASSIGN_OR_RETURN(RankProcess rank0, spawn(0, 0));
  ranks.push_back(rank0);
  absl::StatusOr<int> port = WaitForRendezvousPort(ranks[0], port_file, deadline, timeout_s);
  for (int rank = 1; port.ok() && rank < world; ++rank) {
    absl::StatusOr<RankProcess> r = spawn(rank, *port);
    if (!r.ok()) {
      port = r.status();
      break;
    }
    ranks.push_back(*r);
  }
  if (!port.ok()) {
    StopRanks(ranks);
    return port.status();
  }
  RETURN_IF_ERROR(WaitForRanks(ranks, deadline, timeout_s));

  std::string table =
      absl::StrFormat("%-5s %-6s %-3s %9s %9s %10s %12s %12s  %s\n", "RANK", "STAGE", "TP", "LOAD s", "FORWARD s",
                      "PEAK RSS", "CKPT READ", absl::StrCat("PARAM B ", planner::DtypeName(plan.dtype())), "GEMM");
  json reports = json::array();
  for (int rank = 0; rank < world; ++rank) {
    ASSIGN_OR_RETURN(std::string text,
                     common::ReadFileToString(absl::StrCat(dir, "/rank_", rank, ".json"), "rank report"));
    const json report = json::parse(text, nullptr, false);
    if (report.is_discarded()) return absl::InternalError(absl::StrCat("rank ", rank, " wrote a bad report"));
    reports.push_back(report);
    absl::StrAppend(&table, absl::StrFormat("%-5d %-6d %-3d %9.3f %9.3f %10s %12d %12d  %s\n", rank,
                                            report.value("stage", 0), report.value("tp_rank", 0),
                                            report.value("load_seconds", 0.0), report.value("forward_seconds", 0.0),
                                            planner::HumanBytes(report.value("peak_rss_bytes", int64_t{0})),
                                            report.value("checkpoint_bytes_read", int64_t{0}),
                                            report.value("param_bytes", int64_t{0}), GemmColumn(report)));
  }
  ASSIGN_OR_RETURN(auto written, checkpoint::SafetensorsFile::Open(v.at("output")));
  std::vector<std::string> shapes;
  for (const auto& [name, info] : written->tensors()) {
    shapes.push_back(absl::StrCat(name, " [", absl::StrJoin(info.shape, ", "), "]"));
  }
  absl::StrAppend(&table, "outputs -> ", v.at("output"), ": ", absl::StrJoin(shapes, ", "), "\n");
  if (auto it = v.find("report"); it != v.end()) {
    std::ofstream report_out(it->second);
    report_out << reports.dump(2) << "\n";
    if (!report_out) return absl::InternalError(absl::StrCat("cannot write report ", it->second));
  }
  std::fputs(table.c_str(), out);
  return absl::OkStatus();
}

}  // namespace

const std::vector<Flag>& RunFlags() {
  static const auto* flags = new std::vector<Flag>(JoinFlags(
      {PlanRequestFlags(),
       {
           {"local", "", "ranks on this machine (required: on workers it is `shardctl submit`)"},
           {"input", "FILE.json", "token ids: {\"input_ids\": [[...]], \"attention_mask\", \"token_type_ids\"}"},
           {"output", "FILE.safetensors", "where the head stage writes the outputs (float32, HF names)"},
           {"micro-batches", "M", "pipeline micro-batches (default 1)"},
           {"threads", "T", "LibTorch threads per rank (default: the cores shared out)"},
           {"gemm", "auto|blas|onednn",
            "CPU matrix products: OpenBLAS via at::linear, or oneDNN with weights prepacked at\n"
            "load; auto, the default, times both in each rank and takes the faster"},
           {"tp-transport", "auto|gloo",
            "tensor-parallel collectives: auto, the default, goes through shared memory\n"
            "between ranks that share a host; gloo always uses Gloo's TCP"},
           {"backend", "gloo|nccl", "the ranks' collectives (default gloo)"},
           {"timeout", "SECONDS", "deadline of the whole run (default 600)"},
           {"iterations", "N", "forwards to time (1..1000, default 1)"},
           {"report", "FILE", "also write the per-rank figures as JSON"},
           {"rank-binary", "PATH", "the shard-rank binary (default $BERTSHARD_RANK_BINARY, else beside shardctl)"},
       }}));
  return *flags;
}

absl::StatusOr<RunInputs> ParseTokenJson(const std::string& text, int depth) {
  const json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return Invalid("input is not a JSON object");
  for (const auto& [key, value] : j.items()) {
    if (key != "input_ids" && key != "attention_mask" && key != "token_type_ids") {
      return Invalid(absl::StrCat("unknown input field '", key, "'; valid: input_ids, attention_mask, token_type_ids"));
    }
  }
  if (!j.contains("input_ids")) return Invalid("input needs input_ids");
  if (depth == 0)
    depth = j["input_ids"].is_array() && !j["input_ids"].empty() && j["input_ids"][0].is_array() &&
                    !j["input_ids"][0].empty() && j["input_ids"][0][0].is_array()
                ? 3
                : 2;
  const char* layout = depth == 3 ? "[batch, choices, seq]" : "[batch, seq]";
  RunInputs in;
  std::vector<int64_t> shape;
  if (absl::Status s = Flatten(j["input_ids"], "input_ids", depth, &shape, &in.input_ids); !s.ok()) {
    return Invalid(absl::StrCat(s.message(), " (input_ids is ", layout, " for this model)"));
  }
  in.batch = shape[0];
  in.choices = depth == 3 ? shape[1] : 1;
  in.seq = shape.back();
  auto other = [&](const char* key, int64_t fill, std::vector<int64_t>* out) -> absl::Status {
    if (!j.contains(key)) {
      out->assign(in.input_ids.size(), fill);
      return absl::OkStatus();
    }
    std::vector<int64_t> other_shape;
    RETURN_IF_ERROR(Flatten(j[key], key, depth, &other_shape, out));
    if (other_shape != shape) return Invalid(absl::StrCat(key, " must have the shape of input_ids"));
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(other("attention_mask", 1, &in.attention_mask));
  RETURN_IF_ERROR(other("token_type_ids", 0, &in.token_type_ids));
  return in;
}

absl::StatusOr<RunInputs> ParseRunInputs(const std::string& text, const v1::ShardPlan& plan) {
  ASSIGN_OR_RETURN(RunInputs in, ParseTokenJson(text, plan.variant() == v1::BERT_FOR_MULTIPLE_CHOICE ? 3 : 2));
  RETURN_IF_ERROR(planner::CheckInputsAgainstPlan(
      {in.batch * in.choices, in.seq, in.choices, in.input_ids, in.attention_mask, in.token_type_ids}, plan));
  return in;
}

int RunRunCommand(const CommandLine& cl, std::FILE* out, std::FILE* err) {
  const absl::Status status = Run(cl, out);
  return status.ok() ? kExitOk : ReportError(err, status);
}

}  // namespace bertshard::client
