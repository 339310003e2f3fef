#include "tokenizer/wordpiece.h"

#include <unicode/locid.h>
#include <unicode/normalizer2.h>
#include <unicode/uchar.h>
#include <unicode/unistr.h>
#include <unicode/utf8.h>

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

namespace bertshard::tokenizer {
namespace {

// HF's _is_whitespace: space, \t, \n, \r and category Zs.
bool IsWhitespace(UChar32 c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || u_charType(c) == U_SPACE_SEPARATOR;
}

// HF's _is_control: categories C* except the whitespace controls.
bool IsControl(UChar32 c) {
  if (c == '\t' || c == '\n' || c == '\r') return false;
  const int8_t t = u_charType(c);
  return t == U_CONTROL_CHAR || t == U_FORMAT_CHAR || t == U_PRIVATE_USE_CHAR || t == U_SURROGATE ||
         t == U_UNASSIGNED;
}

// HF's _is_punctuation: ASCII non-alphanumerics count even where Unicode says symbol ($, ^, `).
bool IsPunctuation(UChar32 c) {
  if ((c >= 33 && c <= 47) || (c >= 58 && c <= 64) || (c >= 91 && c <= 96) || (c >= 123 && c <= 126)) {
    return true;
  }
  switch (u_charType(c)) {
    case U_DASH_PUNCTUATION:
    case U_START_PUNCTUATION:
    case U_END_PUNCTUATION:
    case U_CONNECTOR_PUNCTUATION:
    case U_OTHER_PUNCTUATION:
    case U_INITIAL_PUNCTUATION:
    case U_FINAL_PUNCTUATION:
      return true;
    default:
      return false;
  }
}

// HF's _is_chinese_char: the CJK Unified Ideograph blocks.
bool IsCjk(UChar32 c) {
  return (c >= 0x4E00 && c <= 0x9FFF) || (c >= 0x3400 && c <= 0x4DBF) || (c >= 0x20000 && c <= 0x2A6DF) ||
         (c >= 0x2A700 && c <= 0x2B73F) || (c >= 0x2B740 && c <= 0x2B81F) || (c >= 0x2B820 && c <= 0x2CEAF) ||
         (c >= 0xF900 && c <= 0xFAFF) || (c >= 0x2F800 && c <= 0x2FA1F);
}

absl::StatusOr<std::vector<UChar32>> DecodeUtf8(absl::string_view text) {
  std::vector<UChar32> out;
  out.reserve(text.size());
  int32_t i = 0;
  const auto* s = reinterpret_cast<const uint8_t*>(text.data());
  const int32_t n = static_cast<int32_t>(text.size());
  while (i < n) {
    UChar32 c;
    U8_NEXT(s, i, n, c);
    if (c < 0) return absl::InvalidArgumentError(absl::StrCat("text is not valid UTF-8 (byte ", i, ")"));
    out.push_back(c);
  }
  return out;
}

std::string EncodeUtf8(const std::vector<UChar32>& chars) {
  std::string out;
  for (UChar32 c : chars) {
    char buf[4];
    int32_t len = 0;
    UBool error = false;
    U8_APPEND(reinterpret_cast<uint8_t*>(buf), len, 4, c, error);
    if (!error) out.append(buf, static_cast<size_t>(len));
  }
  return out;
}

// Lower-cases (Python's str.lower: full case mapping) and strips accents (NFD, drop Mn).
std::vector<UChar32> Normalise(const std::vector<UChar32>& word, bool lower, bool strip_accents) {
  icu::UnicodeString s;
  for (UChar32 c : word) s.append(c);
  if (lower) s.toLower(icu::Locale::getRoot());
  if (strip_accents) {
    UErrorCode error = U_ZERO_ERROR;
    const icu::Normalizer2* nfd = icu::Normalizer2::getNFDInstance(error);
    if (U_SUCCESS(error)) {
      icu::UnicodeString decomposed = nfd->normalize(s, error);
      if (U_SUCCESS(error)) s = decomposed;
    }
  }
  std::vector<UChar32> out;
  for (int32_t i = 0; i < s.length(); i = s.moveIndex32(i, 1)) {
    const UChar32 c = s.char32At(i);
    if (strip_accents && u_charType(c) == U_NON_SPACING_MARK) continue;
    out.push_back(c);
  }
  return out;
}

}  // namespace

WordPieceTokenizer::WordPieceTokenizer(std::vector<std::string> tokens, const TokenizerOptions& options)
    : tokens_(std::move(tokens)), options_(options) {}

absl::StatusOr<std::unique_ptr<WordPieceTokenizer>> WordPieceTokenizer::FromVocab(
    std::vector<std::string> tokens, const TokenizerOptions& options) {
  if (tokens.empty()) return absl::InvalidArgumentError("the vocabulary is empty");
  auto tok = std::unique_ptr<WordPieceTokenizer>(new WordPieceTokenizer(std::move(tokens), options));
  for (size_t i = 0; i < tok->tokens_.size(); ++i) {
    const std::string& t = tok->tokens_[i];
    if (!tok->ids_.emplace(t, static_cast<int64_t>(i)).second) {
      return absl::InvalidArgumentError(absl::StrCat("vocabulary token '", t, "' appears twice (line ", i + 1, ")"));
    }
    if (t.size() > 2 && t.front() == '[' && t.back() == ']' && t.find(' ') == std::string::npos &&
        (t == "[CLS]" || t == "[SEP]" || t == "[PAD]" || t == "[MASK]" || t == "[UNK]")) {
      tok->specials_.push_back(t);
    }
  }
  for (const char* needed : {"[UNK]", "[CLS]", "[SEP]"}) {
    if (!tok->ids_.count(needed)) {
      return absl::InvalidArgumentError(absl::StrCat("the vocabulary has no ", needed, " token"));
    }
  }
  return tok;
}

absl::StatusOr<std::unique_ptr<WordPieceTokenizer>> WordPieceTokenizer::FromVocabFile(
    const std::string& path, const TokenizerOptions& options) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read vocabulary ", path));
  std::vector<std::string> tokens;
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    tokens.push_back(line);
  }
  return FromVocab(std::move(tokens), options);
}

void WordPieceTokenizer::WordPieces(const std::string& word, std::vector<std::string>* out) const {
  auto chars = DecodeUtf8(word);
  if (!chars.ok() || static_cast<int>(chars->size()) > options_.max_chars_per_word) {
    out->push_back("[UNK]");
    return;
  }
  std::vector<std::string> pieces;
  size_t start = 0;
  while (start < chars->size()) {
    size_t end = chars->size();
    std::string found;
    while (start < end) {
      std::string candidate = EncodeUtf8(std::vector<UChar32>(chars->begin() + start, chars->begin() + end));
      if (start > 0) candidate = "##" + candidate;
      if (ids_.count(candidate)) {
        found = std::move(candidate);
        break;
      }
      --end;
    }
    if (found.empty()) {  // no piece covers this position: the whole word is unknown
      out->push_back("[UNK]");
      return;
    }
    pieces.push_back(std::move(found));
    start = end;
  }
  out->insert(out->end(), pieces.begin(), pieces.end());
}

absl::StatusOr<std::vector<std::string>> WordPieceTokenizer::Tokenize(absl::string_view text) const {
  ASSIGN_OR_RETURN(std::vector<UChar32> chars, DecodeUtf8(text));
  const bool strip = options_.strip_accents.value_or(options_.do_lower_case);
  std::vector<std::string> out;
  // Words (runs of non-space characters after cleaning), with special tokens kept whole.
  std::vector<UChar32> word;
  auto flush_word = [&]() {
    if (word.empty()) return;
    const std::string whole = EncodeUtf8(word);
    bool special = false;
    for (const std::string& s : specials_) special |= (whole == s);
    if (special) {
      out.push_back(whole);
    } else {
      const std::vector<UChar32> normal = Normalise(word, options_.do_lower_case, strip);
      // Split on punctuation: each punctuation character is its own word.
      std::vector<UChar32> part;
      for (UChar32 c : normal) {
        if (IsPunctuation(c)) {
          if (!part.empty()) WordPieces(EncodeUtf8(part), &out);
          part.clear();
          WordPieces(EncodeUtf8({c}), &out);
        } else {
          part.push_back(c);
        }
      }
      if (!part.empty()) WordPieces(EncodeUtf8(part), &out);
    }
    word.clear();
  };
  for (size_t i = 0; i < chars.size(); ++i) {
    // Special tokens split the text wherever they occur, as HF's added-token handling does.
    bool matched = false;
    for (const std::string& s : specials_) {
      auto special = DecodeUtf8(s);
      if (special.ok() && i + special->size() <= chars.size() &&
          std::equal(special->begin(), special->end(), chars.begin() + static_cast<std::ptrdiff_t>(i))) {
        flush_word();
        out.push_back(s);
        i += special->size() - 1;
        matched = true;
        break;
      }
    }
    if (matched) continue;
    const UChar32 c = chars[i];
    if (c == 0 || c == 0xFFFD || IsControl(c)) continue;
    if (IsWhitespace(c)) {
      flush_word();
    } else if (options_.tokenize_chinese_chars && IsCjk(c)) {
      flush_word();
      word.push_back(c);
      flush_word();
    } else {
      word.push_back(c);
    }
  }
  flush_word();
  return out;
}

absl::StatusOr<std::vector<int64_t>> WordPieceTokenizer::TokenIds(absl::string_view text) const {
  ASSIGN_OR_RETURN(std::vector<std::string> pieces, Tokenize(text));
  std::vector<int64_t> ids;
  ids.reserve(pieces.size());
  const int64_t unk = ids_.at("[UNK]");
  for (const std::string& p : pieces) {
    auto it = ids_.find(p);
    ids.push_back(it == ids_.end() ? unk : it->second);
  }
  return ids;
}

absl::StatusOr<Encoding> WordPieceTokenizer::Encode(absl::string_view text, std::optional<absl::string_view> pair,
                                                    int64_t max_length) const {
  ASSIGN_OR_RETURN(std::vector<int64_t> a, TokenIds(text));
  std::vector<int64_t> b;
  if (pair.has_value()) {
    ASSIGN_OR_RETURN(b, TokenIds(*pair));
  }
  Encoding e;
  e.input_ids.push_back(ids_.at("[CLS]"));
  e.input_ids.insert(e.input_ids.end(), a.begin(), a.end());
  e.input_ids.push_back(ids_.at("[SEP]"));
  e.token_type_ids.assign(e.input_ids.size(), 0);
  if (pair.has_value()) {
    e.input_ids.insert(e.input_ids.end(), b.begin(), b.end());
    e.input_ids.push_back(ids_.at("[SEP]"));
    e.token_type_ids.resize(e.input_ids.size(), 1);
  }
  e.attention_mask.assign(e.input_ids.size(), 1);
  if (max_length > 0 && static_cast<int64_t>(e.input_ids.size()) > max_length) {
    return absl::InvalidArgumentError(absl::StrCat("text is ", e.input_ids.size(),
                                                   " tokens with [CLS]/[SEP]; the model takes at most ", max_length));
  }
  return e;
}

absl::StatusOr<TokenizerOptions> ReadTokenizerConfig(const std::string& directory) {
  TokenizerOptions options;
  std::ifstream in(directory + "/tokenizer_config.json");
  if (!in) return options;
  std::stringstream text;
  text << in.rdbuf();
  const auto j = nlohmann::json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(directory, "/tokenizer_config.json is not a JSON object"));
  }
  if (j.contains("do_lower_case") && j["do_lower_case"].is_boolean()) options.do_lower_case = j["do_lower_case"];
  if (j.contains("strip_accents") && j["strip_accents"].is_boolean()) options.strip_accents = j["strip_accents"].get<bool>();
  if (j.contains("tokenize_chinese_chars") && j["tokenize_chinese_chars"].is_boolean()) {
    options.tokenize_chinese_chars = j["tokenize_chinese_chars"];
  }
  return options;
}

}  // namespace bertshard::tokenizer
