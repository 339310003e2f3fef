// File: client/version.h
// -----------------------------------------------------------------------------
// shardctl's version, the one place it is written: `shardctl --version` prints
// "shardctl " + kShardctlVersion. Raise it with each release of the CLI.
//
// Thread safety: a constant.
#ifndef BERTSHARD_CLIENT_VERSION_H_
#define BERTSHARD_CLIENT_VERSION_H_

namespace bertshard::client {

inline constexpr char kShardctlVersion[] = "0.1.0";

}  // namespace bertshard::client

#endif  // BERTSHARD_CLIENT_VERSION_H_
