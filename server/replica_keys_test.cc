#include "server/replica_keys.h"

#include "gtest/gtest.h"

namespace bertshard::server {
namespace {

TEST(ReplicaKeysTest, ReplicaZeroIsTheJobIdItself) {
  // What workers held before replicas existed: their shards keep their key across an upgrade.
  EXPECT_EQ(ReplicaKey("job-17-3", 0), "job-17-3");
  const ReplicaOf of = ParseReplicaKey("job-17-3");
  EXPECT_EQ(of.job_id, "job-17-3");
  EXPECT_EQ(of.replica, 0);
}

TEST(ReplicaKeysTest, OtherReplicasRoundTrip) {
  for (int32_t replica : {1, 2, 9, 10, 63, 1000}) {
    const std::string key = ReplicaKey("job-17-3", replica);
    EXPECT_NE(key, "job-17-3");
    const ReplicaOf of = ParseReplicaKey(key);
    EXPECT_EQ(of.job_id, "job-17-3") << key;
    EXPECT_EQ(of.replica, replica) << key;
  }
  EXPECT_EQ(ReplicaKey("job-1", 2), "job-1/replica-2");
}

TEST(ReplicaKeysTest, WhatReplicaKeyNeverWritesIsAJobIdAsItIs) {
  for (const char* key : {"job-1/replica-", "job-1/replica-0", "job-1/replica-01", "job-1/replica--1",
                          "job-1/replica-+1", "job-1/replica-1x", "job-1/replica-99999999999"}) {
    const ReplicaOf of = ParseReplicaKey(key);
    EXPECT_EQ(of.job_id, key);
    EXPECT_EQ(of.replica, 0) << key;
  }
}

}  // namespace
}  // namespace bertshard::server
