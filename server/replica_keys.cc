#include "server/replica_keys.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace bertshard::server {

namespace {
constexpr absl::string_view kSeparator = "/replica-";
}  // namespace

std::string ReplicaKey(absl::string_view job_id, int32_t replica) {
  if (replica <= 0) return std::string(job_id);
  return absl::StrCat(job_id, kSeparator, replica);
}

ReplicaOf ParseReplicaKey(absl::string_view key) {
  const size_t at = key.rfind(kSeparator);
  if (at == absl::string_view::npos) return {std::string(key), 0};
  const absl::string_view digits = key.substr(at + kSeparator.size());
  int32_t replica = 0;
  // Only what ReplicaKey writes: 1, 2, ... without sign, zeros in front or anything after.
  if (digits.empty() || digits[0] == '0' || !absl::SimpleAtoi(digits, &replica) || replica < 1 ||
      absl::StrCat(replica) != digits) {
    return {std::string(key), 0};
  }
  return {std::string(key.substr(0, at)), replica};
}

}  // namespace bertshard::server
