#include "client/cluster_commands.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <iostream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bertshard/v1/coordinator.grpc.pb.h"
#include "checkpoint/safetensors.h"
#include "client/plan_command.h"
#include "client/run_command.h"
#include "common/file.h"
#include "common/grpc_auth.h"
#include "common/grpc_status.h"
#include "common/proto_json.h"
#include "common/status_macros.h"
#include "grpcpp/grpcpp.h"
#include "planner/model_config.h"
#include "planner/plan_format.h"
#include "serving/pooling.h"

namespace bertshard::client {
namespace {

std::unique_ptr<v1::Coordinator::Stub> Connect(const CommandLine& cl) {
  std::string server = "127.0.0.1:50051";
  if (const char* env = std::getenv("BERTSHARD_SERVER")) server = env;
  if (auto it = cl.values.find("server"); it != cl.values.end()) server = it->second;
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(1 << 30);
  // Checked before any command runs (RunClusterCommand): here it loads.
  auto credentials = ClientCredentials(cl);
  return v1::Coordinator::NewStub(
      grpc::CreateCustomChannel(server, credentials.ok() ? *credentials : grpc::InsecureChannelCredentials(), args));
}

std::unique_ptr<grpc::ClientContext> Context(const CommandLine& cl, int default_seconds) {
  int64_t seconds = default_seconds;
  if (auto it = cl.values.find("timeout"); it != cl.values.end())
    seconds = std::max<int64_t>(1, std::atoll(it->second.c_str()));
  auto context = std::make_unique<grpc::ClientContext>();
  context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(seconds));
  // Checked before any command runs (shardctl.cc): here it loads.
  common::AttachToken(context.get(), ClientToken(cl).value_or(""));
  return context;
}

std::string JobId(const CommandLine& cl) { return cl.positional.size() > 1 ? cl.positional[1] : ""; }

// The offset of the first byte of `text` that is not part of a well-formed UTF-8 sequence (no
// overlong forms, surrogates or code points past U+10FFFF), or -1 when there is none.
int64_t FirstInvalidUtf8Byte(absl::string_view text) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  for (size_t i = 0; i < n;) {
    const unsigned char c = s[i];
    if (c < 0x80) {  // ASCII
      ++i;
      continue;
    }
    size_t length = 0;
    unsigned char low = 0x80, high = 0xbf;  // the allowed range of the second byte
    if (c >= 0xc2 && c <= 0xdf) {
      length = 2;
    } else if (c >= 0xe0 && c <= 0xef) {
      length = 3;
      if (c == 0xe0) low = 0xa0;   // overlong
      if (c == 0xed) high = 0x9f;  // surrogates
    } else if (c >= 0xf0 && c <= 0xf4) {
      length = 4;
      if (c == 0xf0) low = 0x90;   // overlong
      if (c == 0xf4) high = 0x8f;  // past U+10FFFF
    } else {
      return static_cast<int64_t>(i);  // a continuation byte, or a lead byte UTF-8 never uses
    }
    if (i + length > n || s[i + 1] < low || s[i + 1] > high) return static_cast<int64_t>(i);
    for (size_t k = 2; k < length; ++k) {
      if (s[i + k] < 0x80 || s[i + k] > 0xbf) return static_cast<int64_t>(i);
    }
    i += length;
  }
  return -1;
}

// Texts travel in proto `string` fields, which must be UTF-8: gRPC would refuse to send the
// request and report only a bare INTERNAL, so the text is checked here, with the byte named.
absl::Status CheckUtf8(absl::string_view text, absl::string_view what) {
  const int64_t bad = FirstInvalidUtf8Byte(text);
  if (bad < 0) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(what, " is not valid UTF-8 (byte ", bad, ")"));
}

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
                 std::string(static_cast<size_t>(filled), '#').c_str(),
                 std::string(static_cast<size_t>(width - filled), '.').c_str(), static_cast<int>(100 * loaded / total),
                 planner::HumanBytes(loaded).c_str(), planner::HumanBytes(total).c_str(), e.ranks_size(),
                 tty ? "" : "\n");
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
  if (last.job().state() == v1::FAILED)
    return absl::AbortedError(absl::StrCat("job ", id, " failed: ", last.job().failure_cause()));
  return absl::OkStatus();
}

absl::Status Submit(const CommandLine& cl, std::FILE* out) {
  v1::SubmitJobRequest submit;
  RETURN_IF_ERROR(ApplyPlanFlags(cl, submit.mutable_request()));
  if (submit.request().checkpoint().empty()) {
    return absl::InvalidArgumentError("submit needs --checkpoint DIR (as the workers see it)");
  }
  submit.set_fail_if_no_workers(cl.switches.count("no-wait") > 0);
  // Checked by the coordinator (INVALID_ARGUMENT, exit 2), which knows the backends it places.
  if (cl.values.count("backend")) submit.set_backend(cl.values.at("backend"));
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
  std::fputs(
      absl::StrFormat("%-26s %-10s %-32s %-8s %-5s %s\n", "JOB", "STATE", "VARIANT", "TPxPP", "AGE", "DETAIL").c_str(),
      out);
  for (const v1::Job& j : jobs.jobs()) {
    const auto& p = j.request().parallel();
    // Jobs submitted before the coordinator stored the resolved class have none.
    const std::string variant = j.request().variant() == v1::MODEL_VARIANT_UNSPECIFIED
                                    ? "(from checkpoint)"
                                    : std::string(planner::HfClassName(j.request().variant()));
    std::fputs(
        absl::StrFormat("%-26s %-10s %-32s %-8s %-5s %s\n", j.id(), v1::JobState_Name(j.state()), variant,
                        absl::StrCat(std::max<int64_t>(1, p.tp_size()), "x", std::max<int64_t>(1, p.pp_size())),
                        Age(j.created_unix_millis()), j.state() == v1::FAILED ? j.failure_cause() : j.pending_reason())
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
  RETURN_IF_ERROR(
      common::FromGrpcStatus(Connect(cl)->ListWorkers(Context(cl, 30).get(), v1::ListWorkersRequest(), &workers)));
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

// Token ids from a JSON file in `shardctl run`'s input format.
absl::Status ReadTokenInputs(const std::string& path, v1::TokenInputs* t) {
  ASSIGN_OR_RETURN(std::string text, common::ReadFileToString(path, "input file"));
  ASSIGN_OR_RETURN(RunInputs inputs, ParseTokenJson(text, 0));
  t->set_rows(inputs.batch * inputs.choices);
  t->set_seq(inputs.seq);
  t->set_choices(inputs.choices);
  t->mutable_input_ids()->Add(inputs.input_ids.begin(), inputs.input_ids.end());
  t->mutable_attention_mask()->Add(inputs.attention_mask.begin(), inputs.attention_mask.end());
  t->mutable_token_type_ids()->Add(inputs.token_type_ids.begin(), inputs.token_type_ids.end());
  return absl::OkStatus();
}

absl::StatusOr<int> IntFlag(const CommandLine& cl, const std::string& name, int low) {
  auto it = cl.values.find(name);
  if (it == cl.values.end()) return 0;
  int value = 0;
  if (!absl::SimpleAtoi(it->second, &value) || value < low) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", name, " must be an integer >= ", low, ", got '", it->second, "'"));
  }
  return value;
}

std::string Score(float score) { return absl::StrFormat("%.4f", score); }

// The head's predictions, one block per batch entry.
void PrintPredictions(const v1::InferResponse& response, std::FILE* out) {
  for (int i = 0; i < response.predictions_size(); ++i) {
    const v1::Prediction& p = response.predictions(i);
    const std::string prefix = response.predictions_size() > 1 ? absl::StrCat("[", i, "] ") : "";
    for (const v1::MaskPrediction& m : p.masks()) {
      std::fprintf(out, "%s[MASK] at %lld:", prefix.c_str(), static_cast<long long>(m.position()));
      for (const v1::TokenScore& t : m.top())
        std::fprintf(out, "  %s (%s)", t.token().c_str(), Score(t.score()).c_str());
      std::fprintf(out, "\n");
    }
    if (p.labels_size() > 0) {
      std::fprintf(out, "%slabels:", prefix.c_str());
      for (const v1::LabelScore& l : p.labels())
        std::fprintf(out, "  %s (%s)", l.label().c_str(), Score(l.score()).c_str());
      std::fprintf(out, "\n");
    }
    for (const v1::TokenLabel& t : p.token_labels()) {
      std::fprintf(out, "%s%-16s %s (%s)\n", prefix.c_str(), t.token().c_str(), t.label().label().c_str(),
                   Score(t.label().score()).c_str());
    }
    if (p.has_answer()) {
      std::fprintf(out, "%sanswer: \"%s\" (tokens %lld..%lld, score %s)\n", prefix.c_str(), p.answer().text().c_str(),
                   static_cast<long long>(p.answer().start()), static_cast<long long>(p.answer().end()),
                   Score(p.answer().score()).c_str());
    }
  }
}

absl::Status Infer(const CommandLine& cl, std::FILE* out) {
  v1::InferRequest infer;
  infer.set_job_id(JobId(cl));
  if (infer.job_id().empty()) return absl::InvalidArgumentError("infer needs a job id");
  const auto& v = cl.values;
  // Said before the general rule: with --input a pair used to be dropped without a word, and the
  // request then ran on something other than what was asked.
  if (v.count("text-pair") && !v.count("text")) {
    return absl::InvalidArgumentError(
        "--text-pair needs --text (the pair's first text); token inputs (--input) carry "
        "their own token_type_ids");
  }
  if (v.count("text") == v.count("input"))
    return absl::InvalidArgumentError("infer needs exactly one of --text or --input");
  if (auto it = v.find("text"); it != v.end()) {
    RETURN_IF_ERROR(CheckUtf8(it->second, "--text"));
    infer.mutable_text()->add_texts(it->second);
    if (auto pair = v.find("text-pair"); pair != v.end()) {
      RETURN_IF_ERROR(CheckUtf8(pair->second, "--text-pair"));
      infer.mutable_text()->add_text_pairs(pair->second);
    }
  } else {
    RETURN_IF_ERROR(ReadTokenInputs(v.at("input"), infer.mutable_tokens()));
  }
  ASSIGN_OR_RETURN(const int micro_batches, IntFlag(cl, "micro-batches", 1));
  ASSIGN_OR_RETURN(const int top_k, IntFlag(cl, "top-k", 1));
  infer.set_micro_batches(micro_batches);
  infer.set_top_k(top_k);
  infer.set_truncate(cl.switches.count("truncate") > 0);
  v1::InferResponse response;
  RETURN_IF_ERROR(common::FromGrpcStatus(Connect(cl)->Infer(Context(cl, 600).get(), infer, &response)));
  std::fprintf(out, "input_ids: [%s]%s\n", absl::StrJoin(response.tokens().input_ids(), ", ").c_str(),
               std::find(response.truncated().begin(), response.truncated().end(), true) != response.truncated().end()
                   ? " (truncated)"
                   : "");
  // For a pair, where the second segment starts: the [SEP]s alone do not say which is which once
  // a segment was truncated to nothing.
  if (infer.has_text() && infer.text().text_pairs_size() > 0) {
    std::fprintf(out, "token_type_ids: [%s]\n", absl::StrJoin(response.tokens().token_type_ids(), ", ").c_str());
  }
  PrintPredictions(response, out);
  // Raw tensors: their shapes here, their values with --output (a person reads the predictions).
  std::vector<checkpoint::TensorData> tensors;
  for (const v1::NamedTensor& t : response.outputs()) {
    std::fprintf(out, "%s [%s]\n", t.name().c_str(), absl::StrJoin(t.shape(), ", ").c_str());
    tensors.push_back({t.name(), {t.shape().begin(), t.shape().end()}, {t.values().begin(), t.values().end()}});
  }
  if (auto it = v.find("output"); it != v.end()) {
    RETURN_IF_ERROR(checkpoint::WriteSafetensors(it->second, tensors, {{"format", "pt"}}));
    std::fprintf(out, "outputs -> %s\n", it->second.c_str());
  }
  std::fprintf(out, "forward %.3f s (batched with %d request%s, %lld padded tokens)\n", response.forward_seconds(),
               response.batch().requests(), response.batch().requests() == 1 ? "" : "s",
               static_cast<long long>(response.batch().padded_tokens()));
  return absl::OkStatus();
}

// The pooling names serving/pooling.h parses, as the enum.
absl::StatusOr<v1::Pooling> ParsePoolingFlag(const std::string& name) {
  auto pooling = serving::ParsePooling(name);
  if (!pooling.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown --pooling '", name, "' (valid: mean, cls, max, mean_sqrt_len)"));
  }
  switch (*pooling) {
    case serving::Pooling::kMean:
      return v1::POOLING_MEAN;
    case serving::Pooling::kCls:
      return v1::POOLING_CLS;
    case serving::Pooling::kMax:
      return v1::POOLING_MAX;
    case serving::Pooling::kMeanSqrtLen:
      return v1::POOLING_MEAN_SQRT_LEN;
  }
  return absl::InternalError("unreachable");
}

std::string PoolingFlagName(v1::Pooling p) {
  switch (p) {
    case v1::POOLING_MEAN:
      return serving::PoolingName(serving::Pooling::kMean);
    case v1::POOLING_CLS:
      return serving::PoolingName(serving::Pooling::kCls);
    case v1::POOLING_MAX:
      return serving::PoolingName(serving::Pooling::kMax);
    case v1::POOLING_MEAN_SQRT_LEN:
      return serving::PoolingName(serving::Pooling::kMeanSqrtLen);
    default:
      return "unspecified";
  }
}

// shardctl embed ID TEXT... | --file FILE | --input TOKENS.json
absl::Status Embed(const CommandLine& cl, std::FILE* out) {
  v1::EmbedRequest embed;
  embed.set_job_id(JobId(cl));
  if (embed.job_id().empty()) return absl::InvalidArgumentError("embed needs a job id");
  const auto& v = cl.values;
  std::vector<std::string> texts(cl.positional.begin() + std::min<size_t>(2, cl.positional.size()),
                                 cl.positional.end());
  if (auto it = v.find("file"); it != v.end()) {
    std::string content;
    if (it->second == "-") {
      std::stringstream in;
      in << std::cin.rdbuf();
      content = in.str();
    } else {
      ASSIGN_OR_RETURN(content, common::ReadFileToString(it->second, "text file"));
    }
    for (absl::string_view line : absl::StrSplit(content, '\n', absl::SkipEmpty())) texts.emplace_back(line);
  }
  if (texts.empty() == (v.count("input") == 0)) {
    return absl::InvalidArgumentError(
        "embed needs texts (arguments or --file, one per line) or --input TOKENS.json, not both");
  }
  if (v.count("input")) {
    RETURN_IF_ERROR(ReadTokenInputs(v.at("input"), embed.mutable_tokens()));
  } else {
    for (size_t i = 0; i < texts.size(); ++i) {
      RETURN_IF_ERROR(CheckUtf8(texts[i], absl::StrCat("text ", i)));
      embed.mutable_text()->add_texts(texts[i]);
    }
  }
  if (auto it = v.find("pooling"); it != v.end()) {
    ASSIGN_OR_RETURN(v1::Pooling pooling, ParsePoolingFlag(it->second));
    embed.set_pooling(pooling);
  }
  if (auto it = v.find("normalize"); it != v.end()) {
    if (it->second != "true" && it->second != "false") {
      return absl::InvalidArgumentError(absl::StrCat("--normalize must be true or false, got '", it->second, "'"));
    }
    embed.set_normalize(it->second == "true" ? v1::NORMALIZE_ON : v1::NORMALIZE_OFF);
  }
  embed.set_truncate(cl.switches.count("truncate") > 0);
  const std::string format = v.count("format") ? v.at("format") : "table";
  if (format != "table" && format != "json") {
    return absl::InvalidArgumentError(absl::StrCat("--format must be table or json, got '", format, "'"));
  }
  v1::EmbedResponse response;
  RETURN_IF_ERROR(common::FromGrpcStatus(Connect(cl)->Embed(Context(cl, 600).get(), embed, &response)));
  if (format == "json") {
    std::fprintf(out, "%s\n", common::ProtoToJson(response).c_str());
    return absl::OkStatus();
  }
  const int n = response.embeddings_size();
  std::fprintf(out, "%d embedding%s of %d dimensions (pooling %s, %snormalized, max length %d)\n", n, n == 1 ? "" : "s",
               n > 0 ? response.embeddings(0).values_size() : 0, PoolingFlagName(response.pooling()).c_str(),
               response.normalized() ? "" : "not ", response.max_length());
  auto label = [&](int i) {
    std::string text = i < static_cast<int>(texts.size()) ? texts[static_cast<size_t>(i)] : absl::StrCat("row ", i);
    if (text.size() > 48) text = text.substr(0, 45) + "...";
    return text;
  };
  for (int i = 0; i < n; ++i) {
    const auto& e = response.embeddings(i);
    std::vector<float> head(e.values().begin(), e.values().begin() + std::min(4, e.values_size()));
    std::fprintf(out, "[%d] %-48s %3d tokens%s  [%s, ...]\n", i, label(i).c_str(),
                 i < response.token_counts_size() ? response.token_counts(i) : 0,
                 i < response.truncated_size() && response.truncated(i) ? " (truncated)" : "",
                 absl::StrJoin(head, ", ", [](std::string* o, float f) {
                   absl::StrAppend(o, absl::StrFormat("%.4f", f));
                 }).c_str());
  }
  if (n > 1) {
    std::vector<std::vector<float>> vectors;
    for (const auto& e : response.embeddings()) vectors.emplace_back(e.values().begin(), e.values().end());
    std::fprintf(out, "\ncosine similarity\n     ");
    for (int j = 0; j < n; ++j) std::fprintf(out, " %6s", absl::StrCat("[", j, "]").c_str());
    std::fprintf(out, "\n");
    for (int i = 0; i < n; ++i) {
      std::fprintf(out, "%-5s", absl::StrCat("[", i, "]").c_str());
      for (int j = 0; j < n; ++j)
        std::fprintf(out, " %6.3f", serving::Cosine(vectors[static_cast<size_t>(i)], vectors[static_cast<size_t>(j)]));
      std::fprintf(out, "\n");
    }
  }
  return absl::OkStatus();
}

}  // namespace

bool IsClusterCommand(const std::string& c) {
  return c == "submit" || c == "jobs" || c == "job" || c == "watch" || c == "cancel" || c == "workers" ||
         c == "infer" || c == "embed";
}

const std::set<std::string>& ClusterValueFlags(const std::string& command) {
  static const auto* submit = [] {
    auto* f = new std::set<std::string>(PlanValueFlags());
    for (const char* drop : {"request", "output", "batch"}) f->erase(drop);
    f->insert("backend");
    return f;
  }();
  static const auto* infer =
      new std::set<std::string>{"server", "timeout",   "token-file", "tls-ca", "tls-cert",      "tls-key",
                                "text",   "text-pair", "input",      "output", "micro-batches", "top-k"};
  static const auto* embed =
      new std::set<std::string>{"server", "timeout", "token-file", "tls-ca",    "tls-cert", "tls-key",
                                "file",   "input",   "pooling",    "normalize", "format"};
  static const auto* plain =
      new std::set<std::string>{"server", "timeout", "token-file", "tls-ca", "tls-cert", "tls-key"};
  if (command == "submit") return *submit;
  if (command == "infer") return *infer;
  if (command == "embed") return *embed;
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
  static const auto* truncating = new std::set<std::string>{"help", "truncate"};
  if (command == "infer" || command == "embed") return *truncating;
  return command == "submit" ? *submit : *plain;
}

int RunClusterCommand(const CommandLine& cl, std::FILE* out, std::FILE* err) {
  // A token file that cannot be read is the caller's mistake, said before any call.
  if (absl::StatusOr<std::string> token = ClientToken(cl); !token.ok()) {
    std::fprintf(err, "shardctl: %s\n", std::string(token.status().message()).c_str());
    return kExitInvalidInput;
  }
  if (auto credentials = ClientCredentials(cl); !credentials.ok()) {
    std::fprintf(err, "shardctl: %s\n", std::string(credentials.status().message()).c_str());
    return kExitInvalidInput;
  }
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
  } else if (command == "embed") {
    status = Embed(cl, out);
  } else {
    status = Infer(cl, out);
  }
  return status.ok() ? kExitOk : ReportError(err, status);
}

}  // namespace bertshard::client
