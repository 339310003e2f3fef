#include "common/proto_json.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "absl/strings/str_cat.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"

namespace bertshard::common {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

class Writer {
 public:
  Writer(const JsonWriteOptions& options, std::string* out)
      : indent_(options.indent),
        emit_defaults_(options.emit_defaults),
        message_writer_(options.message_writer),
        out_(out) {}

  void WriteMessage(const Message& message, int depth) {
    if (message_writer_ && message_writer_(message, out_)) return;
    const Descriptor* descriptor = message.GetDescriptor();
    const std::string& full_name = descriptor->full_name();
    if (full_name == "google.protobuf.Struct") {
      WriteStruct(static_cast<const google::protobuf::Struct&>(message), depth);
      return;
    }
    if (full_name == "google.protobuf.Value") {
      WriteValue(static_cast<const google::protobuf::Value&>(message), depth);
      return;
    }
    if (full_name == "google.protobuf.ListValue") {
      WriteList(static_cast<const google::protobuf::ListValue&>(message), depth);
      return;
    }
    const Reflection* reflection = message.GetReflection();
    out_->push_back('{');
    bool first = true;
    for (int i = 0; i < descriptor->field_count(); ++i) {
      const FieldDescriptor* field = descriptor->field(i);
      if (field->is_repeated()) {
        if (!emit_defaults_ && reflection->FieldSize(message, field) == 0) continue;
      } else if (field->has_presence()) {
        // Unset messages and unset proto3 `optional` scalars mean "absent", never a default.
        if (!reflection->HasField(message, field)) continue;
      } else if (!emit_defaults_ && IsDefault(message, field)) {
        continue;
      }
      BeginMember(&first, depth + 1);
      AppendJsonString(field->name(), out_);
      out_->append(indent_ > 0 ? ": " : ":");
      if (field->is_repeated()) {
        const int n = reflection->FieldSize(message, field);
        out_->push_back('[');
        // Scalars stay on one line: shapes and layer counts read better that way.
        const bool nested = field->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE;
        for (int k = 0; k < n; ++k) {
          if (k > 0) out_->append(indent_ > 0 && !nested ? ", " : ",");
          if (nested) Newline(depth + 2);
          WriteRepeatedElement(message, field, k, depth + 2);
        }
        if (nested) Newline(depth + 1);
        out_->push_back(']');
      } else {
        WriteSingular(message, field, depth + 1);
      }
    }
    if (!first) Newline(depth);
    out_->push_back('}');
  }

 private:
  static bool IsDefault(const Message& m, const FieldDescriptor* f) {
    const Reflection* r = m.GetReflection();
    switch (f->cpp_type()) {
      case FieldDescriptor::CPPTYPE_INT32:
        return r->GetInt32(m, f) == 0;
      case FieldDescriptor::CPPTYPE_INT64:
        return r->GetInt64(m, f) == 0;
      case FieldDescriptor::CPPTYPE_UINT32:
        return r->GetUInt32(m, f) == 0;
      case FieldDescriptor::CPPTYPE_UINT64:
        return r->GetUInt64(m, f) == 0;
      case FieldDescriptor::CPPTYPE_DOUBLE:
        return r->GetDouble(m, f) == 0;
      case FieldDescriptor::CPPTYPE_FLOAT:
        return r->GetFloat(m, f) == 0;
      case FieldDescriptor::CPPTYPE_BOOL:
        return !r->GetBool(m, f);
      case FieldDescriptor::CPPTYPE_ENUM:
        return r->GetEnumValue(m, f) == 0;
      case FieldDescriptor::CPPTYPE_STRING:
        return r->GetStringReference(m, f, nullptr).empty();
      case FieldDescriptor::CPPTYPE_MESSAGE:
        return !r->HasField(m, f);
      default:
        return false;
    }
  }

  void BeginMember(bool* first, int depth) {
    if (!*first) out_->push_back(',');
    *first = false;
    Newline(depth);
  }

  void Newline(int depth) {
    if (indent_ <= 0) return;
    out_->push_back('\n');
    out_->append(static_cast<size_t>(depth * indent_), ' ');
  }

  void WriteEnum(const FieldDescriptor* field, int number) {
    const auto* value = field->enum_type()->FindValueByNumber(number);
    if (value != nullptr) {
      AppendJsonString(value->name(), out_);
    } else {
      absl::StrAppend(out_, number);
    }
  }

  void WriteSingular(const Message& m, const FieldDescriptor* f, int depth) {
    const Reflection* r = m.GetReflection();
    switch (f->cpp_type()) {
      case FieldDescriptor::CPPTYPE_INT32:
        absl::StrAppend(out_, r->GetInt32(m, f));
        break;
      case FieldDescriptor::CPPTYPE_INT64:
        absl::StrAppend(out_, r->GetInt64(m, f));
        break;
      case FieldDescriptor::CPPTYPE_UINT32:
        absl::StrAppend(out_, r->GetUInt32(m, f));
        break;
      case FieldDescriptor::CPPTYPE_UINT64:
        absl::StrAppend(out_, r->GetUInt64(m, f));
        break;
      case FieldDescriptor::CPPTYPE_DOUBLE:
        AppendJsonDouble(r->GetDouble(m, f), out_);
        break;
      case FieldDescriptor::CPPTYPE_FLOAT:
        AppendJsonDouble(r->GetFloat(m, f), out_);
        break;
      case FieldDescriptor::CPPTYPE_BOOL:
        out_->append(r->GetBool(m, f) ? "true" : "false");
        break;
      case FieldDescriptor::CPPTYPE_ENUM:
        WriteEnum(f, r->GetEnumValue(m, f));
        break;
      case FieldDescriptor::CPPTYPE_STRING:
        AppendJsonString(r->GetStringReference(m, f, nullptr), out_);
        break;
      case FieldDescriptor::CPPTYPE_MESSAGE:
        WriteMessage(r->GetMessage(m, f), depth);
        break;
    }
  }

  void WriteRepeatedElement(const Message& m, const FieldDescriptor* f, int k, int depth) {
    const Reflection* r = m.GetReflection();
    switch (f->cpp_type()) {
      case FieldDescriptor::CPPTYPE_INT32:
        absl::StrAppend(out_, r->GetRepeatedInt32(m, f, k));
        break;
      case FieldDescriptor::CPPTYPE_INT64:
        absl::StrAppend(out_, r->GetRepeatedInt64(m, f, k));
        break;
      case FieldDescriptor::CPPTYPE_UINT32:
        absl::StrAppend(out_, r->GetRepeatedUInt32(m, f, k));
        break;
      case FieldDescriptor::CPPTYPE_UINT64:
        absl::StrAppend(out_, r->GetRepeatedUInt64(m, f, k));
        break;
      case FieldDescriptor::CPPTYPE_DOUBLE:
        AppendJsonDouble(r->GetRepeatedDouble(m, f, k), out_);
        break;
      case FieldDescriptor::CPPTYPE_FLOAT:
        AppendJsonDouble(r->GetRepeatedFloat(m, f, k), out_);
        break;
      case FieldDescriptor::CPPTYPE_BOOL:
        out_->append(r->GetRepeatedBool(m, f, k) ? "true" : "false");
        break;
      case FieldDescriptor::CPPTYPE_ENUM:
        WriteEnum(f, r->GetRepeatedEnumValue(m, f, k));
        break;
      case FieldDescriptor::CPPTYPE_STRING:
        AppendJsonString(r->GetRepeatedStringReference(m, f, k, nullptr), out_);
        break;
      case FieldDescriptor::CPPTYPE_MESSAGE:
        WriteMessage(r->GetRepeatedMessage(m, f, k), depth);
        break;
    }
  }

  void WriteStruct(const google::protobuf::Struct& s, int depth) {
    std::vector<const std::string*> keys;
    keys.reserve(s.fields().size());
    for (const auto& entry : s.fields()) keys.push_back(&entry.first);
    std::sort(keys.begin(), keys.end(), [](const std::string* a, const std::string* b) { return *a < *b; });
    out_->push_back('{');
    bool first = true;
    for (const std::string* key : keys) {
      if (!first) out_->append(indent_ > 0 ? ", " : ",");
      first = false;
      AppendJsonString(*key, out_);
      out_->append(indent_ > 0 ? ": " : ":");
      WriteValue(s.fields().at(*key), depth + 1);
    }
    out_->push_back('}');
  }

  void WriteList(const google::protobuf::ListValue& list, int depth) {
    out_->push_back('[');
    for (int i = 0; i < list.values_size(); ++i) {
      if (i > 0) out_->append(indent_ > 0 ? ", " : ",");
      WriteValue(list.values(i), depth + 1);
    }
    out_->push_back(']');
  }

  void WriteValue(const google::protobuf::Value& v, int depth) {
    switch (v.kind_case()) {
      case google::protobuf::Value::kNumberValue:
        AppendJsonDouble(v.number_value(), out_);
        break;
      case google::protobuf::Value::kStringValue:
        AppendJsonString(v.string_value(), out_);
        break;
      case google::protobuf::Value::kBoolValue:
        out_->append(v.bool_value() ? "true" : "false");
        break;
      case google::protobuf::Value::kStructValue:
        WriteStruct(v.struct_value(), depth);
        break;
      case google::protobuf::Value::kListValue:
        WriteList(v.list_value(), depth);
        break;
      case google::protobuf::Value::kNullValue:
      case google::protobuf::Value::KIND_NOT_SET:
      default:
        out_->append("null");
        break;
    }
  }

  const int indent_;
  const bool emit_defaults_;
  const std::function<bool(const google::protobuf::Message&, std::string*)>& message_writer_;
  std::string* const out_;
};

}  // namespace

namespace {

// The length of the well-formed UTF-8 sequence that starts text[i] (a byte >= 0x80), or 0 when it
// is not one (a stray continuation byte, an overlong form, a surrogate, past U+10FFFF, cut short).
size_t Utf8SequenceAt(absl::string_view text, size_t i) {
  const auto at = [&text](size_t k) { return k < text.size() ? static_cast<unsigned char>(text[k]) : 0; };
  const unsigned char lead = at(i);
  size_t n = 0;
  unsigned char low = 0x80, high = 0xBF;  // the second byte's range
  if (lead >= 0xC2 && lead <= 0xDF) {
    n = 2;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    n = 3;
    if (lead == 0xE0) low = 0xA0;   // overlong
    if (lead == 0xED) high = 0x9F;  // surrogates
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    n = 4;
    if (lead == 0xF0) low = 0x90;   // overlong
    if (lead == 0xF4) high = 0x8F;  // past U+10FFFF
  } else {
    return 0;
  }
  if (at(i + 1) < low || at(i + 1) > high) return 0;
  for (size_t k = 2; k < n; ++k) {
    if (at(i + k) < 0x80 || at(i + k) > 0xBF) return 0;
  }
  return n;
}

}  // namespace

void AppendJsonString(absl::string_view text, std::string* out) {
  static constexpr char kHex[] = "0123456789abcdef";
  out->push_back('"');
  size_t plain_start = 0;  // copy runs that need no escaping in one append
  for (size_t i = 0; i < text.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if (c >= 0x80) {
      // JSON is UTF-8: a byte that starts no well-formed sequence (an error message quoting a
      // client's bytes, say) becomes U+FFFD, as a decoder would show it, not invalid JSON.
      if (const size_t n = Utf8SequenceAt(text, i); n > 0) {
        i += n - 1;
        continue;
      }
      out->append(text.data() + plain_start, i - plain_start);
      plain_start = i + 1;
      out->append("\\ufffd");
      continue;
    }
    if (c >= 0x20 && c != '"' && c != '\\') continue;
    out->append(text.data() + plain_start, i - plain_start);
    plain_start = i + 1;
    switch (c) {
      case '"':
        out->append("\\\"");
        break;
      case '\\':
        out->append("\\\\");
        break;
      case '\n':
        out->append("\\n");
        break;
      case '\r':
        out->append("\\r");
        break;
      case '\t':
        out->append("\\t");
        break;
      default:
        out->append("\\u00");
        out->push_back(kHex[c >> 4]);
        out->push_back(kHex[c & 0xf]);
    }
  }
  out->append(text.data() + plain_start, text.size() - plain_start);
  out->push_back('"');
}

void AppendJsonDouble(double value, std::string* out) {
  if (std::isnan(value)) {
    out->append("\"NaN\"");
    return;
  }
  if (std::isinf(value)) {
    out->append(value > 0 ? "\"Infinity\"" : "\"-Infinity\"");
    return;
  }
  if (value == std::floor(value) && std::fabs(value) < 9.007199254740992e15) {
    absl::StrAppend(out, static_cast<int64_t>(value));
    return;
  }
  char buffer[40];
  for (int precision = 15; precision <= 17; ++precision) {
    std::snprintf(buffer, sizeof(buffer), "%.*g", precision, value);
    if (std::strtod(buffer, nullptr) == value) break;
  }
  out->append(buffer);
}

void AppendProtoJson(const google::protobuf::Message& message, const JsonWriteOptions& options, std::string* out) {
  Writer(options, out).WriteMessage(message, 0);
}

std::string ProtoToJson(const google::protobuf::Message& message, const JsonWriteOptions& options) {
  std::string out;
  AppendProtoJson(message, options, &out);
  return out;
}

absl::Status JsonToProto(absl::string_view json, google::protobuf::Message* message) {
  message->Clear();
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = false;
  auto status = google::protobuf::util::JsonStringToMessage(google::protobuf::StringPiece(json.data(), json.size()),
                                                            message, options);
  if (!status.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot parse ", message->GetDescriptor()->name(), " JSON: ", std::string(status.message())));
  }
  return absl::OkStatus();
}

}  // namespace bertshard::common
