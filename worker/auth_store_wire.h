// File: worker/auth_store_wire.h
// -----------------------------------------------------------------------------
// The bytes the rendezvous store (worker/auth_store.h) speaks over TCP, shared by its server and
// client; nothing else should need it (tests do, to speak out of turn).
//
// Handshake (before any key is read or written), both sides proving they know the job's secret:
//   server -> client  "BSRDV1S\n" nonce_s[32]
//   client -> server  "BSRDV1C\n" nonce_c[32] HMAC-SHA256(secret, "bertshard-rendezvous-v1 client" 0 nonce_s nonce_c)
//   server -> client  kAccepted HMAC-SHA256(secret, "bertshard-rendezvous-v1 server" 0 nonce_s nonce_c)
//                     or kRefused / kBusy, then it closes
// Then requests and answers, one at a time, each a frame:
//   u32 body length (little-endian), body: u8 code, i64 number, u32 field count, fields (u32 length, bytes)
// A request's code is an Op, its number a timeout in ms (get, wait) or the addend (add); an answer's
// code is a Reply, with the error's message as its only field when it is not kOk.
//
// The traffic is authenticated at the start, not encrypted or protected afterwards: whoever can
// rewrite packets on the path can still change it (as with Gloo's own traffic).
//
// Example:
//   Frame request{.code = kGet, .number = 5000, .fields = {"world/0"}};
//   RETURN_IF_ERROR(WriteFrame(fd, request, deadline));
//   ASSIGN_OR_RETURN(Frame answer, ReadFrame(fd, max_frame_bytes, deadline));
//
// Failure model: socket helpers return UNAVAILABLE on a closed or failed socket and
// DEADLINE_EXCEEDED when the deadline passes first; ReadFrame is INVALID_ARGUMENT for a frame over
// its bound or malformed, and reads no more of it.
//
// Thread safety: free functions; one reader and one writer per socket at a time.
#ifndef BERTSHARD_WORKER_AUTH_STORE_WIRE_H_
#define BERTSHARD_WORKER_AUTH_STORE_WIRE_H_

#include <netdb.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace bertshard::worker::wire {

using Clock = std::chrono::steady_clock;

inline constexpr absl::string_view kServerMagic = "BSRDV1S\n";
inline constexpr absl::string_view kClientMagic = "BSRDV1C\n";
inline constexpr size_t kNonceBytes = 32;
inline constexpr size_t kMacBytes = 32;  // HMAC-SHA256
inline constexpr size_t kServerHelloBytes = 8 + kNonceBytes;
inline constexpr size_t kClientHelloBytes = 8 + kNonceBytes + kMacBytes;

// The server's verdict on a client's hello (one byte).
enum Verdict : uint8_t { kAccepted = 0, kRefused = 1, kBusy = 2 };

enum Op : uint8_t {
  kSet = 1,         // key, value
  kGet = 2,         // key; number: timeout ms. Waits for the key.
  kAdd = 3,         // key; number: addend. Answer's number: the new value.
  kCompareSet = 4,  // key, expected, desired. Answer's field: the value now.
  kDelete = 5,      // key. Answer's number: 1 if it was there.
  kCheck = 6,       // keys. Answer's number: 1 if all are there.
  kNumKeys = 7,     // Answer's number.
  kWait = 8,        // keys; number: timeout ms.
};

enum Reply : uint8_t {
  kOk = 0,
  kTimedOut = 1,      // DEADLINE_EXCEEDED
  kTooLarge = 2,      // RESOURCE_EXHAUSTED: a limit (key, value, keys, bytes)
  kBadRequest = 3,    // INVALID_ARGUMENT
  kShuttingDown = 4,  // UNAVAILABLE
};

struct Frame {
  uint8_t code = 0;
  int64_t number = 0;
  std::vector<std::string> fields;
};

// The bytes a client proves itself with (side "client") or the server (side "server").
std::string HandshakeMac(absl::string_view secret, absl::string_view side, absl::string_view server_nonce,
                         absl::string_view client_nonce);
// Equal in constant time (for equal sizes).
bool SameSecretBytes(absl::string_view a, absl::string_view b);

// Writes all of `bytes`, or reads exactly `n` bytes, before `deadline`.
absl::Status WriteAll(int fd, absl::string_view bytes, Clock::time_point deadline);
absl::StatusOr<std::string> ReadExactly(int fd, size_t n, Clock::time_point deadline);

std::string EncodeFrame(const Frame& frame);
absl::Status WriteFrame(int fd, const Frame& frame, Clock::time_point deadline);
// One frame whose body is at most `max_body_bytes`. `first_byte_deadline` bounds the wait for the
// frame to start (an idle connection may wait long), `deadline` the rest once it has.
absl::StatusOr<Frame> ReadFrame(int fd, size_t max_body_bytes, Clock::time_point first_byte_deadline,
                                Clock::time_point deadline);
// The same, the rest bounded by `rest` from when the frame starts (a server's idle connection: a
// deadline taken before the idle wait would have passed by the time a late request comes).
absl::StatusOr<Frame> ReadFrame(int fd, size_t max_body_bytes, Clock::time_point first_byte_deadline,
                                Clock::duration rest);

// The TCP addresses of host:port (numeric port), freed with the list; UNAVAILABLE naming
// getaddrinfo's reason when there are none. The server listens on the first, a client tries each.
using AddressList = std::unique_ptr<addrinfo, decltype(&freeaddrinfo)>;
absl::StatusOr<AddressList> ResolveTcp(const std::string& host, int port);

// Reply <-> absl::StatusCode.
Reply ReplyFor(absl::StatusCode code);
absl::StatusCode CodeFor(uint8_t reply);

}  // namespace bertshard::worker::wire

#endif  // BERTSHARD_WORKER_AUTH_STORE_WIRE_H_
