// Fuzz target: any bytes as text (and, split at the first NUL, a text pair) -> WordPiece
// tokenizer with a small vocabulary: BasicTokenize, Tokenize, Encode with and without a length
// limit. Invalid UTF-8, long words and odd Unicode must give tokens or a Status.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "tokenizer/wordpiece.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using bertshard::tokenizer::WordPieceTokenizer;
  static const auto* tok = [] {
    std::vector<std::string> vocab = {"[PAD]", "[UNK]", "[CLS]",  "[SEP]", "[MASK]", "the", "a", "##s", "##ing",
                                      "play",  "un",    "##able", "é",     "中",     "!",   ",", "1",   "##2"};
    return WordPieceTokenizer::FromVocab(vocab, {}).value().release();
  }();
  static const auto* cased = [] {
    std::vector<std::string> vocab = {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "The", "##s"};
    bertshard::tokenizer::TokenizerOptions o;
    o.do_lower_case = false;
    o.tokenize_chinese_chars = false;
    o.max_chars_per_word = 5;
    return WordPieceTokenizer::FromVocab(vocab, o).value().release();
  }();
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  const size_t nul = bytes.find('\0');
  const std::string text = bytes.substr(0, nul);
  const std::optional<std::string> pair =
      nul == std::string::npos ? std::nullopt : std::optional<std::string>(bytes.substr(nul + 1));
  for (const WordPieceTokenizer* t : {tok, cased}) {
    (void)t->BasicTokenize(text);
    (void)t->Tokenize(text);
    (void)t->Encode(text, pair);
    bertshard::tokenizer::EncodeOptions o;
    o.max_length = 8;
    o.truncation = true;
    (void)t->Encode(text, pair, o);
  }
  return 0;
}
