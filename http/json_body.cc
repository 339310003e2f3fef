#include "http/json_body.h"

#include <charconv>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "google/protobuf/util/json_util.h"

namespace bertshard::http {
namespace {

using google::protobuf::Struct;
using google::protobuf::Value;

absl::Status WrongType(const std::string& name, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("`", name, "` must be ", what));
}

// Token ids: what TEI's u32 and OpenAI's tokens are, bounded so that every id fits an int32
// vocabulary index.
constexpr int64_t kMaxTokenId = std::numeric_limits<int32_t>::max();

absl::StatusOr<std::vector<int64_t>> TokenIds(const google::protobuf::ListValue& list, const std::string& what) {
  std::vector<int64_t> ids;
  ids.reserve(static_cast<size_t>(list.values_size()));
  for (const Value& v : list.values()) {
    if (v.kind_case() != Value::kNumberValue) return WrongType(what, "a list of token ids (whole numbers)");
    absl::StatusOr<int64_t> id = WholeNumber(v, what, 0, kMaxTokenId);
    if (!id.ok()) return id.status();
    ids.push_back(*id);
  }
  return ids;
}

}  // namespace

absl::StatusOr<Struct> ParseJsonObject(absl::string_view body) {
  Value value;
  const auto parsed = google::protobuf::util::JsonStringToMessage(std::string(body), &value);
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the request body is not valid JSON: ", std::string(parsed.message())));
  }
  if (value.kind_case() != Value::kStructValue) {
    return absl::InvalidArgumentError("the request body must be a JSON object");
  }
  return std::move(*value.mutable_struct_value());
}

const Value* Field(const Struct& object, const std::string& name) {
  const auto found = object.fields().find(name);
  if (found == object.fields().end() || found->second.kind_case() == Value::kNullValue) return nullptr;
  return &found->second;
}

absl::StatusOr<bool> BoolField(const Struct& object, const std::string& name, bool fallback) {
  const Value* v = Field(object, name);
  if (v == nullptr) return fallback;
  if (v->kind_case() != Value::kBoolValue) return WrongType(name, "true or false");
  return v->bool_value();
}

absl::StatusOr<std::string> StringField(const Struct& object, const std::string& name, const std::string& fallback) {
  const Value* v = Field(object, name);
  if (v == nullptr) return fallback;
  if (v->kind_case() != Value::kStringValue) return WrongType(name, "a string");
  return v->string_value();
}

absl::StatusOr<int64_t> WholeNumber(const Value& value, const std::string& what, int64_t min, int64_t max) {
  const double d = value.kind_case() == Value::kNumberValue ? value.number_value() : std::nan("");
  if (!std::isfinite(d) || d != std::floor(d) || d < static_cast<double>(min) || d > static_cast<double>(max)) {
    return absl::InvalidArgumentError(absl::StrCat("`", what, "` must be a whole number in ", min, "..", max));
  }
  return static_cast<int64_t>(d);
}

absl::StatusOr<std::optional<int64_t>> IntField(const Struct& object, const std::string& name, int64_t min,
                                                int64_t max) {
  const Value* v = Field(object, name);
  if (v == nullptr) return std::optional<int64_t>();
  absl::StatusOr<int64_t> n = WholeNumber(*v, name, min, max);
  if (!n.ok()) return n.status();
  return std::optional<int64_t>(*n);
}

absl::StatusOr<ParsedInputs> ParseInputs(const Struct& object, const std::string& name) {
  const Value* v = Field(object, name);
  constexpr absl::string_view kShapes = "a string, a list of strings, a list of token ids or a list of token-id lists";
  if (v == nullptr) return absl::InvalidArgumentError(absl::StrCat("`", name, "` is missing: it must be ", kShapes));
  ParsedInputs parsed;
  if (v->kind_case() == Value::kStringValue) {
    parsed.items.push_back({false, v->string_value(), {}});
    return parsed;
  }
  if (v->kind_case() != Value::kListValue) return WrongType(name, kShapes);
  const google::protobuf::ListValue& list = v->list_value();
  // A list of numbers is one input of token ids (OpenAI's `input: [1, 2, 3]`).
  if (list.values_size() > 0 && list.values(0).kind_case() == Value::kNumberValue) {
    absl::StatusOr<std::vector<int64_t>> ids = TokenIds(list, name);
    if (!ids.ok()) return ids.status();
    parsed.items.push_back({true, "", *std::move(ids)});
    return parsed;
  }
  parsed.batch = true;
  parsed.items.reserve(static_cast<size_t>(list.values_size()));
  for (int i = 0; i < list.values_size(); ++i) {
    const Value& item = list.values(i);
    const std::string what = absl::StrCat(name, "[", i, "]");
    if (item.kind_case() == Value::kStringValue) {
      parsed.items.push_back({false, item.string_value(), {}});
    } else if (item.kind_case() == Value::kListValue) {
      absl::StatusOr<std::vector<int64_t>> ids = TokenIds(item.list_value(), what);
      if (!ids.ok()) return ids.status();
      parsed.items.push_back({true, "", *std::move(ids)});
    } else {
      return WrongType(what, "a string or a list of token ids");
    }
  }
  return parsed;
}

void AppendFloatArray(absl::Span<const float> values, std::string* out) {
  out->reserve(out->size() + values.size() * 12 + 2);
  out->push_back('[');
  char buffer[32];
  for (size_t i = 0; i < values.size(); ++i) {
    if (i > 0) out->push_back(',');
    const float v = values[i];
    if (!std::isfinite(v)) {
      out->append("null");  // JSON has no NaN; the workers' answers are checked finite before this
      continue;
    }
    const auto written = std::to_chars(buffer, buffer + sizeof(buffer), v);
    out->append(buffer, written.ptr);
  }
  out->push_back(']');
}

void AppendSparseVector(absl::Span<const int32_t> indices, absl::Span<const float> values, std::string* out) {
  out->push_back('[');
  std::string number;
  for (size_t i = 0; i < indices.size() && i < values.size(); ++i) {
    if (i > 0) out->push_back(',');
    absl::StrAppend(out, "{\"index\":", indices[i], ",\"value\":");
    number.clear();
    AppendFloatArray(values.subspan(i, 1), &number);
    out->append(number, 1, number.size() - 2);  // the float without its brackets
    out->push_back('}');
  }
  out->push_back(']');
}

std::string Base64(absl::string_view bytes) {
  static constexpr char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  size_t i = 0;
  for (; i + 3 <= bytes.size(); i += 3) {
    const uint32_t n = (static_cast<uint8_t>(bytes[i]) << 16) | (static_cast<uint8_t>(bytes[i + 1]) << 8) |
                       static_cast<uint8_t>(bytes[i + 2]);
    out.push_back(kAlphabet[(n >> 18) & 63]);
    out.push_back(kAlphabet[(n >> 12) & 63]);
    out.push_back(kAlphabet[(n >> 6) & 63]);
    out.push_back(kAlphabet[n & 63]);
  }
  if (const size_t rest = bytes.size() - i; rest > 0) {
    uint32_t n = static_cast<uint8_t>(bytes[i]) << 16;
    if (rest == 2) n |= static_cast<uint8_t>(bytes[i + 1]) << 8;
    out.push_back(kAlphabet[(n >> 18) & 63]);
    out.push_back(kAlphabet[(n >> 12) & 63]);
    out.push_back(rest == 2 ? kAlphabet[(n >> 6) & 63] : '=');
    out.push_back('=');
  }
  return out;
}

}  // namespace bertshard::http
