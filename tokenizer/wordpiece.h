// File: tokenizer/wordpiece.h
// -----------------------------------------------------------------------------
// BERT's WordPiece tokenizer with HuggingFace BertTokenizer semantics, driven by a checkpoint's
// vocab.txt: special tokens ([CLS], [SEP], [MASK], ...) kept whole; basic tokenization (text
// cleaning, CJK characters split, whitespace split, lower-casing and accent stripping when
// configured, punctuation split); then greedy longest-match-first WordPiece with "##"
// continuations and [UNK] for words it cannot cover or longer than 100 characters. Unicode
// properties (categories, NFD, case mapping) come from ICU.
//
// Example:
//   ASSIGN_OR_RETURN(auto tok, WordPieceTokenizer::FromVocabFile("vocab.txt", {}));
//   ASSIGN_OR_RETURN(Encoding e, tok->Encode("i like strawberries", std::nullopt));
//   // e.input_ids == {101, 1045, 2066, 13137, 20968, 102}
//
// Thread safety: thread-safe after construction (const methods only).
#ifndef BERTSHARD_TOKENIZER_WORDPIECE_H_
#define BERTSHARD_TOKENIZER_WORDPIECE_H_

#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace bertshard::tokenizer {

struct TokenizerOptions {
  bool do_lower_case = true;
  // HF: None means "follow do_lower_case".
  std::optional<bool> strip_accents;
  bool tokenize_chinese_chars = true;
  int max_chars_per_word = 100;
};

// One sequence (or pair) ready for the model: [CLS] a [SEP] (b [SEP]).
struct Encoding {
  std::vector<int64_t> input_ids;
  std::vector<int64_t> token_type_ids;  // 0 for the first segment (with [CLS] and its [SEP]), 1 after
  std::vector<int64_t> attention_mask;  // all ones
};

class WordPieceTokenizer {
 public:
  // One token per line, id = line number. INVALID_ARGUMENT for an empty vocabulary, duplicate
  // tokens, or one without [UNK], [CLS] and [SEP].
  static absl::StatusOr<std::unique_ptr<WordPieceTokenizer>> FromVocab(std::vector<std::string> tokens,
                                                                       const TokenizerOptions& options);
  // NOT_FOUND if the file cannot be read.
  static absl::StatusOr<std::unique_ptr<WordPieceTokenizer>> FromVocabFile(const std::string& path,
                                                                           const TokenizerOptions& options);

  // Word pieces of `text`. INVALID_ARGUMENT if it is not valid UTF-8.
  absl::StatusOr<std::vector<std::string>> Tokenize(absl::string_view text) const;
  // Ids of `text`'s pieces, without special tokens.
  absl::StatusOr<std::vector<int64_t>> TokenIds(absl::string_view text) const;
  // [CLS] text [SEP] (pair [SEP]). INVALID_ARGUMENT if longer than `max_length` (when > 0).
  absl::StatusOr<Encoding> Encode(absl::string_view text, std::optional<absl::string_view> pair,
                                  int64_t max_length = 0) const;

  int64_t vocab_size() const { return static_cast<int64_t>(tokens_.size()); }

 private:
  WordPieceTokenizer(std::vector<std::string> tokens, const TokenizerOptions& options);
  void WordPieces(const std::string& word, std::vector<std::string>* out) const;

  const std::vector<std::string> tokens_;
  std::unordered_map<std::string, int64_t> ids_;
  std::vector<std::string> specials_;  // bracketed special tokens present in the vocabulary
  const TokenizerOptions options_;
};

// Tokenizer options from a checkpoint directory's tokenizer_config.json (do_lower_case,
// strip_accents, tokenize_chinese_chars); defaults when the file is absent. INVALID_ARGUMENT
// for a malformed file.
absl::StatusOr<TokenizerOptions> ReadTokenizerConfig(const std::string& directory);

}  // namespace bertshard::tokenizer

#endif  // BERTSHARD_TOKENIZER_WORDPIECE_H_
