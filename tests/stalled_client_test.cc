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
#include "tests/proc_status.h"
#include "tests/serving_fixture.h"
#include "tests/test_process.h"

namespace bertshard::testing {
namespace {

// The body of `GET /metrics` on 127.0.0.1:`port`; "" if it cannot be read.
std::string ScrapeMetrics(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return "";
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string response;
  if (connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof address) == 0) {
    const std::string request = "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
    if (write(fd, request.data(), request.size()) == static_cast<ssize_t>(request.size())) {
      char buffer[4096];
      for (ssize_t n; (n = read(fd, buffer, sizeof buffer)) > 0;) response.append(buffer, static_cast<size_t>(n));
    }
  }
  close(fd);
  const size_t body = response.find("\r\n\r\n");
  return body == std::string::npos ? "" : response.substr(body + 4);
}

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
    const std::string model = CheckpointWithWordVocabulary("tests/testdata/model/bert_model", "stalled-model");
    std::string error;
    job_ = SubmitTp(*cluster_, std::filesystem::absolute(model).string(), 1, &error);
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
    if (status.ok()) EXPECT_EQ(response.embeddings_size(), 1);
    return status;
  }

  // Starts the flooder and waits for its first answer (its calls are all out by then).
  void StartFlood(const std::string& log) {
    flooder_ = Spawn({"tests/flood_client", "--server=127.0.0.1:" + std::to_string(cluster_->port_), "--job=" + job_,
                      "--requests=64", "--connections=2", "--rows=1024", "--seq=16"},
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
  const std::string log = TempDir() + "/flood_client.log";
  std::ofstream(log, std::ios::trunc).close();
  StartFlood(log);
  ASSERT_EQ(kill(flooder_, SIGSTOP), 0);

  // The other client: answered within its deadline while the flood is queued and its answers
  // wait for a reader that is gone.
  absl::Duration took;
  const grpc::Status embedded = EmbedOneSentence(&took);
  EXPECT_TRUE(embedded.ok()) << embedded.error_code() << ": " << embedded.error_message();
  const int64_t depth_at_embed = QueueDepth();

  // Every call the coordinator took from the flood is answered (or refused): what is left waits
  // in gRPC for the stopped reader.
  RssSampler sampler(coordinator);
  EXPECT_TRUE(WaitFor([&] { return QueueDepth() == 0; }, absl::Seconds(120))) << QueueDepth();
  const int64_t rss_held = StatusBytes(coordinator, "VmRSS");
  const int64_t threads_held = StatusValue(coordinator, "Threads");
  absl::Duration took_held;
  const grpc::Status embedded_held = EmbedOneSentence(&took_held);
  EXPECT_TRUE(embedded_held.ok()) << embedded_held.error_code() << ": " << embedded_held.error_message();

  // The keepalive closes the stopped client's connections: the calls end, their threads and
  // answers go, without the client being killed.
  const absl::Time stopped_at = absl::Now();
  const bool released = WaitFor(
      [&] {
        return StatusValue(coordinator, "Threads") <= threads_idle + 4 &&
               StatusBytes(coordinator, "VmRSS") <= rss_idle + (32 << 20);
      },
      absl::Seconds(30));
  const absl::Duration release_took = absl::Now() - stopped_at;
  const int64_t rss_released = StatusBytes(coordinator, "VmRSS");
  const int64_t threads_released = StatusValue(coordinator, "Threads");

  ASSERT_EQ(kill(flooder_, SIGKILL), 0);
  WaitExit(flooder_);
  flooder_ = -1;
  const bool freed = WaitFor(
      [&] {
        return StatusValue(coordinator, "Threads") <= threads_idle + 4 &&
               StatusBytes(coordinator, "VmRSS") <= rss_idle + (32 << 20);
      },
      absl::Seconds(20));
  const int64_t peak = sampler.Stop();
  const int64_t rss_after = StatusBytes(coordinator, "VmRSS");
  const int64_t threads_after = StatusValue(coordinator, "Threads");
  std::printf(
      "coordinator idle: %.1f MiB, %lld threads; flood queued or running at the Embed: %lld\n"
      "Embed while the flood ran: %s in %.3f s; once it was answered: %s in %.3f s\n"
      "stopped flooder, answers held: %.1f MiB, %lld threads (peak %.1f MiB)\n"
      "keepalive: %s after %.1f s: %.1f MiB, %lld threads\n"
      "after SIGKILL: %.1f MiB, %lld threads\n",
      MiB(rss_idle), static_cast<long long>(threads_idle), static_cast<long long>(depth_at_embed),
      embedded.ok() ? "OK" : "failed", absl::ToDoubleSeconds(took), embedded_held.ok() ? "OK" : "failed",
      absl::ToDoubleSeconds(took_held), MiB(rss_held), static_cast<long long>(threads_held), MiB(peak),
      released ? "released" : "NOT released", absl::ToDoubleSeconds(release_took), MiB(rss_released),
      static_cast<long long>(threads_released), MiB(rss_after), static_cast<long long>(threads_after));
  std::printf("flooder's log:\n%s\n", ReadAll(log).c_str());
  std::fflush(stdout);
  EXPECT_LT(took, absl::Seconds(10));
  EXPECT_TRUE(released) << "a stopped client's calls still held " << MiB(rss_released - rss_idle) << " MiB and "
                        << threads_released - threads_idle << " threads";
  EXPECT_TRUE(freed) << "after the flooder was killed the coordinator held " << MiB(rss_after - rss_idle) << " MiB and "
                     << threads_after - threads_idle << " threads more than idle";
  EXPECT_EQ(cluster_->TerminateCoordinator(), 0);
}

}  // namespace
}  // namespace bertshard::testing
