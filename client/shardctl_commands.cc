#include "client/shardctl_commands.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "client/cluster_commands.h"
#include "client/coordinator_connection.h"
#include "client/init_checkpoint.h"
#include "client/plan_command.h"
#include "client/run_command.h"
#include "client/serving_commands.h"
#include "client/version.h"

namespace bertshard::client {
namespace {

template <absl::Status (*command)(const CommandLine&, std::FILE*)>
int OnCoordinator(const CommandLine& cl, std::FILE* out, std::FILE* err) {
  return RunCoordinatorCommand(cl, command, out, err);
}

constexpr char kCoordinatorNote[] =
    "\n\nOn the coordinator at --server HOST:PORT (default $BERTSHARD_SERVER, else 127.0.0.1:50051).";

// Up to the end of the first sentence (its full stop, before a space, a line or the end).
std::string FirstSentence(const std::string& text) {
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '.' && (i + 1 == text.size() || text[i + 1] == ' ' || text[i + 1] == '\n')) return text.substr(0, i);
  }
  return text;
}

// `text` with its paragraphs' lines broken at spaces to at most `width` columns.
std::string Wrap(const std::string& text, size_t width = 100) {
  std::string wrapped;
  size_t column = 0;
  for (absl::string_view word : absl::StrSplit(text, ' ')) {
    if (column > 0 && column + 1 + word.size() > width) {
      wrapped.push_back('\n');
      column = 0;
    } else if (column > 0) {
      wrapped.push_back(' ');
      ++column;
    }
    absl::StrAppend(&wrapped, word);
    const size_t newline = word.rfind('\n');
    column = newline == absl::string_view::npos ? column + word.size() : word.size() - newline - 1;
  }
  return wrapped;
}

std::string Overview() {
  std::string text =
      "usage: shardctl COMMAND [ARGS] [flags]\n"
      "       shardctl COMMAND --help     that command's usage and flags\n"
      "       shardctl --version\n\n"
      "Commands:\n";
  for (const Subcommand& c : Subcommands()) {
    if (c.name == "submit") {
      absl::StrAppend(&text,
                      "On a coordinator (--server HOST:PORT, default $BERTSHARD_SERVER or 127.0.0.1:50051;\n"
                      "--token-file, --tls-ca, --tls-cert, --tls-key for one with tokens or TLS):\n");
    }
    absl::StrAppend(&text, "  ", c.name, std::string(c.name.size() < 17 ? 17 - c.name.size() : 1, ' '),
                    FirstSentence(c.description), "\n");
  }
  absl::StrAppend(&text,
                  "\nExit status: 0 ok, 1 coordinator unreachable, job failed or other refusal, output error,\n"
                  "2 invalid request or usage, 3 unknown job.\n");
  return text;
}

std::string CommandNames() {
  std::vector<std::string> names;
  for (const Subcommand& c : Subcommands()) names.push_back(c.name);
  return absl::StrJoin(names, ", ");
}

const Subcommand* FindSubcommand(const std::string& name) {
  for (const Subcommand& c : Subcommands()) {
    if (c.name == name) return &c;
  }
  return nullptr;
}

}  // namespace

const std::vector<Subcommand>& Subcommands() {
  static const auto* commands = new std::vector<Subcommand>{
      {"plan", "plan [REQUEST.json] [flags] [--local | --server HOST:PORT] [--output table|json|dot]",
       "How a BERT model is sharded over tensor- and pipeline-parallel ranks. The request is a JSON file in "
       "the plan contract's format and/or flags (flags win); it is planned in this process, or on a "
       "coordinator with --server.",
       &PlanFlags(), &RunPlanCommand},
      {"run", "run --local --checkpoint DIR --input FILE.json --output FILE.safetensors [flags]",
       "The sharded forward, one process per rank on this machine (Gloo on loopback). Prints per-rank "
       "load/forward time, peak RSS, checkpoint bytes read and GEMM path; writes the outputs (float32, HF "
       "names).",
       &RunFlags(), &RunRunCommand},
      {"init-checkpoint", "init-checkpoint --variant V [--config JSON] [--seed N] --out DIR",
       "A randomly initialised HF model directory (config.json + model.safetensors). Weights as HF's "
       "_init_weights draws them.",
       &InitCheckpointFlags(), &RunInitCheckpointCommand},
      {"submit", "submit --checkpoint DIR [--tp N --pp N ...] [--replicas N] [--name NAME] [--watch] [flags]",
       absl::StrCat("Submit a job: its plan placed on idle workers, which load their shards. Prints the job "
                    "id; the checkpoint is a directory as the workers see it.",
                    kCoordinatorNote),
       &SubmitFlags(), &OnCoordinator<SubmitCommand>},
      {"jobs", "jobs [flags]", absl::StrCat("List the jobs, with their state and age.", kCoordinatorNote),
       &ConnectionFlags(), &OnCoordinator<JobsCommand>},
      {"job", "job ID [flags]", absl::StrCat("One job, as JSON. Exit 3 for an unknown id.", kCoordinatorNote),
       &ConnectionFlags(), &OnCoordinator<JobCommand>},
      {"watch", "watch ID [flags]",
       absl::StrCat("Print a job's states until it settles. READY exits 0, FAILED 1 with the cause; while it "
                    "loads, a bar of the whole job's bytes.",
                    kCoordinatorNote),
       &ConnectionFlags(), &OnCoordinator<WatchCommand>},
      {"cancel", "cancel ID [flags]", absl::StrCat("Cancel a job. Its workers become idle.", kCoordinatorNote),
       &ConnectionFlags(), &OnCoordinator<CancelCommand>},
      {"scale", "scale ID --replicas N | --min-replicas A --max-replicas B [--watch] [flags]",
       absl::StrCat("Grow or shrink a READY job to N replicas: new ones serve once READY, a replica taken "
                    "away finishes its forward first, so no request fails. With bounds the coordinator scales "
                    "it between them by how busy its replicas are.",
                    kCoordinatorNote),
       &ScaleFlags(), &OnCoordinator<ScaleCommand>},
      {"update", "update ID [--tp N --pp N --sp-mode M --dtype D --checkpoint DIR ...] [--watch] [flags]",
       absl::StrCat("Change a READY job's shape or checkpoint while it serves: the new shape loads beside the "
                    "old (replica by replica when workers are short), requests move to it once it is READY, "
                    "and the old shape finishes what it holds, then unloads; no request fails. What the flags "
                    "do not name stays as the job runs. --abort ends an update that runs.",
                    kCoordinatorNote),
       &UpdateFlags(), &OnCoordinator<UpdateCommand>},
      {"workers", "workers [flags]",
       absl::StrCat("List the workers: address, device, health, free memory, job and rank.", kCoordinatorNote),
       &ConnectionFlags(), &OnCoordinator<WorkersCommand>},
      {"infer", "infer ID --text \"...\" [--text-pair \"...\"] | --input FILE.json [--output FILE.safetensors]",
       absl::StrCat("Run a READY job on a text or token ids. Prints the input_ids the model ran on (and "
                    "token_type_ids for a pair), the head's predictions (top-k tokens per [MASK], labels with "
                    "scores, the answer span) and the outputs' shapes; --output writes the raw tensors.",
                    kCoordinatorNote),
       &InferFlags(), &OnCoordinator<InferCommand>},
      {"embed", "embed ID \"text\" [\"text\" ...] | --file FILE|- | --input FILE.json [flags]",
       absl::StrCat("One vector per text (a BertModel job). Pooled as the checkpoint's sentence-transformers "
                    "files say unless overridden; the table ends with the texts' cosine-similarity matrix.",
                    kCoordinatorNote),
       &EmbedFlags(), &OnCoordinator<EmbedCommand>},
      {"rerank", "rerank ID --query \"...\" \"text\" [\"text\" ...] | --file FILE|- [flags]",
       absl::StrCat("Rank texts against a query with a cross-encoder job (a BertForSequenceClassification with "
                    "one label), best first: the sigmoid of each (query, text) pair's logit, or the logit with "
                    "--raw-scores, as TEI's /rerank scores them.",
                    kCoordinatorNote),
       &RerankFlags(), &OnCoordinator<RerankCommand>},
  };
  return *commands;
}

std::string SubcommandHelp(const Subcommand& command) {
  return absl::StrCat("usage: shardctl ", command.usage, "\n\n", Wrap(command.description), "\n\nFlags:\n",
                      FormatFlagHelp(*command.flags), "  --help                    print this help and exit\n");
}

int RunShardctl(const std::vector<std::string>& args, std::FILE* out, std::FILE* err) {
  if (args.empty()) {
    std::fputs(Overview().c_str(), err);
    return kExitInvalidInput;
  }
  const std::string& first = args[0];
  if (first == "--version") {
    std::fprintf(out, "shardctl %s\n", kShardctlVersion);
    return kExitOk;
  }
  const bool help = first == "help" || first == "--help" || first == "-h";
  if (help && args.size() == 1) {
    std::fputs(Overview().c_str(), out);
    return kExitOk;
  }
  const std::string& name = help ? args[1] : first;
  const Subcommand* command = FindSubcommand(name);
  if (command == nullptr) {
    std::fprintf(err, "shardctl: unknown command '%s'; commands: %s (see shardctl --help)\n", name.c_str(),
                 CommandNames().c_str());
    return kExitInvalidInput;
  }
  if (help) {
    std::fputs(SubcommandHelp(*command).c_str(), out);
    return kExitOk;
  }
  auto command_line = ParseCommandLine(args, *command->flags);
  if (!command_line.ok()) {
    std::fprintf(err, "shardctl: %s (see shardctl %s --help)\n", std::string(command_line.status().message()).c_str(),
                 name.c_str());
    return kExitInvalidInput;
  }
  if (command_line->switches.count("help")) {
    std::fputs(SubcommandHelp(*command).c_str(), out);
    return kExitOk;
  }
  return command->run(*command_line, out, err);
}

}  // namespace bertshard::client
