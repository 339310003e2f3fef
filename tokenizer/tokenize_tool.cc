// tokenize_tool: runs WordPieceTokenizer over JSON lines, for tokenizer_parity_test (and for looking
// at what the tokenizer does with a text by hand).
//
//   tokenize_tool --vocab=vocab.txt [--do_lower_case=false] [--strip_accents=true|false] < in.jsonl
//
// Each input line is a JSON object {"text": "...", "pair": "..." (optional), "max_length": N
// (optional, 0 = none), "truncation": true|false (optional)}; JSON lines because texts may hold
// any character, newlines and NULs included. Each gets one output line:
//   {"ids": [...], "type_ids": [...], "truncated": false, "words": [...], "decoded": "..."}
// (words: BasicTokenize(text); decoded: Decode(ids)) or {"error": "..."} for that line alone.
// Exit status 1 only when the tokenizer cannot be built or stdin is not JSON lines.
#include <cstdio>
#include <iostream>
#include <optional>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "nlohmann/json.hpp"
#include "tokenizer/wordpiece.h"

ABSL_FLAG(std::string, vocab, "", "vocab.txt, one token per line");
ABSL_FLAG(bool, do_lower_case, true, "lower-case (HF do_lower_case / lowercase)");
ABSL_FLAG(std::string, strip_accents, "", "true, false, or empty for HF's None (follow do_lower_case)");
ABSL_FLAG(bool, tokenize_chinese_chars, true, "CJK ideographs become words of their own");

namespace {

using bertshard::tokenizer::EncodeOptions;
using bertshard::tokenizer::Encoding;
using bertshard::tokenizer::WordPieceTokenizer;

nlohmann::json Handle(const WordPieceTokenizer& tok, const nlohmann::json& in) {
  if (!in.is_object() || !in.contains("text") || !in["text"].is_string()) {
    return {{"error", "a line must be an object with a string \"text\""}};
  }
  const std::string text = in["text"].get<std::string>();
  std::optional<std::string> pair;
  if (in.contains("pair") && !in["pair"].is_null()) {
    if (!in["pair"].is_string()) return {{"error", "\"pair\" must be a string"}};
    pair = in["pair"].get<std::string>();
  }
  EncodeOptions options;
  if (in.contains("max_length")) {
    if (!in["max_length"].is_number_integer()) return {{"error", "\"max_length\" must be an integer"}};
    options.max_length = in["max_length"].get<int64_t>();
  }
  if (in.contains("truncation")) {
    if (!in["truncation"].is_boolean()) return {{"error", "\"truncation\" must be true or false"}};
    options.truncation = in["truncation"].get<bool>();
  }
  absl::StatusOr<Encoding> e =
      tok.Encode(text, pair.has_value() ? std::optional<absl::string_view>(*pair) : std::nullopt, options);
  if (!e.ok()) return {{"error", e.status().ToString()}};
  absl::StatusOr<std::vector<std::string>> words = tok.BasicTokenize(text);
  if (!words.ok()) return {{"error", words.status().ToString()}};
  return {{"ids", e->input_ids},
          {"type_ids", e->token_type_ids},
          {"truncated", e->truncated},
          {"words", *words},
          {"decoded", tok.Decode(e->input_ids)}};
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("tokenize_tool --vocab=vocab.txt [--do_lower_case=false] < texts.jsonl");
  absl::ParseCommandLine(argc, argv);
  bertshard::tokenizer::TokenizerOptions options;
  options.do_lower_case = absl::GetFlag(FLAGS_do_lower_case);
  options.tokenize_chinese_chars = absl::GetFlag(FLAGS_tokenize_chinese_chars);
  const std::string strip = absl::GetFlag(FLAGS_strip_accents);
  if (strip == "true") {
    options.strip_accents = true;
  } else if (strip == "false") {
    options.strip_accents = false;
  } else if (!strip.empty()) {
    std::fprintf(stderr, "tokenize_tool: --strip_accents must be true, false or empty, not '%s'\n", strip.c_str());
    return 1;
  }
  auto tok = WordPieceTokenizer::FromVocabFile(absl::GetFlag(FLAGS_vocab), options);
  if (!tok.ok()) {
    std::fprintf(stderr, "tokenize_tool: %s\n", tok.status().ToString().c_str());
    return 1;
  }
  std::ios::sync_with_stdio(false);
  std::string line;
  int64_t line_number = 0;
  while (std::getline(std::cin, line)) {
    ++line_number;
    const auto in = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (in.is_discarded()) {
      std::fprintf(stderr, "tokenize_tool: line %lld is not JSON\n", static_cast<long long>(line_number));
      return 1;
    }
    // ASCII only: a raw U+2028 or U+0085 in a line is a line break to some readers (Python's
    // splitlines). replace: a vocabulary line that is not UTF-8 must not take the process down.
    std::cout << Handle(**tok, in).dump(-1, ' ', /*ensure_ascii=*/true, nlohmann::json::error_handler_t::replace)
              << '\n';
  }
  std::cout.flush();
  return std::cout ? 0 : 1;
}
