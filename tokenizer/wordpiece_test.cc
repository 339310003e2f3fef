#include "tokenizer/wordpiece.h"

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/checkpoint_dir.h"
#include "common/model_root.h"
#include "common/proto_json.h"
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

// The same vocabulary lower-cased but not accent-stripped (tokenizer_config strip_accents: false).
const WordPieceTokenizer& LowerOnly() {
  static const auto* tok = [] {
    TokenizerOptions options;
    options.strip_accents = false;
    auto t = WordPieceTokenizer::FromVocabFile("tests/testdata/vocab/bert-base-uncased-vocab.txt", options);
    EXPECT_TRUE(t.ok()) << t.status();
    return t->release();
  }();
  return *tok;
}

// Cased semantics: no lower-casing, so (strip_accents unset) no accent stripping either.
const WordPieceTokenizer& Cased() {
  static const auto* tok = [] {
    TokenizerOptions options;
    options.do_lower_case = false;
    auto t = WordPieceTokenizer::FromVocabFile("tests/testdata/vocab/bert-base-uncased-vocab.txt", options);
    EXPECT_TRUE(t.ok()) << t.status();
    return t->release();
  }();
  return *tok;
}

// The real bert-base-cased vocabulary with its settings (tests/testdata/vocab/README.md).
const WordPieceTokenizer& RealCased() {
  static const auto* tok = [] {
    TokenizerOptions options;
    options.do_lower_case = false;
    auto t = WordPieceTokenizer::FromVocabFile("tests/testdata/vocab/bert-base-cased-vocab.txt", options);
    EXPECT_TRUE(t.ok()) << t.status();
    return t->release();
  }();
  return *tok;
}

std::string Repeat(absl::string_view s, int n) {
  std::string out;
  for (int i = 0; i < n; ++i) out.append(s.data(), s.size());
  return out;
}

// n one-token words: "a a a" (id 1037 each) or "b b" (1038).
std::string Words(char c, int n) {
  std::string out;
  for (int i = 0; i < n; ++i) {
    if (i > 0) out += ' ';
    out += c;
  }
  return out;
}

EncodeOptions Truncate(int64_t max_length) {
  EncodeOptions o;
  o.max_length = max_length;
  o.truncation = true;
  return o;
}

// The ids of a pair of Words('a', kept1) and Words('b', kept2): [CLS] a.. [SEP] b.. [SEP].
Ids PairOfWords(int kept1, int kept2) {
  Ids ids{101};
  ids.insert(ids.end(), kept1, 1037);
  ids.push_back(102);
  ids.insert(ids.end(), kept2, 1038);
  ids.push_back(102);
  return ids;
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

TEST(WordPiece, KnownCasedTokenisations) {
  // tests/testdata/vocab/README.md (HF tokenizers' own bert-base-cased test, and HF's ids for it).
  EXPECT_EQ(*RealCased().Tokenize("Hey there dear friend!"), (Pieces{"Hey", "there", "dear", "friend", "!"}));
  EXPECT_EQ(RealCased().Encode("Hey there dear friend!", std::nullopt)->input_ids,
            (Ids{101, 4403, 1175, 7059, 1910, 106, 102}));
  // Case and accents kept, "##" pieces with accents.
  const std::string text = "Hello, World! na\u00efve Caf\u00e9";
  EXPECT_EQ(*RealCased().Tokenize(text), (Pieces{"Hello", ",", "World", "!", "na", "##\u00ef", "##ve", "Caf\u00e9"}));
  EXPECT_EQ(*RealCased().TokenIds(text), (Ids{8667, 117, 1291, 106, 9468, 28203, 2707, 21036}));
  EXPECT_EQ(RealCased().Decode(*RealCased().TokenIds(text)), text);
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

// Expected values below come from HF tokenizers 0.19.1 (BertWordPieceTokenizer on this vocabulary);
// tokenizer_parity_test checks the same on every code point and a corpus.

TEST(WordPiece, EveryUnicodeWhitespaceThatCleaningKeepsSeparatesWords) {
  // U+2028 LINE SEPARATOR used to be a word character here, and so [UNK].
  EXPECT_EQ(*Uncased().Tokenize("a\u2028b"), (Pieces{"a", "b"}));
  EXPECT_EQ(*Uncased().Tokenize("a\u2029b"), (Pieces{"a", "b"}));
  EXPECT_EQ(*Uncased().BasicTokenize("a\u3000b\u00a0c\u1680d\u2000e\u200af\u202fg\u205fh\u2028i\u2029j\tk\nl\rm"),
            (Pieces{"a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "l", "m"}));
  EXPECT_EQ(*Uncased().TokenIds("\u2028\u2029\u3000 \t"), Ids{});
}

TEST(WordPiece, ControlAndFormatCharactersAreDroppedNotSpaces) {
  // Cleaning drops control characters before it maps whitespace, so the White_Space controls
  // U+000B, U+000C and U+0085 vanish, as do U+001C..U+001F, zero-width and bidi formatting
  // characters, the soft hyphen, private use, NUL and U+FFFD: the letters around them join.
  EXPECT_EQ(*Uncased().BasicTokenize("a\x0b"
                                     "b\x0c"
                                     "c\u0085d\x1c"
                                     "e\x1f"
                                     "f\u200bg\u200dh\ufeffi\u00adj\u2066k\ue000l"),
            (Pieces{"abcdefghijkl"}));
  EXPECT_EQ(*Uncased().BasicTokenize(std::string("m\0n\uFFFDo", 7)), (Pieces{"mno"}));
  EXPECT_EQ(*Uncased().Tokenize("soft\u00adhyphen"), (Pieces{"soft", "##hy", "##ph", "##en"}));
  // HF's category tables predate these: unassigned U+0378 and U+0890 (Cf since Unicode 14) stay,
  // and make the word unknown.
  EXPECT_EQ(*Uncased().TokenIds("a\u0378b"), Ids{100});
  EXPECT_EQ(*Uncased().TokenIds("a\u0890b"), Ids{100});
}

TEST(WordPiece, PunctuationCjkAndMarksFollowHfTables) {
  EXPECT_EQ(*Uncased().TokenIds("a\u2014b"), (Ids{1037, 1517, 1038}));    // em dash splits
  EXPECT_EQ(*Uncased().BasicTokenize("a\u2e55b"), (Pieces{"a\u2e55b"}));  // Ps only since Unicode 14
  EXPECT_EQ(*Uncased().TokenIds("...!!!?! (((x)))"),
            (Ids{1012, 1012, 1012, 999, 999, 999, 1029, 999, 1006, 1006, 1006, 1060, 1007, 1007, 1007}));
  // HF's CJK ranges skip U+2B820..U+2B91F (Python's BertTokenizer does not).
  EXPECT_EQ(*Uncased().BasicTokenize("x\U0002B820y"), (Pieces{"x\U0002B820y"}));
  EXPECT_EQ(*Uncased().BasicTokenize("x\U0002B920y"), (Pieces{"x", "\U0002B920", "y"}));
  EXPECT_EQ(*Uncased().BasicTokenize("a\u1ac1b"), (Pieces{"a\u1ac1b"}));  // Mn only since Unicode 14: kept
  EXPECT_EQ(*Uncased().BasicTokenize("Ångström naı\u0308ve"), (Pieces{"angstrom", "naıve"}));
  EXPECT_EQ(*Cased().BasicTokenize("Ångström"), (Pieces{"Ångström"}));
  EXPECT_EQ(*Uncased().Tokenize("\U0001F468\u200D\U0001F469\u200D\U0001F467 \U0001F44D\U0001F3FD \u2603"),
            (Pieces{"[UNK]", "[UNK]", "[UNK]"}));
}

TEST(WordPiece, LowerCasesCharacterByCharacter) {
  EXPECT_EQ(*Uncased().Tokenize("ΣΑΣ"), (Pieces{"σ", "##α", "##σ"}));  // no final sigma
  EXPECT_EQ(*LowerOnly().BasicTokenize("ΣΑΣ İ"), (Pieces{"σασ", "i\u0307"}));
  EXPECT_EQ(*Uncased().BasicTokenize("İstanbul STRAẞE \u2126"), (Pieces{"istanbul", "straße", "ω"}));
  EXPECT_EQ(*Uncased().Tokenize("ﬁne"), (Pieces{"ﬁ", "##ne"}));  // ligatures stay
}

TEST(WordPiece, LongWordsCountCharactersAfterNormalisation) {
  EXPECT_NE(*Uncased().Tokenize(std::string(100, 'a')), (Pieces{"[UNK]"}));
  EXPECT_EQ(*Uncased().Tokenize(std::string(101, 'a')), (Pieces{"[UNK]"}));
  EXPECT_EQ(*Uncased().Tokenize(Repeat("\u00e9", 101)), (Pieces{"[UNK]"}));
  // 60 times e + U+0301: 120 characters, 60 once the accents are stripped.
  EXPECT_EQ(Uncased().Tokenize(Repeat("e\u0301", 60))->front(), "ee");
  EXPECT_EQ(*Cased().Tokenize(Repeat("e\u0301", 60)), (Pieces{"[UNK]"}));
}

// HF's WordPiece (max_input_chars_per_word = 100) makes a word of more than 100 characters one
// [UNK], and splits one of exactly 100 as any other. On a vocabulary of "a" and "##a" nothing else
// can make the 101-character word unknown; values from tokenizers 0.19.1.
TEST(WordPiece, WordsOverTheMaximumLengthBecomeOneUnk) {
  auto tok = WordPieceTokenizer::FromVocab({"[UNK]", "[CLS]", "[SEP]", "a", "##a", "x", "\u00e9", "##\u00e9"}, {});
  ASSERT_TRUE(tok.ok()) << tok.status();
  Pieces hundred = {"a"};
  hundred.insert(hundred.end(), 99, "##a");
  EXPECT_EQ(*(*tok)->Tokenize(std::string(100, 'a')), hundred);
  EXPECT_EQ(*(*tok)->Tokenize(std::string(101, 'a')), (Pieces{"[UNK]"}));
  // Only the long word: its neighbours are split as usual.
  EXPECT_EQ(*(*tok)->TokenIds("x " + std::string(101, 'a') + " x"), (Ids{5, 0, 5}));
  // Characters, not bytes: 100 two-byte characters (200 bytes) are within the limit.
  auto cased = WordPieceTokenizer::FromVocab({"[UNK]", "[CLS]", "[SEP]", "\u00e9", "##\u00e9"},
                                             TokenizerOptions{.do_lower_case = false});
  ASSERT_TRUE(cased.ok()) << cased.status();
  Pieces accented = {"\u00e9"};
  accented.insert(accented.end(), 99, "##\u00e9");
  EXPECT_EQ(*(*cased)->Tokenize(Repeat("\u00e9", 100)), accented);
  EXPECT_EQ(*(*cased)->Tokenize(Repeat("\u00e9", 101)), (Pieces{"[UNK]"}));
  // The limit is an option.
  auto five =
      WordPieceTokenizer::FromVocab({"[UNK]", "[CLS]", "[SEP]", "a", "##a"}, TokenizerOptions{.max_chars_per_word = 5});
  ASSERT_TRUE(five.ok()) << five.status();
  EXPECT_EQ(*(*five)->Tokenize("aaaaa aaaaaa"), (Pieces{"a", "##a", "##a", "##a", "##a", "[UNK]"}));
  // The real vocabulary, in an encoding: [CLS] [UNK] [SEP].
  EXPECT_EQ(Uncased().Encode("x" + std::string(100, 'a'), std::nullopt)->input_ids, (Ids{101, 100, 102}));
}

// tokenize_chinese_chars = false (HF: handle_chinese_chars=False) leaves CJK ideographs inside their
// word, which WordPiece then splits with "##" pieces; punctuation and whitespace still separate
// words. Expected values from tokenizers 0.19.1 (BertWordPieceTokenizer on this vocabulary).
TEST(WordPiece, CjkCharactersStayInTheirWordWithoutTokenizeChineseChars) {
  TokenizerOptions options;
  options.tokenize_chinese_chars = false;
  auto tok = WordPieceTokenizer::FromVocabFile("tests/testdata/vocab/bert-base-uncased-vocab.txt", options);
  ASSERT_TRUE(tok.ok()) << tok.status();
  const std::string text = "\u4e2d\u6587\uff0c\u597d x\u4e2dy";  // 中文，好 x中y
  EXPECT_EQ(*(*tok)->BasicTokenize(text), (Pieces{"\u4e2d\u6587", "\uff0c", "\u597d", "x\u4e2dy"}));
  EXPECT_EQ(*(*tok)->TokenIds(text), (Ids{1746, 30387, 1989, 100, 1060, 30272, 2100}));
  EXPECT_EQ(*(*tok)->Tokenize("\u4e2d\u6587abc"), (Pieces{"\u4e2d", "##\u6587", "##ab", "##c"}));
  // The default splits each ideograph off.
  EXPECT_EQ(*Uncased().BasicTokenize(text), (Pieces{"\u4e2d", "\u6587", "\uff0c", "\u597d", "x", "\u4e2d", "y"}));
  EXPECT_EQ(*Uncased().TokenIds(text), (Ids{1746, 1861, 1989, 100, 1060, 1746, 1061}));
  // And tokenizer_config.json's false reaches the tokenizer.
  const std::string dir = std::string(std::getenv("TEST_TMPDIR")) + "/no_cjk_split";
  ASSERT_EQ(std::system(("mkdir -p " + dir).c_str()), 0);
  std::ofstream(dir + "/tokenizer_config.json") << R"({"tokenize_chinese_chars": false})";
  auto read = ReadTokenizerConfig(dir);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_FALSE(read->tokenize_chinese_chars);
  EXPECT_TRUE(read->do_lower_case);
}

// Empty text, and text that cleaning empties (whitespace, control and format characters), encode
// as [CLS] [SEP] (a pair adds its [SEP]), as HF's tokenizer does; refusing it is the server's
// business (server/input_preparation.cc PrepareInput), not the tokenizer's.
TEST(WordPiece, EmptyAndWhitespaceOnlyTextEncodesAsClsSep) {
  for (const std::string text : {"", "   ", " \t\n\r\u3000\u00a0\u2028", "\x01\u200b\ufeff"}) {
    SCOPED_TRACE(testing::Message() << "text of " << text.size() << " bytes");
    EXPECT_EQ(*Uncased().TokenIds(text), Ids{});
    auto e = Uncased().Encode(text, std::nullopt);
    ASSERT_TRUE(e.ok()) << e.status();
    EXPECT_EQ(e->input_ids, (Ids{101, 102}));
    EXPECT_EQ(e->token_type_ids, (Ids{0, 0}));
    EXPECT_EQ(e->attention_mask, (Ids{1, 1}));
    EXPECT_FALSE(e->truncated);
    auto pair = Uncased().Encode(text, absl::string_view(text));
    ASSERT_TRUE(pair.ok()) << pair.status();
    EXPECT_EQ(pair->input_ids, (Ids{101, 102, 102}));
    EXPECT_EQ(pair->token_type_ids, (Ids{0, 0, 1}));
  }
  // Still within a limit of 2 without truncation; 1 cannot hold [CLS] [SEP].
  EXPECT_TRUE(Uncased().Encode("  ", std::nullopt, 2).ok());
  auto too_small = Uncased().Encode("", std::nullopt, 1);
  EXPECT_EQ(too_small.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(too_small.status().message().find("the text is 2 tokens with [CLS]/[SEP]; the model takes at most 1"),
            absl::string_view::npos)
      << too_small.status();
}

TEST(WordPiece, SpecialTokensAreMatchedInTheRawTextOnly) {
  EXPECT_EQ(*Uncased().Tokenize("x[MASK]y [mask]"), (Pieces{"x", "[MASK]", "y", "[", "mask", "]"}));
  EXPECT_EQ(*Uncased().Tokenize("[CLS][SEP][PAD][UNK]"), (Pieces{"[CLS]", "[SEP]", "[PAD]", "[UNK]"}));
  EXPECT_EQ(*Uncased().Tokenize("[MA\u200bSK]"), (Pieces{"[", "mask", "]"}));  // cleaned after matching
  EXPECT_EQ(*Uncased().Tokenize("[[MASK]]\u0301"), (Pieces{"[", "[MASK]", "]"}));
}

TEST(WordPiece, TruncatesSingleTextsOnRequest) {
  auto cut = Uncased().Encode(Words('a', 5), std::nullopt, Truncate(4));
  ASSERT_TRUE(cut.ok()) << cut.status();
  EXPECT_EQ(cut->input_ids, (Ids{101, 1037, 1037, 102}));
  EXPECT_EQ(cut->token_type_ids, Ids(4, 0));
  EXPECT_EQ(cut->attention_mask, Ids(4, 1));
  EXPECT_TRUE(cut->truncated);

  auto fits = Uncased().Encode(Words('a', 2), std::nullopt, Truncate(4));
  ASSERT_TRUE(fits.ok());
  EXPECT_EQ(fits->input_ids, (Ids{101, 1037, 1037, 102}));
  EXPECT_FALSE(fits->truncated);

  EXPECT_EQ(Uncased().Encode(Words('a', 5), std::nullopt, Truncate(2))->input_ids, (Ids{101, 102}));
  // Too small for [CLS] and the [SEP]s.
  EXPECT_EQ(Uncased().Encode("a", std::nullopt, Truncate(1)).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Uncased().Encode("a", absl::string_view("b"), Truncate(2)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(Uncased().Encode(Words('a', 600), std::nullopt, Truncate(0))->truncated);  // 0: no limit
}

TEST(WordPiece, TruncatesFromTheStartOnRequestKeepingTheLastTokens) {
  EncodeOptions left = Truncate(4);
  left.from_left = true;
  const Ids tail = *Uncased().TokenIds("four five");
  auto cut = Uncased().Encode("one two three four five", std::nullopt, left);
  ASSERT_TRUE(cut.ok()) << cut.status();
  EXPECT_EQ(cut->input_ids, (Ids{101, tail[0], tail[1], 102}));
  EXPECT_TRUE(cut->truncated);
  // Pairs: the lengths longest-first gives (2 and 2 of a room of 4), each segment's last tokens.
  left.max_length = 7;
  const Ids a = *Uncased().TokenIds("two three");
  const Ids b = *Uncased().TokenIds("six seven");
  auto pair = Uncased().Encode("one two three", absl::string_view("four five six seven"), left);
  ASSERT_TRUE(pair.ok()) << pair.status();
  EXPECT_EQ(pair->input_ids, (Ids{101, a[0], a[1], 102, b[0], b[1], 102}));
  // Within the limit nothing is cut, whichever side.
  left.max_length = 16;
  EXPECT_FALSE(Uncased().Encode("one two three", std::nullopt, left)->truncated);
}

TEST(WordPiece, RefusesTooLongTextsWithoutTruncation) {
  auto refused = Uncased().Encode(Words('a', 5), std::nullopt, 4);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("7 tokens"), absl::string_view::npos) << refused.status();
  EXPECT_NE(refused.status().message().find("at most 4"), absl::string_view::npos) << refused.status();
  EXPECT_NE(refused.status().message().find("truncation"), absl::string_view::npos) << refused.status();
  EncodeOptions no_truncation;
  no_truncation.max_length = 4;
  EXPECT_EQ(Uncased().Encode(Words('a', 5), std::nullopt, no_truncation).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(Uncased().Encode(Words('a', 2), std::nullopt, 4)->truncated);
}

TEST(WordPiece, TruncatesPairsLongestFirstAsHf) {
  struct Case {
    int n1, n2, max_length, kept1, kept2;
  };
  // The shorter stays whole if the longer gets at least as much; else halves, the odd token to
  // the longer one, or to the pair on a tie (Python's slow BertTokenizer gives it to the first).
  for (const Case& c : {Case{7, 7, 4, 0, 1}, Case{7, 2, 6, 2, 1}, Case{2, 7, 6, 1, 2}, Case{5, 5, 10, 3, 4},
                        Case{6, 4, 9, 3, 3}, Case{1, 10, 8, 1, 4}, Case{3, 0, 4, 1, 0}, Case{7, 7, 3, 0, 0}}) {
    SCOPED_TRACE(testing::Message() << c.n1 << " + " << c.n2 << " tokens, max_length " << c.max_length);
    auto e = Uncased().Encode(Words('a', c.n1), absl::string_view(Words('b', c.n2)), Truncate(c.max_length));
    ASSERT_TRUE(e.ok()) << e.status();
    EXPECT_EQ(e->input_ids, PairOfWords(c.kept1, c.kept2));
    Ids types(static_cast<size_t>(c.kept1 + 2), 0);
    types.insert(types.end(), c.kept2 + 1, 1);
    EXPECT_EQ(e->token_type_ids, types);
    EXPECT_TRUE(e->truncated);
  }
  // An empty second text is still a pair (tokenizers; transformers' __call__ drops it).
  EXPECT_EQ(Uncased().Encode("a", absl::string_view(""))->input_ids, (Ids{101, 1037, 102, 102}));
}

// Issue 21: with a limit, a text is tokenised only as far as the limit needs. What is kept must
// be what tokenising all of it and then truncating keeps, for pairs too: with both segments over
// an odd room the longer one gets the odd token, so their full lengths are compared then.
TEST(WordPiece, TruncatingLongTextsReadsOnlyWhatTheLimitNeedsWithHfsAnswer) {
  struct Case {
    int n1, n2, max_length, kept1, kept2;
  };
  for (const Case& c : {Case{20, 19, 10, 4, 3}, Case{19, 20, 10, 3, 4}, Case{20, 20, 10, 3, 4}, Case{1000, 2, 10, 5, 2},
                        Case{2, 1000, 10, 2, 5}, Case{1000, 999, 9, 3, 3}, Case{999, 1000, 11, 4, 4},
                        Case{1000, 999, 12, 5, 4}, Case{999, 1000, 12, 4, 5}}) {
    SCOPED_TRACE(testing::Message() << c.n1 << " + " << c.n2 << " tokens, max_length " << c.max_length);
    auto e = Uncased().Encode(Words('a', c.n1), absl::string_view(Words('b', c.n2)), Truncate(c.max_length));
    ASSERT_TRUE(e.ok()) << e.status();
    EXPECT_EQ(e->input_ids, PairOfWords(c.kept1, c.kept2));
    EXPECT_TRUE(e->truncated);
  }
  // A single text: its first pieces, whatever follows (here a [MASK] and bad words far on).
  const std::string text = Words('a', 50) + " [MASK] " + Repeat("x\u00e9\u0301 ", 1000);
  auto single = Uncased().Encode(text, std::nullopt, Truncate(6));
  ASSERT_TRUE(single.ok()) << single.status();
  EXPECT_EQ(single->input_ids, (Ids{101, 1037, 1037, 1037, 1037, 102}));
  // Invalid UTF-8 is refused wherever it is, as when all of the text was read.
  EXPECT_EQ(Uncased().Encode(Words('a', 50) + " \xff", std::nullopt, Truncate(6)).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Far too long without truncation: refused with a lower bound once 4 x max_length were read.
  auto refused = Uncased().Encode(Words('a', 100), std::nullopt, 4);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("the text is at least 19 tokens"), absl::string_view::npos)
      << refused.status();
}

TEST(WordPiece, DecodesAsHf) {
  auto e =
      Uncased().Encode("Hello , world ! I don ' t know . It ' s 5 ' 6 \" quoted \" (x) [MASK] do not", std::nullopt);
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(Uncased().Decode(e->input_ids), "hello, world! i don't know. it's 5'6 \" quoted \" ( x ) do not");
  EXPECT_EQ(Uncased().Decode(*Uncased().TokenIds("you 're I 'm we 've it 's can n't")), "you're i'm we've it's cann't");
  EXPECT_EQ(Uncased().Decode(*Uncased().TokenIds("a ' b ' c ' ' '")), "a'b'c'' '");  // str.replace: no overlaps
  EXPECT_EQ(Uncased().Decode(*Uncased().TokenIds("x . . . y ? ! ,")), "x... y?!,");
  // Special tokens ([UNK] too) and ids outside the vocabulary are skipped; "##" joins, except first.
  EXPECT_EQ(Uncased().Decode({2, 13137, 20968, 100, 103, 9999999, -1, 30521, 30522}), "[unused1] strawberries～");
  EXPECT_EQ(Uncased().Decode({101, 20968, 13137, 20968, 102}), "##berries strawberries");
  EXPECT_EQ(Uncased().Decode({1005, 1056, 2123, 1005, 1056}), "' t don't");
  EXPECT_EQ(Uncased().Decode({}), "");
}

TEST(WordPiece, LooksUpTokensAndIds) {
  ASSERT_NE(Uncased().IdToToken(101), nullptr);
  EXPECT_EQ(*Uncased().IdToToken(101), "[CLS]");
  EXPECT_EQ(*Uncased().IdToToken(13137), "straw");
  EXPECT_EQ(Uncased().IdToToken(-1), nullptr);
  EXPECT_EQ(Uncased().IdToToken(30522), nullptr);
  EXPECT_EQ(Uncased().TokenToId("straw"), 13137);
  EXPECT_EQ(Uncased().TokenToId("##berries"), 20968);
  EXPECT_EQ(Uncased().TokenToId("[MASK]"), 103);
  EXPECT_EQ(Uncased().TokenToId("Straw"), std::nullopt);  // exact entries, no normalisation
  EXPECT_EQ(Uncased().vocab_size(), 30522);
}

// A fast tokenizer's tokenizer.json whose WordPiece model.vocab maps `tokens[i]` to i, written
// last token first so that nothing can lean on the file's order.
std::string TokenizerJson(const std::vector<std::string>& tokens, absl::string_view type = "WordPiece") {
  std::string vocab;
  for (size_t i = tokens.size(); i-- > 0;) {
    if (!vocab.empty()) vocab += ", ";
    common::AppendJsonString(tokens[i], &vocab);  // the vocabulary holds quotes and backslashes
    vocab += ": " + std::to_string(i);
  }
  return std::string(R"({"version": "1.0", "normalizer": {"type": "BertNormalizer"}, "model": {"type": ")") +
         std::string(type) + R"(", "unk_token": "[UNK]", "vocab": {)" + vocab + "}}}";
}

// The lines of vocab.txt, as WordPieceTokenizer::FromVocabFile reads them.
std::vector<std::string> VocabFileLines(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// A fresh checkpoint directory under TEST_TMPDIR holding `files` (name, contents).
std::string CheckpointWith(const std::string& name, const std::vector<std::pair<std::string, std::string>>& files) {
  const std::string dir = std::string(std::getenv("TEST_TMPDIR")) + "/" + name;
  EXPECT_EQ(std::system(("rm -rf " + dir + " && mkdir -p " + dir).c_str()), 0);
  for (const auto& [file, contents] : files) std::ofstream(dir + "/" + file) << contents;
  return dir;
}

absl::StatusOr<std::unique_ptr<WordPieceTokenizer>> FromCheckpointAt(const std::string& dir) {
  auto opened = common::CheckpointDir::Open(common::ModelRoot(), dir);
  if (!opened.ok()) return opened.status();
  return WordPieceTokenizer::FromCheckpoint(**opened, {});
}

TEST(VocabFromTokenizerJson, ReadsModelVocabInIdOrder) {
  auto tokens = VocabFromTokenizerJson(
      R"({"model": {"type": "WordPiece", "vocab": {"##s": 3, "[UNK]": 0, "play": 2, "[CLS]": 1}}})");
  ASSERT_TRUE(tokens.ok()) << tokens.status();
  EXPECT_EQ(*tokens, (Pieces{"[UNK]", "[CLS]", "play", "##s"}));
  // Escapes and UTF-8 in token names are the tokens themselves.
  auto escaped = VocabFromTokenizerJson(TokenizerJson({"\"", "\\", "caf\u00e9", "\u4e2d"}));
  ASSERT_TRUE(escaped.ok()) << escaped.status();
  EXPECT_EQ(*escaped, (Pieces{"\"", "\\", "caf\u00e9", "\u4e2d"}));
}

TEST(VocabFromTokenizerJson, RefusesWhatIsNotAWordPieceVocabulary) {
  // Each would make a tokenizer with the wrong ids, silently: refused instead.
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"malformed JSON", R"({"model": {"type": "WordPiece", "vocab": {"a": 0)"},
      {"not an object", R"([{"model": {}}])"},
      {"no model", R"({"vocab": {"a": 0}})"},
      {"a BPE model", R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}})"},
      {"a model without a type", R"({"model": {"vocab": {"a": 0}}})"},
      {"no vocab", R"({"model": {"type": "WordPiece"}})"},
      {"an empty vocab", R"({"model": {"type": "WordPiece", "vocab": {}}})"},
      {"a vocab that is a list", R"({"model": {"type": "WordPiece", "vocab": [["a", 0]]}})"},
      {"a duplicate id", R"({"model": {"type": "WordPiece", "vocab": {"a": 0, "b": 1, "c": 1}}})"},
      {"an id past the end", R"({"model": {"type": "WordPiece", "vocab": {"a": 0, "b": 2}}})"},
      {"a negative id", R"({"model": {"type": "WordPiece", "vocab": {"a": -1, "b": 0}}})"},
      {"an id that is not an integer", R"({"model": {"type": "WordPiece", "vocab": {"a": 0, "b": 1.5}}})"},
      {"an id that is a string", R"({"model": {"type": "WordPiece", "vocab": {"a": 0, "b": "1"}}})"},
  };
  for (const auto& [what, json] : bad) {
    EXPECT_EQ(VocabFromTokenizerJson(json).status().code(), absl::StatusCode::kInvalidArgument) << what;
  }
}

TEST(WordPiece, FromCheckpointWithOnlyTokenizerJsonTokenizesAsVocabTxt) {
  // Checkpoints saved by a fast tokenizer may carry tokenizer.json and no vocab.txt.
  const std::vector<std::string> lines = VocabFileLines("tests/testdata/vocab/bert-base-uncased-vocab.txt");
  ASSERT_EQ(lines.size(), 30522u);
  const std::string json_only = CheckpointWith("json_only", {{"tokenizer.json", TokenizerJson(lines)}});
  auto tok = FromCheckpointAt(json_only);
  ASSERT_TRUE(tok.ok()) << tok.status();
  ASSERT_EQ((*tok)->vocab_size(), Uncased().vocab_size());
  for (int64_t id = 0; id < Uncased().vocab_size(); ++id) {
    ASSERT_EQ(*(*tok)->IdToToken(id), *Uncased().IdToToken(id)) << id;
  }
  for (const std::string text : {"i like strawberries", "Héllo, [MASK] wörld! don't \u4e2d\u6587", "\"quoted\" \\"}) {
    auto from_json = (*tok)->Encode(text, "a pair");
    auto from_txt = Uncased().Encode(text, "a pair");
    ASSERT_TRUE(from_json.ok() && from_txt.ok()) << text;
    EXPECT_EQ(from_json->input_ids, from_txt->input_ids) << text;
    EXPECT_EQ(from_json->token_type_ids, from_txt->token_type_ids) << text;
  }
  EXPECT_EQ(*(*tok)->TokenIds("i like strawberries"), (Ids{1045, 2066, 13137, 20968}));
}

TEST(WordPiece, FromCheckpointPrefersVocabTxtAndRefusesABadTokenizerJson) {
  const std::vector<std::string> small = {"[UNK]", "[CLS]", "[SEP]", "play", "##s"};
  std::string vocab_txt;
  for (const std::string& t : small) vocab_txt += t + "\n";
  // With vocab.txt, tokenizer.json is not read at all.
  auto both = FromCheckpointAt(CheckpointWith("both", {{"vocab.txt", vocab_txt}, {"tokenizer.json", "{oops"}}));
  ASSERT_TRUE(both.ok()) << both.status();
  EXPECT_EQ(*(*both)->Tokenize("plays"), (Pieces{"play", "##s"}));
  // Without it, a tokenizer.json that is no WordPiece vocabulary is INVALID_ARGUMENT.
  EXPECT_EQ(FromCheckpointAt(CheckpointWith("bpe", {{"tokenizer.json", TokenizerJson(small, "BPE")}})).status().code(),
            absl::StatusCode::kInvalidArgument);
  // And with neither, NOT_FOUND naming both.
  const absl::Status neither = FromCheckpointAt(CheckpointWith("neither", {{"config.json", "{}"}})).status();
  EXPECT_EQ(neither.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(neither.message().find("tokenizer.json"), std::string::npos) << neither;
}

}  // namespace
}  // namespace bertshard::tokenizer
