#include "worker/auth_store_wire.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace bertshard::worker::wire {
namespace {

// Waits until `fd` is ready for `events`, or the deadline passes.
absl::Status WaitReady(int fd, short events, Clock::time_point deadline) {
  while (true) {
    int timeout_ms = -1;
    if (deadline != Clock::time_point::max()) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0) return absl::DeadlineExceededError("rendezvous connection: timed out");
      timeout_ms = static_cast<int>(std::min<int64_t>(left, 60'000));
    }
    pollfd p{fd, events, 0};
    const int ready = poll(&p, 1, timeout_ms);
    if (ready > 0) return absl::OkStatus();  // errors and hang-ups show in the read or write that follows
    if (ready < 0 && errno != EINTR) {
      return absl::UnavailableError(absl::StrCat("rendezvous connection: poll: ", std::strerror(errno)));
    }
  }
}

void PutU32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void PutU64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
uint64_t GetLE(absl::string_view bytes, size_t at, int n) {
  uint64_t v = 0;
  for (int i = 0; i < n; ++i) v |= static_cast<uint64_t>(static_cast<uint8_t>(bytes[at + i])) << (8 * i);
  return v;
}

}  // namespace

std::string HandshakeMac(absl::string_view secret, absl::string_view side, absl::string_view server_nonce,
                         absl::string_view client_nonce) {
  // The side is part of the message: a server's proof cannot be replayed as a client's, or back.
  const std::string message =
      absl::StrCat("bertshard-rendezvous-v1 ", side, std::string(1, '\0'), server_nonce, client_nonce);
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int mac_length = 0;
  HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()),
       reinterpret_cast<const unsigned char*>(message.data()), message.size(), mac, &mac_length);
  return std::string(reinterpret_cast<const char*>(mac), mac_length);
}

bool SameSecretBytes(absl::string_view a, absl::string_view b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

absl::Status WriteAll(int fd, absl::string_view bytes, Clock::time_point deadline) {
  size_t sent = 0;
  while (sent < bytes.size()) {
    const ssize_t n = send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      sent += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (absl::Status s = WaitReady(fd, POLLOUT, deadline); !s.ok()) return s;
      continue;
    }
    return absl::UnavailableError(absl::StrCat("rendezvous connection: send: ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadExactly(int fd, size_t n, Clock::time_point deadline) {
  std::string bytes(n, '\0');
  size_t got = 0;
  while (got < n) {
    const ssize_t r = recv(fd, bytes.data() + got, n - got, MSG_DONTWAIT);
    if (r > 0) {
      got += static_cast<size_t>(r);
      continue;
    }
    if (r == 0) return absl::UnavailableError("rendezvous connection closed by the other side");
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if (absl::Status s = WaitReady(fd, POLLIN, deadline); !s.ok()) return s;
      continue;
    }
    return absl::UnavailableError(absl::StrCat("rendezvous connection: recv: ", std::strerror(errno)));
  }
  return bytes;
}

std::string EncodeFrame(const Frame& frame) {
  std::string body;
  body.push_back(static_cast<char>(frame.code));
  PutU64(body, static_cast<uint64_t>(frame.number));
  PutU32(body, static_cast<uint32_t>(frame.fields.size()));
  for (const std::string& f : frame.fields) {
    PutU32(body, static_cast<uint32_t>(f.size()));
    body += f;
  }
  std::string out;
  out.reserve(4 + body.size());
  PutU32(out, static_cast<uint32_t>(body.size()));
  return out + body;
}

absl::Status WriteFrame(int fd, const Frame& frame, Clock::time_point deadline) {
  return WriteAll(fd, EncodeFrame(frame), deadline);
}

namespace {

// A frame whose first byte is in (or due before `deadline`), read whole before `deadline`.
absl::StatusOr<Frame> ReadStartedFrame(int fd, size_t max_body_bytes, Clock::time_point deadline);

}  // namespace

absl::StatusOr<Frame> ReadFrame(int fd, size_t max_body_bytes, Clock::time_point first_byte_deadline,
                                Clock::time_point deadline) {
  if (absl::Status s = WaitReady(fd, POLLIN, first_byte_deadline); !s.ok()) return s;
  return ReadStartedFrame(fd, max_body_bytes, deadline);
}

absl::StatusOr<Frame> ReadFrame(int fd, size_t max_body_bytes, Clock::time_point first_byte_deadline,
                                Clock::duration rest) {
  if (absl::Status s = WaitReady(fd, POLLIN, first_byte_deadline); !s.ok()) return s;
  return ReadStartedFrame(fd, max_body_bytes, Clock::now() + rest);
}

namespace {

absl::StatusOr<Frame> ReadStartedFrame(int fd, size_t max_body_bytes, Clock::time_point deadline) {
  absl::StatusOr<std::string> length = ReadExactly(fd, 4, deadline);
  if (!length.ok()) return length.status();
  const uint64_t body_bytes = GetLE(*length, 0, 4);
  // Refused before a byte of the body is read or allocated: the length is the sender's word only.
  if (body_bytes > max_body_bytes || body_bytes < 13) {
    return absl::InvalidArgumentError(
        absl::StrCat("rendezvous frame of ", body_bytes, " bytes (at most ", max_body_bytes, ")"));
  }
  absl::StatusOr<std::string> body = ReadExactly(fd, body_bytes, deadline);
  if (!body.ok()) return body.status();
  Frame frame;
  frame.code = static_cast<uint8_t>((*body)[0]);
  frame.number = static_cast<int64_t>(GetLE(*body, 1, 8));
  const uint64_t count = GetLE(*body, 9, 4);
  size_t at = 13;
  // Each field takes at least its 4 length bytes: the count cannot exceed what the body holds.
  if (count > (body->size() - at) / 4) return absl::InvalidArgumentError("malformed rendezvous frame (field count)");
  frame.fields.reserve(count);
  for (uint64_t i = 0; i < count; ++i) {
    if (body->size() - at < 4) return absl::InvalidArgumentError("malformed rendezvous frame (field length)");
    const uint64_t n = GetLE(*body, at, 4);
    at += 4;
    if (n > body->size() - at) return absl::InvalidArgumentError("malformed rendezvous frame (field past the end)");
    frame.fields.emplace_back(body->substr(at, n));
    at += n;
  }
  if (at != body->size()) return absl::InvalidArgumentError("malformed rendezvous frame (trailing bytes)");
  return frame;
}

}  // namespace

absl::StatusOr<AddressList> ResolveTcp(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (const int rc = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found); rc != 0) {
    return absl::UnavailableError(gai_strerror(rc));
  }
  return AddressList(found, &freeaddrinfo);
}

Reply ReplyFor(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kOk:
      return kOk;
    case absl::StatusCode::kDeadlineExceeded:
      return kTimedOut;
    case absl::StatusCode::kResourceExhausted:
      return kTooLarge;
    case absl::StatusCode::kUnavailable:
      return kShuttingDown;
    default:
      return kBadRequest;
  }
}

absl::StatusCode CodeFor(uint8_t reply) {
  switch (reply) {
    case kOk:
      return absl::StatusCode::kOk;
    case kTimedOut:
      return absl::StatusCode::kDeadlineExceeded;
    case kTooLarge:
      return absl::StatusCode::kResourceExhausted;
    case kShuttingDown:
      return absl::StatusCode::kUnavailable;
    default:
      return absl::StatusCode::kInvalidArgument;
  }
}

}  // namespace bertshard::worker::wire
