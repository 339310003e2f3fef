#include "client/plan_command.h"

#include <unistd.h>

#include <cctype>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "bertshard/v1/coordinator.grpc.pb.h"
#include "client/coordinator_connection.h"
#include "common/file.h"
#include "common/proto_json.h"
#include "common/status_macros.h"
#include "google/protobuf/arena.h"
#include "google/protobuf/struct.pb.h"
#include "planner/model_config.h"
#include "planner/plan_format.h"
#include "planner/planner.h"

namespace bertshard::client {
namespace {

// Plans a request into `*plan` (which may live on an arena).
using PlanFn = std::function<absl::Status(const v1::PlanRequest&, v1::ShardPlan* plan)>;

absl::StatusOr<v1::PipelineStyle> ParsePipelineStyle(absl::string_view text) {
  const std::string s = absl::AsciiStrToLower(text);
  if (s == "1f1b" || s == "one_f_one_b") return v1::ONE_F_ONE_B;
  if (s == "interleaved") return v1::INTERLEAVED;
  if (s == "zbv") return v1::ZBV;
  return absl::InvalidArgumentError(absl::StrCat("unknown pipeline style '", text, "'; valid: 1f1b, interleaved, zbv"));
}

absl::StatusOr<v1::SequenceParallelMode> ParseSpMode(absl::string_view text) {
  const std::string s = absl::AsciiStrToLower(text);
  if (s == "none" || s == "sp_none" || s.empty()) return v1::SP_NONE;
  if (s == "split_gather") return v1::SPLIT_GATHER;
  if (s == "ring") return v1::RING;
  if (s == "all_to_all") return v1::ALL_TO_ALL;
  if (s == "ring_attn") return v1::RING_ATTN;
  return absl::InvalidArgumentError(absl::StrCat("unknown sequence parallel mode '", text,
                                                 "'; valid: none, split_gather, ring (all_to_all "
                                                 "and ring_attn are refused for BERT)"));
}

absl::StatusOr<int64_t> ParseInt(const std::string& flag, const std::string& text) {
  int64_t value = 0;
  if (!absl::SimpleAtoi(text, &value)) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, " needs an integer, got '", text, "'"));
  }
  return value;
}

// Rewrites the friendly spellings of enum fields to their enum names, in a parsed JSON object,
// and takes out `config`, which is read as a HuggingFace config.json (see ParsePlanRequestJson).
absl::StatusOr<google::protobuf::Struct> NormaliseRequest(google::protobuf::Struct* root) {
  auto& fields = *root->mutable_fields();
  google::protobuf::Struct config;
  if (auto it = fields.find("config"); it != fields.end()) {
    if (it->second.has_struct_value()) {
      config = it->second.struct_value();
    } else if (!it->second.has_null_value()) {
      return absl::InvalidArgumentError("request field config must be an object of config.json fields");
    }
    fields.erase(it);
  }
  if (auto it = fields.find("variant"); it != fields.end() && it->second.has_string_value()) {
    ASSIGN_OR_RETURN(v1::ModelVariant v, planner::ParseVariant(it->second.string_value()));
    it->second.set_string_value(v1::ModelVariant_Name(v));
  }
  if (auto it = fields.find("dtype"); it != fields.end() && it->second.has_string_value()) {
    ASSIGN_OR_RETURN(v1::Dtype d, planner::ParseDtype(it->second.string_value()));
    it->second.set_string_value(v1::Dtype_Name(d));
  }
  if (auto it = fields.find("parallel"); it != fields.end() && it->second.has_struct_value()) {
    auto& parallel = *it->second.mutable_struct_value()->mutable_fields();
    if (auto s = parallel.find("pp_style"); s != parallel.end() && s->second.has_string_value()) {
      v1::PipelineStyle style;
      if (!v1::PipelineStyle_Parse(s->second.string_value(), &style)) {
        ASSIGN_OR_RETURN(style, ParsePipelineStyle(s->second.string_value()));
      }
      s->second.set_string_value(v1::PipelineStyle_Name(style));
    }
    if (auto s = parallel.find("sp_mode"); s != parallel.end() && s->second.has_string_value()) {
      v1::SequenceParallelMode mode;
      if (!v1::SequenceParallelMode_Parse(s->second.string_value(), &mode)) {
        ASSIGN_OR_RETURN(mode, ParseSpMode(s->second.string_value()));
      }
      s->second.set_string_value(v1::SequenceParallelMode_Name(mode));
    }
  }
  return config;
}

PlanFn LocalPlanner() {
  return [](const v1::PlanRequest& r, v1::ShardPlan* plan) { return planner::PlanInto(r, plan); };
}

// Plans on the coordinator at --server. (`plan` reads no $BERTSHARD_SERVER: without --server it
// plans here.)
absl::StatusOr<PlanFn> RemotePlanner(const CommandLine& cl) {
  ASSIGN_OR_RETURN(
      CoordinatorConnection connection,
      CoordinatorConnection::Open(cl, {cl.values.at("server"), "--server", "--server HOST:PORT"}, 256 << 20));
  auto shared = std::make_shared<CoordinatorConnection>(std::move(connection));
  return [shared](const v1::PlanRequest& r, v1::ShardPlan* plan) -> absl::Status {
    return shared->Check(shared->stub()->Plan(shared->Context(30).get(), r, plan));
  };
}

// One request per line; one output line per request, in order. Errors are data here, so the
// command succeeds as long as it could read the file.
int RunBatch(const std::string& path, const PlanFn& plan_fn, std::FILE* out, std::FILE* err) {
  std::ifstream file;
  std::istream* in = &std::cin;
  if (path != "-") {
    file.open(path, std::ios::binary);
    if (!file) {
      return ReportError(err, absl::InvalidArgumentError(absl::StrCat("cannot read batch file ", path)));
    }
    in = &file;
  }
  std::string line, buffer;
  int64_t line_number = 0;
  while (std::getline(*in, line)) {
    ++line_number;
    if (absl::StripAsciiWhitespace(line).empty()) continue;
    google::protobuf::Arena arena;  // a plan is ~1-2k small messages: allocate them together
    auto* plan = google::protobuf::Arena::CreateMessage<v1::ShardPlan>(&arena);
    absl::StatusOr<v1::PlanRequest> request = ParsePlanRequestJson(line);
    const absl::Status status = request.ok() ? plan_fn(*request, plan) : request.status();
    if (status.ok()) {
      planner::AppendPlanJson(*plan, 0, &buffer);
    } else {
      buffer.append(planner::FormatErrorJson(status));
    }
    buffer.push_back('\n');
    if (buffer.size() > (1 << 20)) {
      std::fwrite(buffer.data(), 1, buffer.size(), out);
      buffer.clear();
    }
  }
  std::fwrite(buffer.data(), 1, buffer.size(), out);
  std::fflush(out);
  return kExitOk;
}

}  // namespace

int ReportError(std::FILE* err, const absl::Status& status) {
  std::fprintf(err, "shardctl: %s: %s\n", absl::StatusCodeToString(status.code()).c_str(),
               std::string(status.message()).c_str());
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
      return kExitInvalidInput;
    case absl::StatusCode::kNotFound:
      return kExitNotFound;
    default:
      return kExitFailure;
  }
}

const std::vector<Flag>& PlanRequestFlags() {
  static const auto* flags = new std::vector<Flag>{
      {"variant", "NAME",
       "BertModel, BertForPreTraining, BertLMHeadModel, BertForMaskedLM,\n"
       "BertForNextSentencePrediction, BertForSequenceClassification,\n"
       "BertForTokenClassification, BertForMultipleChoice, BertForQuestionAnswering\n"
       "(or BERT_FOR_MASKED_LM style names)"},
      {"config", "FILE|JSON", "HuggingFace config.json fields (a file, or inline JSON)"},
      {"checkpoint", "DIR", "HuggingFace model directory; its config.json fills config and variant"},
      {"tp", "N", "tensor parallel size (1: off)"},
      {"pp", "N", "pipeline stages (1: no pipeline)"},
      {"pp-style", "S", "1f1b (default), interleaved, zbv"},
      {"chunks", "N", "model chunks per stage (interleaved: > 1; zbv: 2)"},
      {"layers-per-stage", "A,B,..", "explicit layer count per pipeline slot (stages x chunks)"},
      {"sp-mode", "M", "none, split_gather, ring (all_to_all, ring_attn are refused)"},
      {"vocab-multiple", "N", "make_vocab_size_divisible_by (default 64)"},
      {"dtype", "D",
       "fp32 (default), bf16 or fp16: the dtype ranks hold weights and compute in\n"
       "(converted at load from any float checkpoint; outputs stay float32; param bytes\n"
       "follow it). fp16 needs CUDA: a CPU rank refuses it"},
      {"fused-norm", "", "enable_fused_normalization"},
      {"jit-fused", "", "enable_jit_fused"},
      {"all-optimization", "", "enable_all_optimization"},
      {"fp8", "", "fp8_communication"},
  };
  return *flags;
}

const std::vector<Flag>& PlanFlags() {
  static const auto* flags = new std::vector<Flag>(JoinFlags({
      {{"request", "FILE", "PlanRequest JSON (same as the positional REQUEST.json)"}},
      PlanRequestFlags(),
      {{"local", "", "plan in this process (the default without --server)"}},
      ConnectionFlags(),
      {{"output", "table|json|dot", "readable summary (default), contract JSON, Graphviz diagram"},
       {"batch", "FILE.jsonl",
        "with --output json: one request per line ('-' for stdin), one JSON line per\n"
        "request: the plan or {\"error\": {\"code\", \"message\"}}"}},
  }));
  return *flags;
}

absl::StatusOr<v1::PlanRequest> ParsePlanRequestJson(absl::string_view json) {
  v1::PlanRequest request;
  // Fast path: the contract's own spelling.
  if (common::JsonToProto(json, &request).ok()) return request;
  google::protobuf::Struct root;
  if (absl::Status s = common::JsonToProto(json, &root); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("request is not a JSON object: ", s.message()));
  }
  ASSIGN_OR_RETURN(google::protobuf::Struct config, NormaliseRequest(&root));
  RETURN_IF_ERROR(common::JsonToProto(common::ProtoToJson(root, {.indent = 0}), &request));
  auto hf = planner::ParseHfConfigJson(common::ProtoToJson(config, {.indent = 0}));
  if (!hf.ok()) return absl::InvalidArgumentError(absl::StrCat("request config: ", hf.status().message()));
  *request.mutable_config() = hf->config;
  if (request.variant() == v1::MODEL_VARIANT_UNSPECIFIED) request.set_variant(hf->variant);
  return request;
}

absl::Status ApplyPlanFlags(const CommandLine& cl, v1::PlanRequest* request) {
  const auto& v = cl.values;
  v1::ParallelConfig* p = request->mutable_parallel();
  if (auto it = v.find("checkpoint"); it != v.end()) {
    std::string dir = it->second;
    if (!dir.empty() && dir[0] != '/') {
      // The coordinator may run elsewhere: send it a path that does not depend on our cwd.
      char cwd[4096];
      if (getcwd(cwd, sizeof(cwd)) != nullptr) dir = absl::StrCat(cwd, "/", dir);
    }
    request->set_checkpoint(dir);
  }
  if (auto it = v.find("config"); it != v.end()) {
    std::string text = it->second;
    if (absl::StripLeadingAsciiWhitespace(text).substr(0, 1) != "{") {
      ASSIGN_OR_RETURN(text, common::ReadFileToString(it->second, "--config file"));
    }
    auto hf = planner::ParseHfConfigJson(text);
    if (!hf.ok()) return absl::InvalidArgumentError(absl::StrCat("--config: ", hf.status().message()));
    request->mutable_config()->MergeFrom(hf->config);
    if (request->variant() == v1::MODEL_VARIANT_UNSPECIFIED) request->set_variant(hf->variant);
  }
  if (auto it = v.find("variant"); it != v.end()) {
    ASSIGN_OR_RETURN(v1::ModelVariant variant, planner::ParseVariant(it->second));
    request->set_variant(variant);
  }
  if (auto it = v.find("tp"); it != v.end()) {
    ASSIGN_OR_RETURN(int64_t n, ParseInt("tp", it->second));
    p->set_tp_size(n);
  }
  if (auto it = v.find("pp"); it != v.end()) {
    ASSIGN_OR_RETURN(int64_t n, ParseInt("pp", it->second));
    p->set_pp_size(n);
  }
  if (auto it = v.find("pp-style"); it != v.end()) {
    ASSIGN_OR_RETURN(v1::PipelineStyle style, ParsePipelineStyle(it->second));
    p->set_pp_style(style);
  }
  if (auto it = v.find("chunks"); it != v.end()) {
    ASSIGN_OR_RETURN(int64_t n, ParseInt("chunks", it->second));
    p->set_num_model_chunks(n);
  }
  if (auto it = v.find("layers-per-stage"); it != v.end()) {
    p->clear_num_layers_per_stage();
    for (absl::string_view part : absl::StrSplit(it->second, ',')) {
      ASSIGN_OR_RETURN(int64_t n, ParseInt("layers-per-stage", std::string(absl::StripAsciiWhitespace(part))));
      p->add_num_layers_per_stage(n);
    }
  }
  if (auto it = v.find("sp-mode"); it != v.end()) {
    ASSIGN_OR_RETURN(v1::SequenceParallelMode mode, ParseSpMode(it->second));
    p->set_sp_mode(mode);
  }
  if (auto it = v.find("vocab-multiple"); it != v.end()) {
    ASSIGN_OR_RETURN(int64_t n, ParseInt("vocab-multiple", it->second));
    p->set_make_vocab_size_divisible_by(n);
  }
  if (auto it = v.find("dtype"); it != v.end()) {
    ASSIGN_OR_RETURN(v1::Dtype dtype, planner::ParseDtype(it->second));
    request->set_dtype(dtype);
  }
  if (cl.switches.count("fused-norm")) p->set_enable_fused_normalization(true);
  if (cl.switches.count("jit-fused")) p->set_enable_jit_fused(true);
  if (cl.switches.count("all-optimization")) p->set_enable_all_optimization(true);
  if (cl.switches.count("fp8")) p->set_fp8_communication(true);
  return absl::OkStatus();
}

int RunPlanCommand(const CommandLine& cl, std::FILE* out, std::FILE* err) {
  const auto& v = cl.values;
  const std::string output = v.count("output") ? v.at("output") : "table";
  if (output != "table" && output != "json" && output != "dot") {
    return ReportError(
        err, absl::InvalidArgumentError(absl::StrCat("--output '", output, "' is not one of table, json, dot")));
  }
  if (cl.switches.count("local") && v.count("server")) {
    return ReportError(err, absl::InvalidArgumentError("give either --local or --server, not both"));
  }
  int64_t timeout_s = 30;
  if (auto it = v.find("timeout"); it != v.end()) {
    if (!absl::SimpleAtoi(it->second, &timeout_s) || timeout_s <= 0) {
      return ReportError(err, absl::InvalidArgumentError("--timeout needs a positive number of seconds"));
    }
  }
  // Checked with --local too, as they always were: a flag that names a file that cannot be used
  // is a mistake either way.
  if (absl::Status token = ClientToken(cl).status(); !token.ok()) return ReportError(err, token);
  if (absl::Status tls = ClientCredentials(cl).status(); !tls.ok()) return ReportError(err, tls);
  absl::StatusOr<PlanFn> plan_fn = v.count("server") ? RemotePlanner(cl) : absl::StatusOr<PlanFn>(LocalPlanner());
  if (!plan_fn.ok()) return ReportError(err, plan_fn.status());
  if (auto it = v.find("batch"); it != v.end()) {
    if (output != "json") {
      return ReportError(err, absl::InvalidArgumentError("--batch writes JSON lines: use it with --output json"));
    }
    for (const char* flag : {"request", "variant", "config", "checkpoint", "tp", "pp", "pp-style", "chunks",
                             "layers-per-stage", "sp-mode", "vocab-multiple", "dtype"}) {
      if (v.count(flag)) {
        return ReportError(err, absl::InvalidArgumentError(absl::StrCat("--batch takes each request from its file; --",
                                                                        flag, " cannot be combined with it")));
      }
    }
    return RunBatch(it->second, *plan_fn, out, err);
  }

  v1::PlanRequest request;
  std::string request_path = v.count("request") ? v.at("request") : "";
  if (cl.positional.size() > 2) {
    return ReportError(err, absl::InvalidArgumentError("plan takes at most one request file"));
  }
  if (cl.positional.size() == 2) {
    if (!request_path.empty()) {
      return ReportError(err, absl::InvalidArgumentError("give the request file once (positional or --request)"));
    }
    request_path = cl.positional[1];
  }
  if (!request_path.empty()) {
    absl::StatusOr<std::string> text = common::ReadFileToString(request_path, "request file");
    absl::StatusOr<v1::PlanRequest> parsed =
        text.ok() ? ParsePlanRequestJson(*text) : absl::StatusOr<v1::PlanRequest>(text.status());
    if (!parsed.ok()) {
      return ReportError(err, absl::InvalidArgumentError(absl::StrCat(request_path, ": ", parsed.status().message())));
    }
    request = *std::move(parsed);
  }
  if (absl::Status s = ApplyPlanFlags(cl, &request); !s.ok()) {
    return ReportError(err, s);
  }
  auto plan = std::make_unique<v1::ShardPlan>();
  if (absl::Status status = (*plan_fn)(request, plan.get()); !status.ok()) {
    return ReportError(err, status);
  }
  std::string text;
  if (output == "json") {
    planner::AppendPlanJson(*plan, 2, &text);
    text.push_back('\n');
  } else if (output == "dot") {
    text = planner::FormatPlanDot(*plan);
  } else {
    text = planner::FormatPlanTable(*plan);
  }
  std::fwrite(text.data(), 1, text.size(), out);
  return std::fflush(out) == 0 ? kExitOk : kExitFailure;
}

}  // namespace bertshard::client
