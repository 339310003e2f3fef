#include "http/json_body.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace bertshard::http {
namespace {

TEST(ParseJsonObject, RefusesWhatIsNotAnObject) {
  for (const char* body : {"", "not json", "[1, 2]", "\"text\"", "{\"a\": }"}) {
    SCOPED_TRACE(body);
    EXPECT_EQ(ParseJsonObject(body).status().code(), absl::StatusCode::kInvalidArgument);
  }
  EXPECT_TRUE(ParseJsonObject(R"({"inputs": "x"})").ok());
}

TEST(JsonFields, TypedReadsNameTheFieldAndKeepDefaults) {
  const auto body = ParseJsonObject(R"({"flag": false, "text": "x", "n": 3, "bad": "3", "half": 1.5, "none": null})");
  ASSERT_TRUE(body.ok()) << body.status();
  EXPECT_FALSE(*BoolField(*body, "flag", true));
  EXPECT_TRUE(*BoolField(*body, "absent", true));
  EXPECT_TRUE(*BoolField(*body, "none", true));  // null reads as absent, as serde's Option does
  EXPECT_EQ(*StringField(*body, "text", ""), "x");
  EXPECT_EQ(IntField(*body, "n", 1, 10)->value(), 3);
  EXPECT_FALSE(IntField(*body, "absent", 1, 10)->has_value());
  const absl::Status wrong = BoolField(*body, "text", false).status();
  EXPECT_EQ(wrong.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(wrong.message().find("`text` must be true or false"), std::string::npos) << wrong;
  EXPECT_FALSE(IntField(*body, "bad", 1, 10).ok());
  EXPECT_FALSE(IntField(*body, "half", 1, 10).ok());
  EXPECT_FALSE(IntField(*body, "n", 4, 10).ok());
}

TEST(ParseInputs, TakesTeisAndOpenAisShapes) {
  const auto single = ParseJsonObject(R"({"inputs": "hello"})");
  const auto parsed = ParseInputs(*single, "inputs");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_FALSE(parsed->batch);
  ASSERT_EQ(parsed->items.size(), 1u);
  EXPECT_EQ(parsed->items[0].text, "hello");

  const auto ids = ParseInputs(*ParseJsonObject(R"({"input": [101, 7592, 102]})"), "input");
  ASSERT_TRUE(ids.ok()) << ids.status();
  ASSERT_EQ(ids->items.size(), 1u);
  EXPECT_TRUE(ids->items[0].is_ids);
  EXPECT_EQ(ids->items[0].ids, (std::vector<int64_t>{101, 7592, 102}));

  const auto mixed = ParseInputs(*ParseJsonObject(R"({"inputs": ["a", [1, 2], ""]})"), "inputs");
  ASSERT_TRUE(mixed.ok()) << mixed.status();
  EXPECT_TRUE(mixed->batch);
  ASSERT_EQ(mixed->items.size(), 3u);
  EXPECT_FALSE(mixed->items[0].is_ids);
  EXPECT_TRUE(mixed->items[1].is_ids);
  EXPECT_EQ(mixed->items[2].text, "");  // empty inputs are the routes' to refuse, with TEI's words

  const auto empty = ParseInputs(*ParseJsonObject(R"({"inputs": []})"), "inputs");
  ASSERT_TRUE(empty.ok());
  EXPECT_TRUE(empty->batch);
  EXPECT_TRUE(empty->items.empty());
}

TEST(ParseInputs, RefusesOtherShapesNamingTheField) {
  for (const char* body : {R"({})", R"({"inputs": 5})", R"({"inputs": {"a": 1}})", R"({"inputs": ["a", 5]})",
                           R"({"inputs": [1, "a"]})", R"({"inputs": [[1.5]]})", R"({"inputs": [-1]})",
                           R"({"inputs": [4294967296]})", R"({"inputs": [[1], [true]]})"}) {
    SCOPED_TRACE(body);
    const auto parsed = ParseInputs(*ParseJsonObject(body), "inputs");
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(parsed.status().message().find("inputs"), std::string::npos) << parsed.status();
  }
}

TEST(AppendFloatArray, WritesTheShortestFormThatReadsBack) {
  std::string out;
  AppendFloatArray({0.5f, 1.0f / 3.0f, -2.0f, 1e-8f, 0.1f}, &out);
  EXPECT_EQ(out, "[0.5,0.33333334,-2,1e-08,0.1]");
  out.clear();
  AppendFloatArray({}, &out);
  EXPECT_EQ(out, "[]");
}

TEST(Base64, MatchesRfc4648Vectors) {
  // RFC 4648 section 10.
  EXPECT_EQ(Base64(""), "");
  EXPECT_EQ(Base64("f"), "Zg==");
  EXPECT_EQ(Base64("fo"), "Zm8=");
  EXPECT_EQ(Base64("foo"), "Zm9v");
  EXPECT_EQ(Base64("foob"), "Zm9vYg==");
  EXPECT_EQ(Base64("fooba"), "Zm9vYmE=");
  EXPECT_EQ(Base64("foobar"), "Zm9vYmFy");
  EXPECT_EQ(Base64(std::string("\xff\x00\x80", 3)), "/wCA");
}

}  // namespace
}  // namespace bertshard::http
