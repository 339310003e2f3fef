#include "tokenizer/wordpiece.h"

#include <cstdlib>
#include <fstream>

#include "gtest/gtest.h"

namespace bertshard::tokenizer {
namespace {

using Ids = std::vector<int64_t>;
using Pieces = std::vector<std::string>;

const WordPieceTokenizer& Uncased() {
  static const auto* tok = [] {
    auto t = WordPieceTokenizer::FromVocabFile("tests/testdata/vocab/bert-base-uncased-vocab.txt", {});
    EXPECT_TRUE(t.ok()) << t.status();
    return t->release();
  }();
  return *tok;
}

TEST(WordPiece, KnownUncasedTokenisations) {
  // tests/testdata/vocab/README.md
  EXPECT_EQ(*Uncased().TokenIds("a new test"), (Ids{1037, 2047, 3231}));
  EXPECT_EQ(*Uncased().TokenIds("a new [test]"), (Ids{1037, 2047, 1031, 3231, 1033}));
  EXPECT_EQ(*Uncased().TokenIds("i like strawberries"), (Ids{1045, 2066, 13137, 20968}));
  EXPECT_EQ(*Uncased().Tokenize("i like strawberries"), (Pieces{"i", "like", "straw", "##berries"}));
  EXPECT_EQ(Uncased().Encode("i like strawberries", std::nullopt)->input_ids,
            (Ids{101, 1045, 2066, 13137, 20968, 102}));
  EXPECT_EQ(*Uncased().TokenIds(""), Ids{});
}

TEST(WordPiece, LowercasesStripsAccentsSplitsPunctuationAndCjk) {
  EXPECT_EQ(*Uncased().Tokenize("Héllo, WORLD!"), (Pieces{"hello", ",", "world", "!"}));
  EXPECT_EQ(*Uncased().Tokenize("naïve café"), (Pieces{"naive", "cafe"}));
  EXPECT_EQ(*Uncased().Tokenize("\xe4\xb8\xad\xe6\x96\x87"), (Pieces{"\xe4\xb8\xad", "\xe6\x96\x87"}));  // 中文
  EXPECT_EQ(*Uncased().Tokenize("a\tb\x01\nc  d"), (Pieces{"a", "b", "c", "d"}));  // control char dropped
  EXPECT_EQ(*Uncased().Tokenize("$5^"), (Pieces{"$", "5", "^"}));
}

TEST(WordPiece, SpecialTokensStayWholeAndUnknownsBecomeUnk) {
  EXPECT_EQ(*Uncased().Tokenize("the [MASK] sat"), (Pieces{"the", "[MASK]", "sat"}));
  EXPECT_EQ(*Uncased().Tokenize("hello[SEP]world"), (Pieces{"hello", "[SEP]", "world"}));
  EXPECT_EQ(*Uncased().Tokenize(std::string(101, 'a')), (Pieces{"[UNK]"}));
  EXPECT_EQ(*Uncased().Tokenize("\xe2\x98\x83"), (Pieces{"[UNK]"}));  // a snowman is not in the vocabulary
}

TEST(WordPiece, PairsGetTokenTypesAndLengthLimit) {
  auto e = Uncased().Encode("a new test", absl::string_view("i like"));
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(e->input_ids, (Ids{101, 1037, 2047, 3231, 102, 1045, 2066, 102}));
  EXPECT_EQ(e->token_type_ids, (Ids{0, 0, 0, 0, 0, 1, 1, 1}));
  EXPECT_EQ(e->attention_mask, Ids(8, 1));
  EXPECT_EQ(Uncased().Encode("a new test", std::nullopt, 4).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(WordPiece, RefusesBadTextAndVocabularies) {
  EXPECT_EQ(Uncased().Tokenize("\xff\xfe").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(WordPieceTokenizer::FromVocab({}, {}).ok());
  EXPECT_FALSE(WordPieceTokenizer::FromVocab({"[UNK]", "[CLS]", "a"}, {}).ok());  // no [SEP]
  EXPECT_FALSE(WordPieceTokenizer::FromVocab({"[UNK]", "[CLS]", "[SEP]", "a", "a"}, {}).ok());
  EXPECT_EQ(WordPieceTokenizer::FromVocabFile("/nonexistent/vocab.txt", {}).status().code(),
            absl::StatusCode::kNotFound);
}

TEST(WordPiece, CasedOptionsFromTokenizerConfig) {
  const std::string dir = std::getenv("TEST_TMPDIR");
  std::ofstream(dir + "/tokenizer_config.json") << R"({"do_lower_case": false, "tokenize_chinese_chars": true})";
  auto options = ReadTokenizerConfig(dir);
  ASSERT_TRUE(options.ok());
  EXPECT_FALSE(options->do_lower_case);
  auto cased = WordPieceTokenizer::FromVocab({"[UNK]", "[CLS]", "[SEP]", "Hello", "hello", "caf", "##é"}, *options);
  ASSERT_TRUE(cased.ok());
  EXPECT_EQ(*(*cased)->Tokenize("Hello café"), (Pieces{"Hello", "caf", "##é"}));
  std::ofstream(dir + "/tokenizer_config.json") << "{oops";
  EXPECT_FALSE(ReadTokenizerConfig(dir).ok());
}

}  // namespace
}  // namespace bertshard::tokenizer
