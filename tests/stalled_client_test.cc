// Issue 21, item 6, with real processes: a client process (tests/flood_client) sends 64 full-size
// Infers (the largest batch --max_batch_tokens allows at the model's 16 positions, every output)
// and is then SIGSTOPped, so it reads no more. A second client's one-sentence Embed with a 10 s
// deadline must be answered within it. While the flooder is stopped its finished answers wait in
// the coordinator (the sync server keeps each call's thread and serialised response until the call
// ends); the coordinator's keepalive (--keepalive_time, --keepalive_timeout) must close the stopped
// client's connections, and after the flooder is SIGKILLed the coordinator's memory and threads
// must come back down. Figures are printed.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <string>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bertshard/v1/coordinator.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/cluster_fixture.h"
#include "tests/metrics_scrape.h"
#include "tests/proc_status.h"
#include "tests/serving_fixture.h"
#include "tests/test_process.h"

namespace bertshard::testing {
namespace {

// How far above idle the coordinator's RSS may stay. glibc keeps some freed memory in its
// per-thread arenas: +26.7 MiB stayed after the release in a loaded CI run (2026-12-07), against
// the +125 MiB the held answers took, so the slack is 40 MiB. Under ASan its quarantine holds
// freed memory (and the coordinator is an ASan build too): the memory bound does not apply there.
#if defined(__SANITIZE_ADDRESS__)
constexpr int64_t kRssSlack = int64_t{1} << 40;
#else
constexpr int64_t kRssSlack = 40 << 20;
#endif

// Polls `done` every 20 ms for up to `limit`; whether it came true.
bool WaitFor(const std::function<bool()>& done, absl::Duration limit) {
  const absl::Time end = absl::Now() + limit;
  while (absl::Now() < end) {
    if (done()) return true;
    usleep(20 * 1000);
  }
  return done();
}

class StalledClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // Keepalive of 2 s + 2 s here (the defaults are 30 s + 10 s): a stopped client's connection is
    // closed within the test's time.
    cluster_ = std::make_unique<LocalCluster>(
        "stalled",
        std::vector<std::string>{"--metrics_listen=127.0.0.1:0", "--keepalive_time=2s", "--keepalive_timeout=2s"});
    cluster_->max_receive_message_bytes_ = 64 << 20;
    ASSERT_EQ(cluster_->Start(1), "");
    // A BertModel 64 wide (answers of 4 MiB at 16,384 tokens), 2 layers, with the word vocabulary
    // of CheckpointWithWordVocabulary ("w5 w6" are ids 5 and 6).
    const std::string model = std::filesystem::absolute(TempDir() + "/stalled-model").string();
    const Cli init = Shardctl({"init-checkpoint", "--variant", "BertModel", "--seed", "7", "--out", model, "--config",
                               R"({"vocab_size": 99, "hidden_size": 64, "num_attention_heads": 4,
                                   "intermediate_size": 128, "num_hidden_layers": 2, "max_position_embeddings": 16})"});
    ASSERT_EQ(init.exit_code, 0) << init.all();
    std::ofstream vocab(model + "/vocab.txt");
    vocab << "[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\n";
    for (int i = 5; i < 99; ++i) vocab << "w" << i << "\n";
    vocab.close();
    std::string error;
    job_ = SubmitTp(*cluster_, model, 1, &error);
    ASSERT_EQ(error, "");
    ASSERT_EQ(cluster_->WaitReady(job_), "");
    const std::string log = ReadAll(cluster_->data_dir_ + ".log");
    const size_t at = log.find("metrics listening on port ");
    ASSERT_NE(at, std::string::npos) << log;
    metrics_port_ = std::atoi(log.c_str() + at + 26);
  }
  void TearDown() override {
    if (flooder_ > 0) {
      kill(flooder_, SIGKILL);
      WaitExit(flooder_);
    }
  }

  // Infer calls of the job queued or running in the coordinator; -1 if unreadable.
  int64_t QueueDepth() {
    const std::string metrics = ScrapeMetrics(metrics_port_);
    const std::string name = "bertshard_coordinator_infer_queue_depth{job=\"" + job_ + "\"} ";
    const size_t at = metrics.find(name);
    return at == std::string::npos ? -1 : std::atoll(metrics.c_str() + at + name.size());
  }

  // One sentence embedded with a 10 s deadline; its status, and how long it took in *took.
  grpc::Status EmbedOneSentence(absl::Duration* took) {
    v1::EmbedRequest embed;
    embed.set_job_id(job_);
    embed.mutable_text()->add_texts("w5 w6 w7 w8");
    v1::EmbedResponse response;
    const absl::Time start = absl::Now();
    const grpc::Status status = cluster_->stub().Embed(Context(std::chrono::seconds(10)).get(), embed, &response);
    *took = absl::Now() - start;
    if (status.ok()) {
      EXPECT_EQ(response.embeddings_size(), 1);
    }
    return status;
  }

  // Starts the flooder and waits for its first answer (its calls are all out by then).
  void StartFlood(const std::string& log) {
    flooder_ = Spawn({"tests/flood_client", "--server=127.0.0.1:" + std::to_string(cluster_->port_), "--job=" + job_,
                      "--requests=64", "--connections=3", "--rows=1024", "--seq=16"},
                     log);
    ASSERT_GT(flooder_, 0);
    ASSERT_TRUE(WaitFor([&] { return ReadAll(log).find("answered") != std::string::npos; }, absl::Seconds(120)))
        << ReadAll(log);
  }

  std::unique_ptr<LocalCluster> cluster_;
  std::string job_;
  int metrics_port_ = 0;
  pid_t flooder_ = -1;
};

TEST_F(StalledClientTest, AStoppedFlooderNeitherStarvesAnotherClientNorKeepsItsMemory) {
  const pid_t coordinator = cluster_->coordinator_;
  const int64_t rss_idle = StatusBytes(coordinator, "VmRSS");
  const int64_t threads_idle = StatusValue(coordinator, "Threads");
  const int fds_idle = OpenDescriptors(coordinator);
  const std::string log = TempDir() + "/flood_client.log";
  std::ofstream(log, std::ios::trunc).close();
  StartFlood(log);
  ASSERT_EQ(kill(flooder_, SIGSTOP), 0);

  // The other client: answered within its deadline while the flood is queued and its answers
  // wait for a reader that is gone.
  // Read before the Embed: with nothing of the flood left to wait behind, the Embed would show nothing.
  const int64_t depth_at_embed = QueueDepth();
  ASSERT_GT(depth_at_embed, 0) << "the flood was answered before the other client's Embed was sent";
  absl::Duration took;
  const grpc::Status embedded = EmbedOneSentence(&took);
  EXPECT_TRUE(embedded.ok()) << embedded.error_code() << ": " << embedded.error_message();

  // Every call the coordinator took from the flood is answered (or refused): what is left waits
  // in gRPC for the stopped reader.
  RssSampler sampler(coordinator);
  EXPECT_TRUE(WaitFor([&] { return QueueDepth() == 0; }, absl::Seconds(120))) << QueueDepth();
  const int64_t rss_held = StatusBytes(coordinator, "VmRSS");
  const int64_t threads_held = StatusValue(coordinator, "Threads");
  const int fds_held = OpenDescriptors(coordinator);
  absl::Duration took_held;
  const grpc::Status embedded_held = EmbedOneSentence(&took_held);
  EXPECT_TRUE(embedded_held.ok()) << embedded_held.error_code() << ": " << embedded_held.error_message();

  // The keepalive closes the stopped client's connections (their sockets leave the coordinator's
  // descriptors): the calls end, their threads and answers go, without the client being killed.
  const absl::Time stopped_at = absl::Now();
  auto back_to_idle = [&] {
    return OpenDescriptors(coordinator) <= fds_idle && StatusValue(coordinator, "Threads") <= threads_idle + 4 &&
           StatusBytes(coordinator, "VmRSS") <= rss_idle + kRssSlack;
  };
  // Within keepalive_time + keepalive_timeout and some slack for a loaded machine.
  const bool closed = WaitFor([&] { return OpenDescriptors(coordinator) <= fds_idle; }, absl::Seconds(10));
  const absl::Duration close_took = absl::Now() - stopped_at;
  const bool released = closed && WaitFor(back_to_idle, absl::Seconds(10));
  const absl::Duration release_took = absl::Now() - stopped_at;
  const int64_t rss_released = StatusBytes(coordinator, "VmRSS");
  const int64_t threads_released = StatusValue(coordinator, "Threads");
  const int fds_released = OpenDescriptors(coordinator);

  ASSERT_EQ(kill(flooder_, SIGKILL), 0);
  WaitExit(flooder_);
  flooder_ = -1;
  const bool freed = WaitFor(back_to_idle, absl::Seconds(20));
  const int64_t peak = sampler.Stop();
  const int64_t rss_after = StatusBytes(coordinator, "VmRSS");
  const int64_t threads_after = StatusValue(coordinator, "Threads");
  const int fds_after = OpenDescriptors(coordinator);
  std::printf(
      "coordinator idle: %.1f MiB, %lld threads, %d descriptors; flood queued or running at the Embed: %lld\n"
      "Embed while the flood ran: %s in %.3f s; once it was answered: %s in %.3f s\n"
      "stopped flooder, answers held: %.1f MiB, %lld threads, %d descriptors (peak %.1f MiB)\n"
      "connections %s after %.1f s; memory %s after %.1f s: %.1f MiB, %lld threads, %d descriptors\n"
      "after SIGKILL: %.1f MiB, %lld threads, %d descriptors\n",
      MiB(rss_idle), static_cast<long long>(threads_idle), fds_idle, static_cast<long long>(depth_at_embed),
      embedded.ok() ? "OK" : "failed", absl::ToDoubleSeconds(took), embedded_held.ok() ? "OK" : "failed",
      absl::ToDoubleSeconds(took_held), MiB(rss_held), static_cast<long long>(threads_held), fds_held, MiB(peak),
      closed ? "closed" : "NOT closed", absl::ToDoubleSeconds(close_took), released ? "released" : "NOT released",
      absl::ToDoubleSeconds(release_took), MiB(rss_released), static_cast<long long>(threads_released), fds_released,
      MiB(rss_after), static_cast<long long>(threads_after), fds_after);
  std::printf("flooder's log:\n%s\n", ReadAll(log).c_str());
  std::fflush(stdout);
  EXPECT_LT(took, absl::Seconds(10));
  EXPECT_TRUE(released) << "a stopped client's calls still held " << MiB(rss_released - rss_idle) << " MiB, "
                        << threads_released - threads_idle << " threads and " << fds_released - fds_idle
                        << " descriptors";
  EXPECT_TRUE(freed) << "after the flooder was killed the coordinator held " << MiB(rss_after - rss_idle) << " MiB and "
                     << threads_after - threads_idle << " threads more than idle";
  EXPECT_EQ(cluster_->TerminateCoordinator(), 0);
}

}  // namespace
}  // namespace bertshard::testing
