#include "common/grpc_auth.h"

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace bertshard::common {
namespace {

constexpr char kHeader[] = "authorization";
constexpr char kScheme[] = "Bearer ";

// Compares in time that depends only on the lengths, not on where the first difference is.
bool SameSecret(absl::string_view a, absl::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace

absl::StatusOr<std::string> LoadToken(const std::string& file, const char* env) {
  std::string token;
  std::string source;
  if (!file.empty()) {
    std::ifstream in(file, std::ios::binary);
    if (!in) return absl::InvalidArgumentError(absl::StrCat("token file ", file, " cannot be read"));
    std::ostringstream text;
    text << in.rdbuf();
    token = std::string(absl::StripAsciiWhitespace(text.str()));
    source = absl::StrCat("token file ", file);
    if (token.empty()) return absl::InvalidArgumentError(absl::StrCat(source, " is empty"));
  } else if (env != nullptr && std::getenv(env) != nullptr) {
    token = std::string(absl::StripAsciiWhitespace(std::getenv(env)));
    source = absl::StrCat("$", env);
  }
  for (const char c : token) {
    // Printable ASCII without spaces: what a header value carries unchanged.
    if (c <= ' ' || c > '~') {
      return absl::InvalidArgumentError(absl::StrCat(source,
                                                     " holds a character a token cannot have "
                                                     "(printable ASCII without spaces only)"));
    }
  }
  return token;
}

grpc::Status CheckAccess(const grpc::ServerContext& context, const AuthConfig& auth, Access needed) {
  // Each class of RPC is open while its token is unset (a read token needs an admin token: the
  // binaries refuse one without the other).
  if (needed == Access::kAdmin ? auth.admin_token.empty() : auth.read_token.empty()) return grpc::Status::OK;
  const auto& metadata = context.client_metadata();
  const auto header = metadata.find(kHeader);
  if (header == metadata.end()) {
    return {grpc::StatusCode::UNAUTHENTICATED,
            needed == Access::kAdmin ? "this RPC needs the cluster's bearer token (authorization: Bearer ...)"
                                     : "this RPC needs a bearer token (authorization: Bearer ...)"};
  }
  const absl::string_view value(header->second.data(), header->second.size());
  if (!absl::StartsWith(value, kScheme)) {
    return {grpc::StatusCode::UNAUTHENTICATED, "the authorization header is not a bearer token"};
  }
  const absl::string_view token = value.substr(sizeof(kScheme) - 1);
  if (!auth.admin_token.empty() && SameSecret(token, auth.admin_token)) return grpc::Status::OK;
  if (!auth.read_token.empty() && SameSecret(token, auth.read_token)) {
    if (needed == Access::kRead) return grpc::Status::OK;
    return {grpc::StatusCode::PERMISSION_DENIED, "the read-only token may not call an RPC that changes state"};
  }
  return {grpc::StatusCode::UNAUTHENTICATED, "the bearer token is not valid"};
}

void AttachToken(grpc::ClientContext* context, const std::string& token) {
  if (!token.empty()) context->AddMetadata(kHeader, absl::StrCat(kScheme, token));
}

}  // namespace bertshard::common
