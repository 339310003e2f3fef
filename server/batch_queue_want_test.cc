// BatchQueue with wants (what each request asks back): which requests merge, what the merged
// forward asks for, and what each request gets back of it.
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "server/batch_queue.h"

namespace bertshard::server {
namespace {

v1::TokenInputs Tokens(int64_t first_id, int64_t rows, int64_t seq) {
  v1::TokenInputs t;
  t.set_rows(rows);
  t.set_seq(seq);
  t.set_choices(1);
  for (int64_t i = 0; i < rows * seq; ++i) t.add_input_ids(first_id + i);
  return t;
}

v1::ForwardWant TopK(int top_k, bool all_outputs) {
  v1::ForwardWant want;
  want.set_all_outputs(all_outputs);
  want.mutable_masked_lm()->set_output("logits");
  want.mutable_masked_lm()->set_mask_token_id(4);
  want.mutable_masked_lm()->set_top_k(top_k);
  return want;
}

v1::ForwardWant Pooled(const std::string& pooling) {
  v1::ForwardWant want;
  want.mutable_embeddings()->set_pooling(pooling);
  return want;
}

// A forward that answers each row with its first input id: output "first" [rows, 1] and a row
// result with top_k ids (first id, +1, ...) when the want asks for the masked LM. The first
// forward waits for `release`, so that what comes meanwhile queues.
class Model {
 public:
  absl::StatusOr<BatchOutputs> Run(const v1::TokenInputs& merged, const v1::ForwardWant& want) {
    {
      absl::MutexLock lock(&mu_);
      wants_.push_back(want);
    }
    if (wants().size() == 1) release_.WaitForNotification();
    BatchOutputs out;
    v1::NamedTensor& first = out.outputs.emplace_back();
    first.set_name("first");
    first.add_shape(merged.rows());
    first.add_shape(1);
    for (int64_t r = 0; r < merged.rows(); ++r) {
      const int64_t id = merged.input_ids(static_cast<int>(r * merged.seq()));
      first.add_values(static_cast<float>(id));
      v1::ForwardRow& row = out.rows.emplace_back();
      if (!want.has_masked_lm()) continue;
      v1::MaskTop* top = row.add_masks();
      for (int j = 0; j < want.masked_lm().top_k(); ++j) {
        top->add_ids(id + j);
        top->add_scores(1.0 / (j + 1));
      }
    }
    out.response_bytes = 1000 * merged.rows();
    return out;
  }
  std::vector<v1::ForwardWant> wants() const {
    absl::MutexLock lock(&mu_);
    return wants_;
  }
  absl::Notification release_;

 private:
  mutable absl::Mutex mu_;
  std::vector<v1::ForwardWant> wants_;
};

class BatchQueueWantTest : public ::testing::Test {
 protected:
  BatchQueueWantTest()
      : queue_(
            BatchLimits{}, BatchPadding{},
            [this](const v1::TokenInputs& m, int, absl::Time, const v1::ForwardWant& want) {
              return model_.Run(m, want);
            },
            nullptr) {}

  // Submits a request that blocks the queue's thread in its forward, and waits until it does.
  void Block() {
    blocker_ = std::thread([this] { (void)queue_.Submit(Tokens(1, 1, 2), Far(), nullptr, 0, Pooled("cls")); });
    while (model_.wants().empty()) absl::SleepFor(absl::Milliseconds(2));
  }
  // Submits on threads of their own, waits until all are queued behind the blocker, lets it go,
  // and returns the results in submit order.
  std::vector<absl::StatusOr<BatchResult>> RunQueued(
      const std::vector<std::pair<v1::TokenInputs, v1::ForwardWant>>& in) {
    std::vector<absl::StatusOr<BatchResult>> results(in.size(), absl::UnknownError("not run"));
    std::vector<std::thread> threads;
    for (size_t i = 0; i < in.size(); ++i) {
      threads.emplace_back(
          [this, &in, &results, i] { results[i] = queue_.Submit(in[i].first, Far(), nullptr, 0, in[i].second); });
      // In order: the queue forms batches oldest first.
      while (queue_.queued() < static_cast<int>(i + 1)) absl::SleepFor(absl::Milliseconds(2));
    }
    model_.release_.Notify();
    for (auto& t : threads) t.join();
    blocker_.join();
    return results;
  }
  static absl::Time Far() { return absl::Now() + absl::Seconds(30); }

  Model model_;
  BatchQueue queue_;
  std::thread blocker_;
};

TEST_F(BatchQueueWantTest, CompatibleWantsMergeAndEachGetsWhatItAsked) {
  Block();
  auto results = RunQueued({{Tokens(100, 1, 2), TopK(2, false)}, {Tokens(200, 2, 3), TopK(4, true)}});
  const std::vector<v1::ForwardWant> wants = model_.wants();
  ASSERT_EQ(wants.size(), 2u);  // the blocker, then one merged forward
  EXPECT_EQ(wants[1].masked_lm().top_k(), 4);
  EXPECT_TRUE(wants[1].all_outputs());
  ASSERT_TRUE(results[0].ok()) << results[0].status();
  ASSERT_TRUE(results[1].ok()) << results[1].status();
  const BatchResult& b = *results[0];
  const BatchResult& c = *results[1];
  EXPECT_EQ(b.batch.requests, 2);
  EXPECT_EQ(b.response_bytes, 3000);
  EXPECT_EQ(c.response_bytes, 3000);
  EXPECT_TRUE(b.outputs.empty());  // it wanted no raw output
  ASSERT_EQ(b.rows.size(), 1u);
  ASSERT_EQ(b.rows[0].masks_size(), 1);
  EXPECT_EQ(std::vector<int64_t>(b.rows[0].masks(0).ids().begin(), b.rows[0].masks(0).ids().end()),
            (std::vector<int64_t>{100, 101}));
  EXPECT_EQ(b.rows[0].masks(0).scores_size(), 2);
  ASSERT_EQ(c.outputs.size(), 1u);
  EXPECT_EQ(std::vector<float>(c.outputs[0].values().begin(), c.outputs[0].values().end()),
            (std::vector<float>{200, 203}));
  ASSERT_EQ(c.rows.size(), 2u);
  EXPECT_EQ(c.rows[1].masks(0).ids_size(), 4);
  EXPECT_EQ(c.rows[1].masks(0).ids(0), 203);
}

TEST_F(BatchQueueWantTest, IncompatibleWantsRunApart) {
  Block();
  auto results = RunQueued({{Tokens(100, 1, 2), Pooled("mean")}, {Tokens(200, 1, 2), Pooled("max")}});
  const std::vector<v1::ForwardWant> wants = model_.wants();
  ASSERT_EQ(wants.size(), 3u);
  EXPECT_EQ(wants[1].embeddings().pooling(), "mean");
  EXPECT_EQ(wants[2].embeddings().pooling(), "max");
  for (const auto& r : results) {
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->batch.requests, 1);
    EXPECT_EQ(r->rows.size(), 1u);
  }
}

TEST_F(BatchQueueWantTest, NamedOutputsAreAskedTogetherAndCutApart) {
  v1::ForwardWant first, other;
  first.add_outputs("first");
  other.add_outputs("other");
  Block();
  auto results = RunQueued({{Tokens(100, 1, 2), first}, {Tokens(200, 1, 2), other}});
  const std::vector<v1::ForwardWant> wants = model_.wants();
  ASSERT_EQ(wants.size(), 2u);
  EXPECT_FALSE(wants[1].all_outputs());
  EXPECT_EQ(std::vector<std::string>(wants[1].outputs().begin(), wants[1].outputs().end()),
            (std::vector<std::string>{"first", "other"}));
  ASSERT_TRUE(results[0].ok());
  ASSERT_TRUE(results[1].ok());
  ASSERT_EQ(results[0]->outputs.size(), 1u);
  EXPECT_EQ(results[0]->outputs[0].values(0), 100.0f);
  EXPECT_TRUE(results[1]->outputs.empty());
}

TEST(CompatibleWants, SamePoolingMaskAndSpansButAnyTopKOrOutputs) {
  EXPECT_TRUE(CompatibleWants(EveryOutput(), v1::ForwardWant()));
  EXPECT_TRUE(CompatibleWants(TopK(2, false), TopK(9, true)));
  v1::ForwardWant other_mask = TopK(2, false);
  other_mask.mutable_masked_lm()->set_mask_token_id(5);
  EXPECT_FALSE(CompatibleWants(TopK(2, false), other_mask));
  EXPECT_FALSE(CompatibleWants(TopK(2, false), EveryOutput()));
  EXPECT_FALSE(CompatibleWants(Pooled("mean"), Pooled("cls")));
  v1::ForwardWant normalized = Pooled("mean");
  normalized.mutable_embeddings()->set_normalize(true);
  EXPECT_FALSE(CompatibleWants(Pooled("mean"), normalized));
  v1::ForwardWant spans, other_spans;
  spans.mutable_answer_spans()->add_special_ids(101);
  other_spans.mutable_answer_spans()->add_special_ids(102);
  EXPECT_FALSE(CompatibleWants(spans, other_spans));
  EXPECT_TRUE(CompatibleWants(spans, spans));
}

}  // namespace
}  // namespace bertshard::server
