// shardctl against a live cluster (a coordinator and four shard-worker processes on loopback, from
// tests/cluster_fixture.h), run as a user runs it: `submit --watch` (to READY, and to FAILED for a
// checkpoint whose index names a missing shard), `submit --no-wait` (refused instead of queued
// when no worker is idle), `infer --text` and `--text-pair` on a checkpoint with a vocab.txt, `plan
// --batch -` reading requests from stdin, `update` (waiting for a worker, refused while one runs, aborted),
// $BERTSHARD_SERVER standing in for --server, and bad input, each with its message and non-zero exit status. One
// cluster start-up for all of it: each costs seconds on a 2-core machine.
#include <fcntl.h>
#include <spawn.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/cluster_fixture.h"
#include "tests/test_process.h"

namespace bertshard {
namespace {

using nlohmann::json;
using testing::Cli;
using testing::Cluster;
using testing::kModel;
using testing::ReadAll;
using testing::Shardctl;
using testing::TempDir;
using testing::WaitExit;

// shardctl with `input` on its standard input.
Cli ShardctlWithStdin(std::vector<std::string> args, const std::string& input) {
  args.insert(args.begin(), "client/shardctl");
  const testing::Captured c = testing::Run(args, input);
  return {c.exit_code, c.out + c.err};
}

std::vector<std::string> Lines(const std::string& text) { return absl::StrSplit(text, '\n', absl::SkipEmpty()); }

// kModel's config with a sharded index whose second shard file was never copied.
std::string CheckpointMissingAShard() {
  const std::string dir = TempDir() + "/missing_shard_model";
  std::filesystem::create_directories(dir);
  std::filesystem::copy_file(std::string(kModel) + "/config.json", dir + "/config.json",
                             std::filesystem::copy_options::overwrite_existing);
  std::filesystem::copy_file(std::string(kModel) + "/model.safetensors", dir + "/model-00001-of-00002.safetensors",
                             std::filesystem::copy_options::overwrite_existing);
  std::ofstream(dir + "/model.safetensors.index.json")
      << R"({"metadata": {}, "weight_map": {"bert.embeddings.word_embeddings.weight": "model-00001-of-00002.safetensors",
                                            "cls.predictions.bias": "model-00002-of-00002.safetensors"}})";
  return dir;
}

// The value of the line starting with `prefix` ("input_ids: "), or "" if there is none.
std::string LineValue(const std::string& output, const std::string& prefix) {
  for (const std::string& line : Lines(output)) {
    if (absl::StartsWith(line, prefix)) return line.substr(prefix.size());
  }
  return "";
}

TEST_F(Cluster, ShardctlSubmitsInfersAndRefusesBadInput) {
  const std::string server = "--server=127.0.0.1:" + std::to_string(port_);

  // submit --watch on a checkpoint missing a shard: the job fails on the workers, and the cause
  // names the missing file (checkpoint/checkpoint.cc). The watch exits 1.
  Cli broken =
      Shardctl({"submit", server, "--checkpoint", CheckpointMissingAShard(), "--tp", "2", "--pp", "2", "--watch"});
  EXPECT_EQ(broken.exit_code, 1) << broken.output;
  EXPECT_TRUE(absl::StrContains(broken.output, "FAILED: ")) << broken.output;
  EXPECT_TRUE(absl::StrContains(broken.output,
                                "model.safetensors.index.json names shard file model-00002-of-00002.safetensors, "
                                "which is missing"))
      << broken.output;
  ASSERT_TRUE(WaitForWorkers(4)) << "the failed job's workers did not come back idle";

  // submit --watch: the job id first, then its states, ending READY.
  const std::string checkpoint = testing::CheckpointWithWordVocabulary(kModel, "text_model");
  Cli submit = Shardctl({"submit", server, "--checkpoint", checkpoint, "--tp", "2", "--pp", "2", "--watch"});
  ASSERT_EQ(submit.exit_code, 0) << submit.output;
  const std::vector<std::string> submit_lines = Lines(submit.output);
  ASSERT_GE(submit_lines.size(), 2u) << submit.output;
  const std::string id = submit_lines.front();
  EXPECT_TRUE(absl::StartsWith(id, "job-")) << submit.output;
  EXPECT_EQ(submit_lines.back(), "READY") << submit.output;

  // submit --no-wait with every worker busy: refused, not queued, and nothing is stored.
  Cli no_wait = Shardctl({"submit", server, "--checkpoint", checkpoint, "--tp", "2", "--pp", "2", "--no-wait"});
  EXPECT_EQ(no_wait.exit_code, 1) << no_wait.output;
  EXPECT_TRUE(absl::StrContains(no_wait.output,
                                "shardctl: FAILED_PRECONDITION: the job cannot start now: waiting for 4 healthy idle "
                                "CPU workers (gloo); 0 are free"))
      << no_wait.output;
  Cli jobs = Shardctl({"jobs", server});
  ASSERT_EQ(jobs.exit_code, 0) << jobs.output;
  EXPECT_EQ(Lines(jobs.output).size(), 3u) << jobs.output;  // header, the failed job, the ready one
  // Without --no-wait the same submit is queued PENDING and returns at once.
  Cli queued = Shardctl({"submit", server, "--checkpoint", checkpoint, "--tp", "2", "--pp", "2"});
  ASSERT_EQ(queued.exit_code, 0) << queued.output;
  const std::string queued_id = Lines(queued.output).front();
  Cli pending = Shardctl({"job", queued_id, server});
  EXPECT_TRUE(absl::StrContains(pending.output, "\"PENDING\"")) << pending.output;
  EXPECT_TRUE(absl::StrContains(pending.output, "waiting for 4 healthy idle CPU workers (gloo)")) << pending.output;
  EXPECT_TRUE(absl::StrContains(Shardctl({"cancel", queued_id, server}).output, "CANCELLED"));

  // infer --text: the checkpoint's vocabulary ("W8" lower-cased, "!" unknown).
  Cli text = Shardctl({"infer", id, server, "--text", "w7 W8 w9!"});
  ASSERT_EQ(text.exit_code, 0) << text.output;
  EXPECT_EQ(LineValue(text.output, "input_ids: "), "[2, 7, 8, 9, 1, 3]") << text.output;
  EXPECT_EQ(LineValue(text.output, "token_type_ids: "), "") << "printed for pairs only: " << text.output;
  EXPECT_EQ(LineValue(text.output, "logits "), "[1, 6, 99]") << text.output;

  // infer --text-pair: [CLS] a [SEP] b [SEP], the second segment (with its [SEP]) of type 1.
  Cli pair = Shardctl({"infer", id, server, "--text", "w5 w6", "--text-pair", "w7 w8 w9"});
  ASSERT_EQ(pair.exit_code, 0) << pair.output;
  EXPECT_EQ(LineValue(pair.output, "input_ids: "), "[2, 5, 6, 3, 7, 8, 9, 3]") << pair.output;
  EXPECT_EQ(LineValue(pair.output, "token_type_ids: "), "[0, 0, 0, 0, 1, 1, 1, 1]") << pair.output;
  EXPECT_EQ(LineValue(pair.output, "logits "), "[1, 8, 99]") << pair.output;
  // Multi-byte UTF-8 passes shardctl's check: 中 is a word of its own, é is stripped to e; neither
  // is in this vocabulary.
  Cli unicode = Shardctl({"infer", id, server, "--text", "w5 \u4e2d\u00e9 \U0001F600"});
  ASSERT_EQ(unicode.exit_code, 0) << unicode.output;
  EXPECT_EQ(LineValue(unicode.output, "input_ids: "), "[2, 5, 1, 1, 1, 3]") << unicode.output;
  // A [MASK] gets the head's top-k tokens from the vocabulary.
  Cli mask = Shardctl({"infer", id, server, "--text", "w5 [MASK]", "--top-k", "3"});
  ASSERT_EQ(mask.exit_code, 0) << mask.output;
  const std::string predictions = LineValue(mask.output, "[MASK] at 2:");
  EXPECT_EQ(std::count(predictions.begin(), predictions.end(), '('), 3) << mask.output;

  // $BERTSHARD_SERVER stands in for an absent --server; --server wins over it.
  ASSERT_EQ(setenv("BERTSHARD_SERVER", ("127.0.0.1:" + std::to_string(port_)).c_str(), 1), 0);
  Cli env_jobs = Shardctl({"jobs"});
  EXPECT_EQ(env_jobs.exit_code, 0) << env_jobs.output;
  EXPECT_TRUE(absl::StrContains(env_jobs.output, id)) << env_jobs.output;
  Cli env_infer = Shardctl({"infer", id, "--text", "w10 w11"});
  EXPECT_EQ(env_infer.exit_code, 0) << env_infer.output;
  EXPECT_EQ(LineValue(env_infer.output, "input_ids: "), "[2, 10, 11, 3]") << env_infer.output;
  ASSERT_EQ(setenv("BERTSHARD_SERVER", "127.0.0.1:1", 1), 0);  // nothing listens there
  Cli env_dead = Shardctl({"jobs", "--timeout", "5"});
  EXPECT_EQ(env_dead.exit_code, 1) << env_dead.output;
  EXPECT_TRUE(absl::StrContains(env_dead.output, "shardctl: UNAVAILABLE: ")) << env_dead.output;
  Cli flag_wins = Shardctl({"jobs", server});
  EXPECT_EQ(flag_wins.exit_code, 0) << flag_wins.output;
  EXPECT_TRUE(absl::StrContains(flag_wins.output, id)) << flag_wins.output;
  ASSERT_EQ(unsetenv("BERTSHARD_SERVER"), 0);

  // plan --batch -: requests from stdin, planned by the coordinator, one JSON line each (an error
  // is a line too); blank lines are skipped.
  const std::string batch = R"({"checkpoint": ")" + checkpoint +
                            R"(", "parallel": {"tp_size": 2, "pp_size": 2}})"
                            "\n"
                            "\n"
                            R"({"variant": "BertModel", "parallel": {"tp_size": 5}})"
                            "\n"
                            "not json\n";
  Cli planned = ShardctlWithStdin({"plan", server, "--output", "json", "--batch", "-"}, batch);
  ASSERT_EQ(planned.exit_code, 0) << planned.output;
  const std::vector<std::string> plans = Lines(planned.output);
  ASSERT_EQ(plans.size(), 3u) << planned.output;
  const json first = json::parse(plans[0], nullptr, /*allow_exceptions=*/false);
  ASSERT_TRUE(first.is_object()) << plans[0];
  EXPECT_EQ(first["ranks"].size(), 4u) << plans[0];
  EXPECT_EQ(first["variant"], "BERT_FOR_MASKED_LM") << plans[0];  // from the checkpoint's config.json
  const json tp5 = json::parse(plans[1], nullptr, false);
  EXPECT_EQ(tp5["error"]["code"], "INVALID_ARGUMENT") << plans[1];
  EXPECT_TRUE(absl::StrContains(tp5["error"]["message"].dump(), "tp_size 5 does not divide")) << plans[1];
  EXPECT_EQ(json::parse(plans[2], nullptr, false)["error"]["code"], "INVALID_ARGUMENT") << plans[2];
  // The same stdin against a coordinator that is not there: every request answers UNAVAILABLE,
  // so the lines above did come from --server.
  Cli unreachable =
      ShardctlWithStdin({"plan", "--server", "127.0.0.1:1", "--timeout", "5", "--output", "json", "--batch", "-"},
                        R"({"variant": "BertModel"})"
                        "\n");
  EXPECT_EQ(unreachable.exit_code, 0) << unreachable.output;
  EXPECT_EQ(json::parse(unreachable.output, nullptr, false)["error"]["code"], "UNAVAILABLE") << unreachable.output;

  // update: every worker serves the job, so a new shape of one replica waits for one, says so,
  // and can be aborted; a second update meanwhile is refused.
  Cli update = Shardctl({"update", id, server, "--tp", "1", "--pp", "1"});
  ASSERT_EQ(update.exit_code, 0) << update.output;
  EXPECT_TRUE(absl::StrContains(update.output, id + " updating: version 1: 0 of 1 new replicas READY; replica "))
      << update.output;
  EXPECT_TRUE(absl::StrContains(update.output, "waits")) << update.output;
  Cli again = Shardctl({"update", id, server, "--dtype", "bf16"});
  EXPECT_EQ(again.exit_code, 1) << again.output;
  EXPECT_TRUE(absl::StrContains(again.output, "FAILED_PRECONDITION: job " + id + " runs an update to version 1"))
      << again.output;
  Cli updating = Shardctl({"job", id, server});
  EXPECT_TRUE(absl::StrContains(updating.output, "\"update\"")) << updating.output;
  Cli aborted = Shardctl({"update", id, server, "--abort"});
  EXPECT_EQ(aborted.exit_code, 0) << aborted.output;
  EXPECT_TRUE(absl::StrContains(aborted.output, "version 1: aborted by request")) << aborted.output;
  Cli none = Shardctl({"update", id, server, "--abort"});
  EXPECT_EQ(none.exit_code, 1) << none.output;
  EXPECT_TRUE(absl::StrContains(none.output, "runs no update to abort")) << none.output;

  // Bad input: a message naming the problem and a non-zero exit status (2 invalid, 3 unknown job).
  const std::string tokens = std::string(kModel) + "/input.json";
  struct Case {
    std::vector<std::string> args;
    int exit_code;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{"infer", id, server, "--text", ""},
       2,
       "shardctl: INVALID_ARGUMENT: text 0 is empty (no tokens after cleaning)"},
      {{"infer", id, server, "--text", " \t "}, 2, "text 0 is empty (no tokens after cleaning)"},
      {{"infer", id, server, "--text", "w5", "--text-pair", "  "},
       2,
       "text_pairs 0 is empty (no tokens after cleaning)"},
      // Refused by shardctl itself: a proto string must be UTF-8, and gRPC said only "INTERNAL: ".
      {{"infer", id, server, "--text", "w5 \xff"}, 2, "shardctl: INVALID_ARGUMENT: --text is not valid UTF-8 (byte 3)"},
      {{"infer", id, server, "--text", "w5", "--text-pair", "\xed\xa0\x80"},
       2,
       "--text-pair is not valid UTF-8 (byte 0)"},
      {{"embed", id, server, "w5", "w6 \xc0\xaf"}, 2, "text 1 is not valid UTF-8 (byte 3)"},
      {{"infer", id, server, "--text-pair", "w5"}, 2, "--text-pair needs --text (the pair's first text)"},
      {{"infer", id, server, "--input", tokens, "--text-pair", "w5"}, 2, "--text-pair needs --text"},
      {{"infer", id, server, "--input", tokens, "--text", "w5"}, 2, "infer needs exactly one of --text or --input"},
      {{"infer", id, server}, 2, "infer needs exactly one of --text or --input"},
      {{"infer", id, server, "--text", "w5", "--top-k", "0"}, 2, "--top-k must be an integer >= 1, got '0'"},
      {{"infer", id, server, "--text"}, 2, "--text needs a value"},
      {{"infer", server, "--text", "w5"}, 2, "infer needs a job id"},
      {{"infer", "job-that-does-not-exist", server, "--text", "w5"}, 3, "shardctl: NOT_FOUND: "},
      {{"submit", server, "--tp", "2"}, 2, "submit needs --checkpoint DIR"},
      {{"submit", server, "--checkpoint", checkpoint, "--tp", "two"}, 2, "--tp needs an integer, got 'two'"},
      {{"submit", server, "--checkpoint", TempDir() + "/no_such_model"}, 2, "config.json"},
      {{"submit", server, "--checkpoint", checkpoint, "--bogus"}, 2, "unknown flag --bogus"},
      {{"submit", server, "--checkpoint", checkpoint, "--no-wait=maybe"}, 2, "--no-wait is a switch"},
      {{"submit", server, "--checkpoint", checkpoint, "--backend", "mpi"},
       2,
       "shardctl: INVALID_ARGUMENT: unknown backend 'mpi'; valid: gloo (CPU workers, the default), nccl"},
      {{"update", id, server, "--tp", "5"}, 2, "shardctl: INVALID_ARGUMENT: "},
      {{"update", id, server}, 2, "update changes nothing: name a new --tp"},
      {{"update", server, "--tp", "1"}, 2, "update needs a job id"},
      {{"update", "job-that-does-not-exist", server, "--tp", "1"}, 3, "shardctl: NOT_FOUND: "},
      {{"plan", server, "--batch", "-"}, 2, "--batch writes JSON lines: use it with --output json"},
      {{"plan", server, "--output", "json", "--batch", "-", "--tp", "2"},
       2,
       "--batch takes each request from its file; --tp cannot be combined with it"},
      {{"plan", "--output", "json", "--batch", TempDir() + "/no_such_batch.jsonl"}, 2, "cannot read batch file"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << "shardctl " << absl::StrJoin(c.args, " "));
    Cli r = ShardctlWithStdin(c.args, "");
    EXPECT_EQ(r.exit_code, c.exit_code) << r.output;
    EXPECT_TRUE(absl::StrContains(r.output, c.message)) << r.output;
  }
  // None of the refused commands left a job behind: the failed one, the ready one, the cancelled one.
  EXPECT_EQ(Lines(Shardctl({"jobs", server}).output).size(), 4u);
}

// shard-worker --device: a device it cannot serve is refused at start (exit 2, saying why), not
// at a job's load. CI's build has no NCCL, so any GPU is refused there.
TEST(ShardWorkerDevice, ADeviceTheWorkerCannotServeIsRefusedAtStart) {
  const testing::Captured bad = testing::Run({"worker/shard-worker", "--device=gpu0", "--listen=127.0.0.1:0"});
  EXPECT_EQ(bad.exit_code, 2) << bad.err;
  EXPECT_TRUE(absl::StrContains(bad.err, "--device 'gpu0': valid: cpu (serves gloo), cuda:N")) << bad.err;
  // A GPU no host has: refused by every build, without NCCL for that, with it as not visible (so
  // that on a GPU host too the worker exits instead of serving).
  const testing::Captured gpu = testing::Run({"worker/shard-worker", "--device=cuda:4096", "--listen=127.0.0.1:0"});
  EXPECT_EQ(gpu.exit_code, 2) << gpu.err;
  EXPECT_TRUE(absl::StrContains(gpu.err, "--device=cuda:4096 needs a build with NCCL") ||
              absl::StrContains(gpu.err, "cuda:4096 is not a visible GPU") ||
              absl::StrContains(gpu.err, "no usable CUDA device"))
      << gpu.err;
}

}  // namespace
}  // namespace bertshard
