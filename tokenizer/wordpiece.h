// File: tokenizer/wordpiece.h
// -----------------------------------------------------------------------------
// BERT's WordPiece tokenizer, driven by a checkpoint's vocab.txt, token for token what HuggingFace
// `tokenizers` (the Rust "fast" BertTokenizer: BertNormalizer, BertPreTokenizer, WordPiece) gives:
//   1. special tokens ([CLS], [SEP], [PAD], [MASK], [UNK]) are cut out of the raw text wherever they
//      occur, even inside a word, and kept whole; the text between them goes through 2-4;
//   2. cleaning: NUL, U+FFFD and "control" characters are dropped (U+000B, U+000C, U+0085, U+200B,
//      U+FEFF, U+00AD, private use, ...), the remaining Unicode whitespace (U+2028, U+00A0, U+3000,
//      ...) separates words, CJK ideographs become words of their own;
//   3. accent stripping (NFD, non-spacing marks dropped) and then lower-casing (character by
//      character: no final sigma), each when configured;
//   4. each punctuation character becomes a word of its own;
//   5. greedy longest-match-first WordPiece with "##" continuations, and [UNK] for a word it cannot
//      cover or one longer than `max_chars_per_word` characters.
// Which characters count as control, whitespace, punctuation, mark or decomposable is HF's answer,
// not today's Unicode's (HF's tables are older; see tokenizer/gen_hf_unicode_tables.py);
// decompositions and case mappings come from ICU. tokenizer_parity_test checks all of it against
// the pinned HF release.
//
// Example:
//   ASSIGN_OR_RETURN(auto tok, WordPieceTokenizer::FromVocabFile("vocab.txt", {}));
//   ASSIGN_OR_RETURN(Encoding e, tok->Encode("i like strawberries", std::nullopt));
//   // e.input_ids == {101, 1045, 2066, 13137, 20968, 102}
//   EncodeOptions o;
//   o.max_length = 512;
//   o.truncation = true;
//   ASSIGN_OR_RETURN(Encoding cut, tok->Encode(question, context, o));  // cut.truncated if it was longer
//   std::string text = tok->Decode(cut.input_ids);
//
// Thread safety: thread-safe after construction (const methods only).
#ifndef BERTSHARD_TOKENIZER_WORDPIECE_H_
#define BERTSHARD_TOKENIZER_WORDPIECE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/checkpoint_dir.h"

namespace bertshard::tokenizer {

struct TokenizerOptions {
  bool do_lower_case = true;
  // HF: None means "follow do_lower_case".
  std::optional<bool> strip_accents;
  bool tokenize_chinese_chars = true;
  int max_chars_per_word = 100;
};

// How Encode treats a length limit.
struct EncodeOptions {
  // The longest encoding allowed, [CLS] and [SEP] included; 0 for no limit.
  int64_t max_length = 0;
  // Over `max_length`: false refuses the text (INVALID_ARGUMENT); true cuts tokens off the end as
  // HF's `truncation=True` does ("longest_first"), keeping [CLS] and [SEP]. For a pair, the shorter
  // segment stays whole when it takes at most half the room and the longer gets the rest;
  // otherwise each gets half, the odd token going to the longer one (to the pair on a tie).
  bool truncation = false;
  // With truncation: cut the tokens off the start of each segment instead of its end, keeping the
  // last ones (HF's truncation_side="left", TEI's truncation_direction "Left"); the same lengths
  // as from the end. The whole text is then tokenised.
  bool from_left = false;
};

// One sequence (or pair) ready for the model: [CLS] a [SEP] (b [SEP]).
struct Encoding {
  std::vector<int64_t> input_ids;
  std::vector<int64_t> token_type_ids;  // 0 for the first segment (with [CLS] and its [SEP]), 1 after
  std::vector<int64_t> attention_mask;  // all ones
  bool truncated = false;               // tokens were cut off to fit EncodeOptions::max_length
};

class WordPieceTokenizer {
 public:
  // One token per line, id = line number. INVALID_ARGUMENT for an empty vocabulary, duplicate
  // tokens, or one without [UNK], [CLS] and [SEP]; INTERNAL if ICU's normalisation data is missing.
  static absl::StatusOr<std::unique_ptr<WordPieceTokenizer>> FromVocab(std::vector<std::string> tokens,
                                                                       const TokenizerOptions& options);
  // NOT_FOUND if the file cannot be read; INVALID_ARGUMENT for anything but a regular file of at
  // most common::kMaxVocabBytes (common/file.h).
  static absl::StatusOr<std::unique_ptr<WordPieceTokenizer>> FromVocabFile(const std::string& path,
                                                                           const TokenizerOptions& options);
  // The checkpoint's vocab.txt, read through its directory's descriptor (common/checkpoint_dir.h)
  // and capped at its max_vocab_bytes; without one, the WordPiece vocabulary of its tokenizer.json
  // (VocabFromTokenizerJson). NOT_FOUND when there is neither; INVALID_ARGUMENT when the directory
  // refuses it or tokenizer.json holds no WordPiece vocabulary.
  static absl::StatusOr<std::unique_ptr<WordPieceTokenizer>> FromCheckpoint(const common::CheckpointDir& dir,
                                                                            const TokenizerOptions& options);

  // The words of `text` before WordPiece (steps 1-4 above: HF's normalizer and pre-tokenizer),
  // special tokens whole. INVALID_ARGUMENT if `text` is not valid UTF-8.
  absl::StatusOr<std::vector<std::string>> BasicTokenize(absl::string_view text) const;
  // Word pieces of `text`. INVALID_ARGUMENT if it is not valid UTF-8.
  absl::StatusOr<std::vector<std::string>> Tokenize(absl::string_view text) const;
  // Ids of `text`'s pieces, without [CLS]/[SEP].
  absl::StatusOr<std::vector<int64_t>> TokenIds(absl::string_view text) const;

  // [CLS] text [SEP] (pair [SEP]). Empty text, or text that cleaning empties (only whitespace or
  // control characters), gives [CLS] [SEP] as HF does; callers that need words check for that
  // (the server refuses it). INVALID_ARGUMENT for text that is not UTF-8; for an encoding
  // longer than options.max_length without options.truncation (the message gives both lengths,
  // or "at least N" when the text was read only until it was known to be too long); and, with
  // truncation, for a max_length too small to hold [CLS] and the [SEP]s. With a max_length, a
  // text is tokenised only as far as the limit needs (the rest is only checked to be UTF-8), so
  // the cost of a long text with truncation is that of its first max_length tokens; the answer is
  // HF's all the same.
  absl::StatusOr<Encoding> Encode(absl::string_view text, std::optional<absl::string_view> pair,
                                  const EncodeOptions& options) const;
  // The same without truncation: INVALID_ARGUMENT if longer than `max_length` (when > 0).
  absl::StatusOr<Encoding> Encode(absl::string_view text, std::optional<absl::string_view> pair,
                                  int64_t max_length = 0) const;

  // The text of token ids, as HF's `tokenizer.decode(ids, skip_special_tokens=True)` gives it
  // (clean_up_tokenization_spaces=True, BERT's default): special tokens ([UNK] too) and ids
  // outside the vocabulary are skipped, "##" pieces join the piece before them, other pieces are
  // separated by a space, and the spaces HF removes are removed (" ." -> ".", " ' " -> "'",
  // " n't" -> "n't", ...). Lower-casing and stripped accents are not undone.
  std::string Decode(const std::vector<int64_t>& ids) const;

  // The token with this id; nullptr outside [0, vocab_size()).
  const std::string* IdToToken(int64_t id) const;
  // The id of this vocabulary entry (exact match, no normalisation); nullopt if there is none.
  std::optional<int64_t> TokenToId(absl::string_view token) const;
  int64_t vocab_size() const { return static_cast<int64_t>(tokens_.size()); }

 private:
  WordPieceTokenizer(std::vector<std::string> tokens, const TokenizerOptions& options);
  // Called for each word of steps 1-4 in order (`special`: a special token); false stops the walk.
  using WordFn = std::function<bool(const std::string& word, bool special)>;
  // Steps 1-4, word by word; true when the whole text was walked (no WordFn said stop).
  absl::StatusOr<bool> Words(absl::string_view text, const WordFn& on_word) const;
  // Appends the ids of `text`'s pieces to `ids`, stopping once it holds more than `stop_above`
  // (< 0: never). True when all of `text` was read: so false means `text` has more than
  // `stop_above` pieces (ids holds a prefix of them, at least stop_above + 1).
  absl::StatusOr<bool> TokenIdsUpTo(absl::string_view text, int64_t stop_above, std::vector<int64_t>* ids) const;
  // Step 5 for one (non-special) word.
  void WordPieces(const std::string& word, std::vector<int64_t>* ids) const;
  bool IsSpecialId(int64_t id) const;

  const std::vector<std::string> tokens_;
  absl::flat_hash_map<std::string, int64_t> ids_;
  std::vector<std::string> specials_;  // special tokens present in the vocabulary, longest first
  std::vector<int64_t> special_ids_;
  int64_t unk_id_ = 0;
  int64_t cls_id_ = 0;
  int64_t sep_id_ = 0;
  const TokenizerOptions options_;
};

// Tokenizer options from a checkpoint directory's tokenizer_config.json (do_lower_case,
// strip_accents, tokenize_chinese_chars); defaults when the file is absent. INVALID_ARGUMENT
// for a malformed file, or one the directory refuses (common/checkpoint_dir.h).
absl::StatusOr<TokenizerOptions> ReadTokenizerConfig(const common::CheckpointDir& dir);
// As above, `directory` opened unconfined.
absl::StatusOr<TokenizerOptions> ReadTokenizerConfig(const std::string& directory);

// A fast tokenizer's tokenizer.json (HF tokenizers' format) as vocab.txt's list: model.vocab's
// tokens by id. INVALID_ARGUMENT for malformed JSON, a model that is not WordPiece, or ids that are
// not 0..n-1, each once.
absl::StatusOr<std::vector<std::string>> VocabFromTokenizerJson(absl::string_view text);

}  // namespace bertshard::tokenizer

#endif  // BERTSHARD_TOKENIZER_WORDPIECE_H_
