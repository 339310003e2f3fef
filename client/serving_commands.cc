#include "client/serving_commands.h"

#include <algorithm>
#include <iostream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "bertshard/v1/coordinator.grpc.pb.h"
#include "checkpoint/safetensors.h"
#include "client/coordinator_connection.h"
#include "client/run_command.h"
#include "common/file.h"
#include "common/proto_json.h"
#include "common/status_macros.h"
#include "serving/pooling.h"

namespace bertshard::client {
namespace {

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

}  // namespace

absl::Status InferCommand(const CommandLine& cl, std::FILE* out) {
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
  ASSIGN_OR_RETURN(const CoordinatorConnection c, CoordinatorConnection::Open(cl, ResolveServerAddress(cl)));
  v1::InferResponse response;
  RETURN_IF_ERROR(c.Check(c.stub()->Infer(c.Context(600).get(), infer, &response)));
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

namespace {

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

}  // namespace

namespace {

// The texts after the job id, then --file's lines ('-': stdin), each checked to be UTF-8.
absl::StatusOr<std::vector<std::string>> ReadTexts(const CommandLine& cl) {
  std::vector<std::string> texts(cl.positional.begin() + std::min<size_t>(2, cl.positional.size()),
                                 cl.positional.end());
  if (auto it = cl.values.find("file"); it != cl.values.end()) {
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
  for (size_t i = 0; i < texts.size(); ++i) RETURN_IF_ERROR(CheckUtf8(texts[i], absl::StrCat("text ", i)));
  return texts;
}

// --format: a table (false, the default) or the response as JSON (true).
absl::StatusOr<bool> WantsJson(const CommandLine& cl) {
  auto it = cl.values.find("format");
  if (it == cl.values.end() || it->second == "table") return false;
  if (it->second == "json") return true;
  return absl::InvalidArgumentError(absl::StrCat("--format must be table or json, got '", it->second, "'"));
}

// A text cut to `width` columns for a table.
std::string Shortened(std::string text, size_t width) {
  if (text.size() > width) text = text.substr(0, width - 3) + "...";
  return text;
}

}  // namespace

// shardctl embed ID TEXT... | --file FILE | --input TOKENS.json
absl::Status EmbedCommand(const CommandLine& cl, std::FILE* out) {
  v1::EmbedRequest embed;
  embed.set_job_id(JobId(cl));
  if (embed.job_id().empty()) return absl::InvalidArgumentError("embed needs a job id");
  const auto& v = cl.values;
  ASSIGN_OR_RETURN(const std::vector<std::string> texts, ReadTexts(cl));
  if (texts.empty() == (v.count("input") == 0)) {
    return absl::InvalidArgumentError(
        "embed needs texts (arguments or --file, one per line) or --input TOKENS.json, not both");
  }
  if (v.count("input")) {
    RETURN_IF_ERROR(ReadTokenInputs(v.at("input"), embed.mutable_tokens()));
  } else {
    for (const std::string& text : texts) embed.mutable_text()->add_texts(text);
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
  if (auto it = v.find("prompt-name"); it != v.end()) embed.set_prompt_name(it->second);
  embed.set_sparse(cl.switches.count("sparse") > 0);
  if (embed.sparse() && (v.count("pooling") > 0 || v.count("normalize") > 0)) {
    return absl::InvalidArgumentError("--sparse takes no --pooling or --normalize: SPLADE pools by its maximum");
  }
  ASSIGN_OR_RETURN(const bool json, WantsJson(cl));
  ASSIGN_OR_RETURN(const CoordinatorConnection c, CoordinatorConnection::Open(cl, ResolveServerAddress(cl)));
  v1::EmbedResponse response;
  RETURN_IF_ERROR(c.Check(c.stub()->Embed(c.Context(600).get(), embed, &response)));
  if (json) {
    std::fprintf(out, "%s\n", common::ProtoToJson(response).c_str());
    return absl::OkStatus();
  }
  const int n = response.embeddings_size();
  auto label = [&](int i) {
    return Shortened(i < static_cast<int>(texts.size()) ? texts[static_cast<size_t>(i)] : absl::StrCat("row ", i), 48);
  };
  if (embed.sparse()) {
    std::fprintf(out, "%d sparse embedding%s (SPLADE, max length %d); the heaviest vocabulary ids of each\n", n,
                 n == 1 ? "" : "s", response.max_length());
    for (int i = 0; i < n; ++i) {
      const v1::Embedding& e = response.embeddings(i);
      std::vector<int> order(static_cast<size_t>(e.values_size()));
      for (size_t k = 0; k < order.size(); ++k) order[k] = static_cast<int>(k);
      const size_t shown = std::min<size_t>(6, order.size());
      std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(shown), order.end(),
                        [&e](int a, int b) { return e.values(a) > e.values(b); });
      order.resize(shown);
      std::fprintf(out, "[%d] %-48s %3d tokens%s  %d non-zero  {%s%s}\n", i, label(i).c_str(),
                   i < response.token_counts_size() ? response.token_counts(i) : 0,
                   i < response.truncated_size() && response.truncated(i) ? " (truncated)" : "", e.values_size(),
                   absl::StrJoin(order, ", ",
                                 [&e](std::string* o, int k) {
                                   absl::StrAppend(o, e.indices(k), ": ", absl::StrFormat("%.4f", e.values(k)));
                                 })
                       .c_str(),
                   static_cast<int>(shown) < e.values_size() ? ", ..." : "");
    }
    return absl::OkStatus();
  }
  std::fprintf(out, "%d embedding%s of %d dimensions (pooling %s, %snormalized, max length %d)\n", n, n == 1 ? "" : "s",
               n > 0 ? response.embeddings(0).values_size() : 0, PoolingFlagName(response.pooling()).c_str(),
               response.normalized() ? "" : "not ", response.max_length());
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

// shardctl rerank ID --query Q TEXT... | --file FILE
absl::Status RerankCommand(const CommandLine& cl, std::FILE* out) {
  v1::RerankRequest rerank;
  rerank.set_job_id(JobId(cl));
  if (rerank.job_id().empty()) return absl::InvalidArgumentError("rerank needs a job id");
  const auto& v = cl.values;
  if (auto it = v.find("query"); it != v.end()) rerank.set_query(it->second);
  if (rerank.query().empty()) return absl::InvalidArgumentError("rerank needs --query, the text to rank against");
  RETURN_IF_ERROR(CheckUtf8(rerank.query(), "--query"));
  ASSIGN_OR_RETURN(const std::vector<std::string> texts, ReadTexts(cl));
  if (texts.empty())
    return absl::InvalidArgumentError("rerank needs texts to rank (arguments or --file, one per line)");
  for (const std::string& text : texts) rerank.add_texts(text);
  rerank.set_raw_scores(cl.switches.count("raw-scores") > 0);
  rerank.set_truncate(cl.switches.count("truncate") > 0);
  ASSIGN_OR_RETURN(const bool json, WantsJson(cl));
  ASSIGN_OR_RETURN(const CoordinatorConnection c, CoordinatorConnection::Open(cl, ResolveServerAddress(cl)));
  v1::RerankResponse response;
  RETURN_IF_ERROR(c.Check(c.stub()->Rerank(c.Context(600).get(), rerank, &response)));
  if (json) {
    std::fprintf(out, "%s\n", common::ProtoToJson(response).c_str());
    return absl::OkStatus();
  }
  std::fprintf(out, "%d text%s ranked against \"%s\" (%s)\n", response.results_size(),
               response.results_size() == 1 ? "" : "s", Shortened(rerank.query(), 60).c_str(),
               rerank.raw_scores() ? "raw logits" : "sigmoid scores");
  for (int r = 0; r < response.results_size(); ++r) {
    const v1::RerankResult& result = response.results(r);
    const size_t index = static_cast<size_t>(result.index());
    std::fprintf(out, "%3d. [%d] %10.6f  %s\n", r + 1, result.index(), result.score(),
                 index < texts.size() ? Shortened(texts[index], 60).c_str() : "");
  }
  return absl::OkStatus();
}

const std::vector<Flag>& InferFlags() {
  static const auto* flags = new std::vector<Flag>(
      JoinFlags({ConnectionFlags(),
                 {
                     {"text", "TEXT", "the text to run (tokenized by the coordinator with the checkpoint's vocab)"},
                     {"text-pair", "TEXT", "the pair's second segment (with --text)"},
                     {"input", "FILE.json", "token ids instead of text, in `shardctl run`'s input format"},
                     {"output", "FILE.safetensors", "write the raw output tensors"},
                     {"top-k", "K", "masked LM heads: predictions per [MASK] (default 5)"},
                     {"truncate", "", "cut text longer than the model's maximum length instead of refusing it"},
                     {"micro-batches", "M", "> 1: run this request alone as that many pipeline micro-batches"},
                 }}));
  return *flags;
}

const std::vector<Flag>& EmbedFlags() {
  static const auto* flags = new std::vector<Flag>(JoinFlags(
      {ConnectionFlags(),
       {
           {"file", "FILE|-", "texts, one per line ('-' for stdin), after those given as arguments"},
           {"input", "FILE.json", "token ids instead of texts, in `shardctl run`'s input format"},
           {"pooling", "mean|cls|max|mean_sqrt_len", "override the checkpoint's sentence-transformers pooling"},
           {"normalize", "true|false", "override whether vectors are L2-normalised"},
           {"truncate", "", "cut texts longer than the model's maximum length instead of refusing them"},
           {"prompt-name", "NAME", "one of the checkpoint's sentence-transformers prompts (default: its default one)"},
           {"sparse", "", "SPLADE sparse embeddings of a BertForMaskedLM job: vocabulary ids and weights"},
           {"format", "table|json", "a table ending with the cosine-similarity matrix (default), or the response"},
       }}));
  return *flags;
}

const std::vector<Flag>& RerankFlags() {
  static const auto* flags = new std::vector<Flag>(
      JoinFlags({ConnectionFlags(),
                 {
                     {"query", "TEXT", "what the texts are ranked against"},
                     {"file", "FILE|-", "texts, one per line ('-' for stdin), after those given as arguments"},
                     {"raw-scores", "", "scores are the model's logits instead of their sigmoid"},
                     {"truncate", "", "cut pairs longer than the model's maximum length instead of refusing them"},
                     {"format", "table|json", "the texts best first (default), or the response"},
                 }}));
  return *flags;
}

}  // namespace bertshard::client
