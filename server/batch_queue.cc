#include "server/batch_queue.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <set>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace bertshard::server {

namespace {

// How often a waiting Submit asks its caller whether it went away.
constexpr absl::Duration kCancelPoll = absl::Milliseconds(20);

}  // namespace

struct BatchQueue::Request {
  // Set before the request is queued, read-only afterwards.
  v1::TokenInputs tokens;
  int64_t rows = 0;
  int64_t seq = 0;
  int64_t choices = 1;    // >= 1
  int micro_batches = 1;  // >= 1
  bool alone = false;     // micro-batched: never merged
  v1::ForwardWant want;
  absl::Time deadline;
  Caller caller;            // whose request it is (turns and shares)
  int64_t token_count = 0;  // rows x seq
  // Called only with mu_ held and only while the caller still waits in Submit (!caller_gone), so
  // whatever it captures from the caller is still alive.
  std::function<bool()> cancelled;
  absl::Time enqueued;
  int64_t id = 0;  // arrival order

  // Guarded by the queue's mu_.
  bool running = false;      // taken off the queue into a batch
  bool done = false;         // `result` is final
  bool caller_gone = false;  // Submit returned without `result` (deadline, cancelled)
  absl::StatusOr<BatchResult> result = absl::UnknownError("not run");
};

namespace {

// One request's rows in a batch.
struct Slice {
  const v1::TokenInputs* tokens;
  int64_t rows;
  int64_t seq;
  int64_t choices;
};

// Pads every request's rows to `seq` and stacks them in batch order.
v1::TokenInputs Merge(const std::vector<Slice>& batch, int64_t rows, int64_t seq, int64_t pad_token_id) {
  v1::TokenInputs merged;
  merged.set_rows(rows);
  merged.set_seq(seq);
  merged.set_choices(batch.front().choices);
  const int n = static_cast<int>(rows * seq);
  merged.mutable_input_ids()->Reserve(n);
  merged.mutable_attention_mask()->Reserve(n);
  merged.mutable_token_type_ids()->Reserve(n);
  for (const Slice& r : batch) {
    const v1::TokenInputs& t = *r.tokens;
    const bool has_mask = t.attention_mask_size() > 0;
    const bool has_types = t.token_type_ids_size() > 0;
    for (int64_t row = 0; row < r.rows; ++row) {
      for (int64_t p = 0; p < seq; ++p) {
        if (p < r.seq) {
          const int i = static_cast<int>(row * r.seq + p);
          merged.add_input_ids(t.input_ids(i));
          merged.add_attention_mask(has_mask ? t.attention_mask(i) : 1);
          merged.add_token_type_ids(has_types ? t.token_type_ids(i) : 0);
        } else {
          merged.add_input_ids(pad_token_id);
          merged.add_attention_mask(0);
          merged.add_token_type_ids(0);
        }
      }
    }
  }
  return merged;
}

// Hands each request its rows of the per-row results. INTERNAL when they are not one per row.
absl::Status SplitRows(std::vector<v1::ForwardRow> merged, const std::vector<Slice>& batch, int64_t rows,
                       std::vector<std::vector<v1::ForwardRow>>* parts) {
  parts->assign(batch.size(), {});
  if (merged.empty()) return absl::OkStatus();
  if (static_cast<int64_t>(merged.size()) != rows) {
    return absl::InternalError(absl::StrCat("the forward returned results for ", merged.size(), " rows of ", rows));
  }
  size_t row = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    for (int64_t k = 0; k < batch[i].rows; ++k) (*parts)[i].push_back(std::move(merged[row++]));
  }
  return absl::OkStatus();
}

// Cuts each request's rows (and, for per-token outputs, its own seq) out of the merged outputs.
// INTERNAL for an output whose shape does not fit the batch: no caller gets a wrong slice.
absl::Status Split(const std::vector<v1::NamedTensor>& outputs, const std::vector<Slice>& batch, int64_t rows,
                   int64_t seq, const PerTokenFn& per_token, std::vector<std::vector<v1::NamedTensor>>* parts) {
  const int64_t choices = batch.front().choices;
  parts->assign(batch.size(), {});
  for (const v1::NamedTensor& t : outputs) {
    if (t.shape_size() == 0) return absl::InternalError(absl::StrCat("output ", t.name(), " has no batch axis"));
    int64_t numel = 1;
    for (int64_t d : t.shape()) numel *= d;
    if (numel != t.values_size()) {
      return absl::InternalError(
          absl::StrCat("output ", t.name(), " has ", t.values_size(), " values for ", numel, " elements of its shape"));
    }
    // Input rows per output row: 1, or `choices` for outputs per question (multiple-choice logits).
    int64_t group = 0;
    if (t.shape(0) == rows) {
      group = 1;
    } else if (choices > 1 && t.shape(0) * choices == rows) {
      group = choices;
    } else {
      return absl::InternalError(absl::StrCat("output ", t.name(), " has dim 0 = ", t.shape(0), " for a batch of ",
                                              rows, " rows (", choices, " choices)"));
    }
    const bool token_axis = per_token && per_token(t.name());
    if (token_axis && (t.shape_size() < 2 || t.shape(1) != seq)) {
      return absl::InternalError(absl::StrCat("per-token output ", t.name(), " has no dim 1 = padded seq ", seq));
    }
    const int64_t per_row = numel / t.shape(0);
    const int64_t per_position = token_axis ? per_row / seq : 0;
    int64_t row = 0;  // output rows handed out so far
    for (size_t i = 0; i < batch.size(); ++i) {
      const Slice& r = batch[i];
      const int64_t own_rows = r.rows / group;
      const int64_t kept = token_axis ? r.seq * per_position : per_row;
      v1::NamedTensor& part = (*parts)[i].emplace_back();
      part.set_name(t.name());
      *part.mutable_shape() = t.shape();
      part.set_shape(0, own_rows);
      if (token_axis) part.set_shape(1, r.seq);
      part.mutable_values()->Reserve(static_cast<int>(own_rows * kept));
      for (int64_t k = 0; k < own_rows; ++k, ++row) {
        const float* from = t.values().data() + row * per_row;
        part.mutable_values()->Add(from, from + kept);
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

v1::ForwardWant EveryOutput() {
  v1::ForwardWant want;
  want.set_all_outputs(true);
  return want;
}

bool CompatibleWants(const v1::ForwardWant& a, const v1::ForwardWant& b) {
  if (a.has_embeddings() != b.has_embeddings() || a.has_masked_lm() != b.has_masked_lm() ||
      a.has_answer_spans() != b.has_answer_spans() || a.has_sparse() != b.has_sparse()) {
    return false;
  }
  if (a.embeddings().pooling() != b.embeddings().pooling() ||
      a.embeddings().normalize() != b.embeddings().normalize()) {
    return false;
  }
  const v1::MaskedLmWant& ma = a.masked_lm();
  const v1::MaskedLmWant& mb = b.masked_lm();
  if (ma.output() != mb.output() || ma.mask_token_id() != mb.mask_token_id() || ma.vocab_limit() != mb.vocab_limit()) {
    return false;
  }
  const v1::AnswerSpanWant& sa = a.answer_spans();
  const v1::AnswerSpanWant& sb = b.answer_spans();
  return sa.cls_token_id() == sb.cls_token_id() &&
         std::equal(sa.special_ids().begin(), sa.special_ids().end(), sb.special_ids().begin(), sb.special_ids().end());
}

v1::ForwardWant UnionOfWants(const std::vector<const v1::ForwardWant*>& wants) {
  v1::ForwardWant merged = *wants.front();
  std::set<std::string> outputs;
  for (const v1::ForwardWant* w : wants) {
    merged.set_all_outputs(merged.all_outputs() || w->all_outputs());
    outputs.insert(w->outputs().begin(), w->outputs().end());
    if (w->has_masked_lm()) {
      merged.mutable_masked_lm()->set_top_k(std::max(merged.masked_lm().top_k(), w->masked_lm().top_k()));
    }
  }
  merged.clear_outputs();
  if (!merged.all_outputs()) {
    for (const std::string& name : outputs) merged.add_outputs(name);
  }
  return merged;
}

void CutToWant(const v1::ForwardWant& want, BatchResult* result) {
  if (!want.all_outputs()) {
    const std::set<std::string> wanted(want.outputs().begin(), want.outputs().end());
    auto& outputs = result->outputs;
    outputs.erase(std::remove_if(outputs.begin(), outputs.end(),
                                 [&wanted](const v1::NamedTensor& t) { return wanted.count(t.name()) == 0; }),
                  outputs.end());
  }
  if (!want.has_masked_lm()) return;
  const int top_k = std::max(1, want.masked_lm().top_k());
  for (v1::ForwardRow& row : result->rows) {
    for (v1::MaskTop& fill : *row.mutable_masks()) {
      if (fill.ids_size() > top_k) fill.mutable_ids()->Truncate(top_k);
      if (fill.scores_size() > top_k) fill.mutable_scores()->Truncate(top_k);
    }
  }
}

BatchQueue::BatchQueue(BatchLimits limits, BatchPadding padding, RunBatchFn run, PerTokenFn per_token,
                       BatchObserver observer)
    : limits_([&limits] {
        limits.max_batch_tokens = std::max<int64_t>(1, limits.max_batch_tokens);
        limits.max_batch_requests = std::max(1, limits.max_batch_requests);
        limits.max_batch_delay = std::max(absl::ZeroDuration(), limits.max_batch_delay);
        limits.regroup_delay = std::max(absl::ZeroDuration(), limits.regroup_delay);
        if (limits.max_client_queued_tokens <= 0) limits.max_client_queued_tokens = 4 * limits.max_batch_tokens;
        limits.max_client_queued_tokens = std::max(limits.max_client_queued_tokens, limits.max_batch_tokens);
        return limits;
      }()),
      connection_share_(limits_.max_client_queued_tokens),
      client_share_(4 * limits_.max_client_queued_tokens),
      padding_(padding),
      run_(std::move(run)),
      per_token_(std::move(per_token)),
      observer_(std::move(observer)) {
  absl::MutexLock lock(&mu_);
  lanes_.emplace_back([this] { Loop(); });
}

BatchQueue::~BatchQueue() {
  Close("job is going away");
  std::vector<std::thread> lanes;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;  // and SetConcurrency starts no more
    lanes.swap(lanes_);
  }
  // Each ends once its batch, if any, is done.
  for (std::thread& lane : lanes) lane.join();
  // Every request is done now; wait for their Submit calls to see it before mu_ goes away.
  absl::MutexLock lock(&mu_);
  auto returned = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return submits_ == 0; };
  mu_.Await(absl::Condition(&returned));
}

void BatchQueue::Close(const std::string& reason) {
  absl::MutexLock lock(&mu_);
  if (closed_) return;
  closed_ = true;
  close_reason_ = reason;
  for (const std::shared_ptr<Request>& r : waiting_) {
    r->result = absl::UnavailableError(reason);
    r->done = true;
  }
  waiting_.clear();
  clients_.clear();
}

void BatchQueue::SetConcurrency(int n) {
  n = std::max(1, n);
  absl::MutexLock lock(&mu_);
  if (stopping_) return;
  // A free lane's thread waiting for work sees the change (mu_'s conditions are looked at again
  // when it is released); a lower n takes effect at the next dispatch.
  concurrency_ = n;
  // Started with mu_ held (std::thread does not wait for the thread to run): each new thread
  // takes mu_ in NextBatch once this returns.
  while (static_cast<int>(lanes_.size()) < n) lanes_.emplace_back([this] { Loop(); });
}

int BatchQueue::queued() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(waiting_.size());
}

int BatchQueue::running() const {
  absl::MutexLock lock(&mu_);
  return running_;
}

int64_t BatchQueue::queued_tokens(const std::string& client) const {
  absl::MutexLock lock(&mu_);
  auto it = clients_.find(client);
  return it == clients_.end() ? 0 : it->second.tokens;
}

void BatchQueue::AddLocked(std::shared_ptr<Request> r) {
  // Both made by Submit's check.
  ClientQueue& client = clients_[r->caller.client];
  ConnectionQueue& connection = client.connections[r->caller.connection];
  connection.waiting.emplace(r->id, r.get());
  connection.tokens += r->token_count;
  client.tokens += r->token_count;
  waiting_.push_back(std::move(r));
}

std::shared_ptr<BatchQueue::Request> BatchQueue::RemoveLocked(const Request* r) {
  auto it =
      std::find_if(waiting_.begin(), waiting_.end(), [r](const std::shared_ptr<Request>& w) { return w.get() == r; });
  std::shared_ptr<Request> owned = std::move(*it);
  waiting_.erase(it);
  auto client = clients_.find(r->caller.client);
  auto connection = client->second.connections.find(r->caller.connection);
  connection->second.waiting.erase(r->id);
  connection->second.tokens -= r->token_count;
  client->second.tokens -= r->token_count;
  // Gone with their last request: the maps hold callers with waiting requests only, so they are
  // bounded by the queue.
  if (connection->second.waiting.empty()) client->second.connections.erase(connection);
  if (client->second.connections.empty()) clients_.erase(client);
  return owned;
}

namespace {

// The entry of `entries` whose turn is lowest, the one with the older request on a tie.
template <typename Map, typename OldestFn>
const typename Map::mapped_type* NextInTurn(const Map& entries, const OldestFn& oldest) {
  const typename Map::mapped_type* next = nullptr;
  int64_t next_oldest = 0;
  for (const auto& entry : entries) {
    const int64_t entry_oldest = oldest(entry.second);
    if (next == nullptr || entry.second.turn < next->turn ||
        (entry.second.turn == next->turn && entry_oldest < next_oldest)) {
      next = &entry.second;
      next_oldest = entry_oldest;
    }
  }
  return next;
}

}  // namespace

BatchQueue::Request* BatchQueue::HeadLocked() const {
  auto connection_oldest = [](const ConnectionQueue& c) { return c.waiting.begin()->first; };
  auto client_oldest = [&connection_oldest](const ClientQueue& c) {
    int64_t oldest = INT64_MAX;
    for (const auto& entry : c.connections) oldest = std::min(oldest, connection_oldest(entry.second));
    return oldest;
  };
  const ClientQueue* client = NextInTurn(clients_, client_oldest);
  return NextInTurn(client->connections, connection_oldest)->waiting.begin()->second;
}

int64_t BatchQueue::PaddedSeq(int64_t longest) const {
  const int64_t m = std::max<int64_t>(1, padding_.seq_multiple);
  const int64_t rounded = (longest + m - 1) / m * m;
  // Requests are valid alone, so their longest seq is a valid seq: never round past the cap.
  if (padding_.max_seq > 0 && rounded > padding_.max_seq) return longest;
  return rounded;
}

absl::StatusOr<BatchResult> BatchQueue::Submit(v1::TokenInputs tokens, absl::Time deadline,
                                               const std::function<bool()>& cancelled, int micro_batches,
                                               const v1::ForwardWant& want, const Caller& caller) {
  const int64_t rows = tokens.rows();
  const int64_t seq = tokens.seq();
  const int64_t choices = std::max<int64_t>(1, tokens.choices());
  if (rows < 1 || seq < 1) {
    return absl::InvalidArgumentError(absl::StrCat("tokens need rows >= 1 and seq >= 1, got ", rows, " x ", seq));
  }
  if (rows % choices != 0) {
    return absl::InvalidArgumentError(absl::StrCat("rows ", rows, " is not a multiple of choices ", choices));
  }
  // Checked before the size checks below, so rows x seq cannot overflow the int sizes there.
  if (rows > limits_.max_batch_tokens / seq) {
    return absl::InvalidArgumentError(absl::StrCat("the request has rows x seq = ", rows, " x ", seq, " = ", rows * seq,
                                                   " tokens, more than one batch may hold (", limits_.max_batch_tokens,
                                                   ", --max_batch_tokens); send fewer or shorter rows"));
  }
  const int64_t n = rows * seq;
  auto size_ok = [n](int size, bool may_be_empty) { return size == n || (may_be_empty && size == 0); };
  if (!size_ok(tokens.input_ids_size(), false) || !size_ok(tokens.attention_mask_size(), true) ||
      !size_ok(tokens.token_type_ids_size(), true)) {
    return absl::InvalidArgumentError(absl::StrCat("tokens need rows x seq = ", n, " input_ids (and attention_mask, ",
                                                   "token_type_ids if given), got ", tokens.input_ids_size(), ", ",
                                                   tokens.attention_mask_size(), ", ", tokens.token_type_ids_size()));
  }
  if (absl::Now() >= deadline) return absl::DeadlineExceededError("the deadline passed before the request was queued");
  if (cancelled && cancelled()) return absl::CancelledError("the caller went away before the request was queued");

  auto request = std::make_shared<Request>();
  request->rows = rows;
  request->seq = seq;
  request->choices = choices;
  request->micro_batches = std::max(1, micro_batches);
  request->alone = micro_batches > 1;
  request->deadline = deadline;
  request->cancelled = cancelled;
  request->tokens = std::move(tokens);
  request->want = want;
  request->caller = caller;
  request->token_count = n;

  absl::MutexLock lock(&mu_);
  if (closed_) return absl::UnavailableError(close_reason_);
  {
    // A caller new to the queue takes its turn after those waiting since before the last batch and
    // before those the last batch served.
    auto [client, new_client] = clients_.try_emplace(caller.client);
    if (new_client) client->second.turn = batches_ - 1;
    auto [connection, new_connection] = client->second.connections.try_emplace(caller.connection);
    if (new_connection) connection->second.turn = batches_ - 1;
    const bool over_connection = connection->second.tokens + n > connection_share_;
    if (over_connection || client->second.tokens + n > client_share_) {
      const int64_t queued = over_connection ? connection->second.tokens : client->second.tokens;
      if (connection->second.waiting.empty()) client->second.connections.erase(connection);
      if (client->second.connections.empty()) clients_.erase(client);
      return absl::ResourceExhaustedError(absl::StrCat(
          over_connection ? "this connection of client " : "client ",
          caller.client.empty() ? "(unnamed)" : caller.client, " already has ", queued, " tokens waiting on this job; ",
          n, " more would pass its share of ", over_connection ? connection_share_ : client_share_,
          over_connection ? " per connection (--max_client_queued_tokens"
                          : " per client (4 x --max_client_queued_tokens",
          "): wait for its answers before sending more"));
    }
  }
  ++submits_;
  request->id = next_id_++;
  request->enqueued = absl::Now();
  AddLocked(request);
  // The caller returns on its own (deadline, cancelled) without waiting for its batch; a running
  // batch goes on for the others, and a waiting request leaves the queue (freed once its caller
  // lets go of it, below).
  auto leave = [this, &request](absl::Status why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!request->running) RemoveLocked(request.get());
    request->caller_gone = true;
    return why;
  };
  absl::StatusOr<BatchResult> result;
  while (true) {
    mu_.AwaitWithDeadline(absl::Condition(&request->done), std::min(deadline, absl::Now() + kCancelPoll));
    if (request->done) {
      result = std::move(request->result);
      break;
    }
    if (absl::Now() >= deadline) {
      result =
          leave(absl::DeadlineExceededError(request->running ? "the deadline passed while the request's batch ran"
                                                             : "the deadline passed while the request was queued"));
      break;
    }
    if (cancelled && cancelled()) {
      result = leave(absl::CancelledError(request->running ? "the caller went away while the request's batch ran"
                                                           : "the caller went away while the request was queued"));
      break;
    }
  }
  --submits_;
  return result;
}

std::vector<BatchQueue::Request*> BatchQueue::FormBatchLocked(bool* full) const {
  std::vector<Request*> batch = {HeadLocked()};
  const Request& oldest = *batch.front();  // the head: the oldest of its client
  *full = true;
  if (oldest.alone) return batch;
  std::vector<Request*> candidates;
  for (const std::shared_ptr<Request>& w : waiting_) {
    Request* r = w.get();
    if (r != &oldest && !r->alone && r->choices == oldest.choices && CompatibleWants(r->want, oldest.want))
      candidates.push_back(r);
  }
  // Closest in length to the head first (less padding), then by arrival. The head is always in:
  // a request passed over moves up its client's queue until it heads a batch itself.
  std::stable_sort(candidates.begin(), candidates.end(), [&oldest](const Request* a, const Request* b) {
    return std::abs(a->seq - oldest.seq) < std::abs(b->seq - oldest.seq);
  });
  int64_t rows = oldest.rows;
  int64_t longest = oldest.seq;
  bool skipped = false;
  for (Request* r : candidates) {
    if (static_cast<int>(batch.size()) >= limits_.max_batch_requests) break;
    const int64_t merged_longest = std::max(longest, r->seq);
    if ((rows + r->rows) * PaddedSeq(merged_longest) > limits_.max_batch_tokens) {
      skipped = true;  // a shorter or smaller request further on may still fit
      continue;
    }
    batch.push_back(r);
    rows += r->rows;
    longest = merged_longest;
  }
  *full = skipped || static_cast<int>(batch.size()) >= limits_.max_batch_requests;
  return batch;
}

std::vector<std::shared_ptr<BatchQueue::Request>> BatchQueue::NextBatch() {
  absl::MutexLock lock(&mu_);
  // A lane is free and no other free lane's thread is forming a batch: this one forms the next.
  auto work = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stopping_ || (!forming_ && running_ < concurrency_ && !waiting_.empty());
  };
  // Whether this thread holds forming_: only the holder gives it up (a thread arriving here must
  // not take it from one waiting with a batch formed, or two would form the same batch).
  bool forming = false;
  const auto give_up_forming = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (forming) forming_ = false;
    forming = false;
  };
  while (true) {
    // Every pass starts here, giving up the forming; the Await returns at once (mu_ still held,
    // so no other thread takes it meanwhile) while this lane is still free and there is work.
    give_up_forming();
    mu_.Await(absl::Condition(&work));
    if (stopping_) return {};
    forming_ = true;
    forming = true;
    bool full = false;
    std::vector<Request*> batch = FormBatchLocked(&full);
    const Request* oldest = batch.front();
    const int64_t oldest_id = oldest->id;
    // A full batch goes at once. Otherwise it waits until neither rule below asks to wait any
    // longer; `until` is the later of their ends (InfinitePast: neither asks).
    absl::Time until = absl::InfinitePast();
    bool regrouping = false;
    if (!full) {
      const absl::Time now = absl::Now();
      // max_batch_delay: more to merge with, from the arrival of the batch's first request (one
      // that already waited through the previous batch goes at once).
      const absl::Time delay_until = std::min(oldest->enqueued + limits_.max_batch_delay, oldest->deadline);
      if (now < delay_until) until = delay_until;
      // regroup_delay: the callers the last forward answered, from its end; ends early once as
      // many requests came in since. Never past the oldest's deadline: it would only be dropped.
      const absl::Time regroup_until = std::min(last_end_ + limits_.regroup_delay, oldest->deadline);
      regrouping = limits_.regroup_delay > absl::ZeroDuration() && !RegroupedLocked() && now < regroup_until;
      if (regrouping) until = std::max(until, regroup_until);
    }
    if (until != absl::InfinitePast()) {
      // `oldest` may leave the queue (and be freed) meanwhile: compare ids. Each end wakes the
      // loop once to look again (a regroup that completes does not wake it twice: `regrouping`
      // is false next time). So does a lowered concurrency that leaves no lane free, and another
      // lane's forward ending (the regroup is for its callers now, see BatchLimits::regroup_delay).
      const int64_t ended = forwards_ended_;
      auto changed = [this, oldest_id, regrouping, ended]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        if (stopping_ || waiting_.empty() || HeadLocked()->id != oldest_id) return true;
        if (running_ >= concurrency_ || forwards_ended_ != ended) return true;
        if (regrouping && RegroupedLocked()) return true;
        bool now_full = false;
        FormBatchLocked(&now_full);
        return now_full;
      };
      mu_.AwaitWithDeadline(absl::Condition(&changed), until);
      continue;
    }
    // Takes `r` off the queue, handing over the queue's reference.
    auto take = [this](const Request* r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return RemoveLocked(r); };
    // Never send a request whose caller is gone: drop those, then form the batch again.
    const absl::Time now = absl::Now();
    bool dropped = false;
    for (Request* r : batch) {
      absl::Status drop;
      if (now >= r->deadline) {
        drop = absl::DeadlineExceededError("the deadline passed while the request was queued");
      } else if (r->cancelled && r->cancelled()) {
        drop = absl::CancelledError("the caller went away while the request was queued");
      }
      if (drop.ok()) continue;
      r->result = drop;
      r->done = true;
      take(r);
      dropped = true;
    }
    if (dropped) continue;
    // Rows go in arrival order, whatever order the requests were chosen in.
    std::sort(batch.begin(), batch.end(), [](const Request* a, const Request* b) { return a->id < b->id; });
    // Every client served now has had its turn (those still waiting go to the back).
    ++batches_;
    ++running_;
    give_up_forming();
    std::vector<std::shared_ptr<Request>> taken;
    for (Request* r : batch) {
      r->running = true;
      taken.push_back(take(r));
      // Stamped on those still waiting; a caller with nothing left waiting starts afresh.
      if (auto client = clients_.find(r->caller.client); client != clients_.end()) {
        client->second.turn = batches_;
        auto connection = client->second.connections.find(r->caller.connection);
        if (connection != client->second.connections.end()) connection->second.turn = batches_;
      }
    }
    return taken;
  }
}

void BatchQueue::RunBatch(std::vector<std::shared_ptr<Request>> batch) {
  const absl::Time dispatched = absl::Now();
  absl::Time deadline = absl::InfinitePast();
  int64_t rows = 0;
  int64_t longest = 0;
  std::vector<Slice> slices;
  std::vector<const v1::ForwardWant*> wants;
  for (const std::shared_ptr<Request>& r : batch) {
    wants.push_back(&r->want);
    deadline = std::max(deadline, r->deadline);
    rows += r->rows;
    longest = std::max(longest, r->seq);
    slices.push_back({&r->tokens, r->rows, r->seq, r->choices});
  }
  BatchStats stats;
  stats.requests = static_cast<int>(batch.size());
  stats.rows = rows;
  // A lone request runs as it came: nothing to pad, nothing to cut.
  stats.seq = batch.size() == 1 ? longest : PaddedSeq(longest);
  stats.tokens = stats.rows * stats.seq;
  if (observer_) observer_(stats);

  std::vector<absl::StatusOr<BatchResult>> results(batch.size());
  absl::StatusOr<BatchOutputs> out =
      batch.size() == 1 ? run_(batch.front()->tokens, batch.front()->micro_batches, deadline, batch.front()->want)
                        : run_(Merge(slices, rows, stats.seq, padding_.pad_token_id), 1, deadline, UnionOfWants(wants));
  if (!out.ok()) {
    for (auto& result : results) result = out.status();
  } else {
    std::vector<std::vector<v1::NamedTensor>> parts;
    std::vector<std::vector<v1::ForwardRow>> row_parts;
    absl::Status split = SplitRows(std::move(out->rows), slices, rows, &row_parts);
    if (batch.size() == 1) {
      parts.push_back(std::move(out->outputs));
    } else if (split.ok()) {
      split = Split(out->outputs, slices, rows, stats.seq, per_token_, &parts);
    }
    for (size_t i = 0; i < batch.size(); ++i) {
      if (!split.ok()) {
        results[i] = split;
        continue;
      }
      BatchResult result;
      result.outputs = std::move(parts[i]);
      result.rows = std::move(row_parts[i]);
      result.forward_seconds = out->forward_seconds;
      result.response_bytes = out->response_bytes;
      // A lone request's want is the one the forward ran with: nothing to cut.
      if (batch.size() > 1) CutToWant(batch[i]->want, &result);
      result.batch = stats;
      result.queued = dispatched - batch[i]->enqueued;
      results[i] = std::move(result);
    }
  }
  absl::MutexLock lock(&mu_);
  for (size_t i = 0; i < batch.size(); ++i) {
    batch[i]->result = std::move(results[i]);
    batch[i]->done = true;
  }
  // Callers that left while it ran (deadline, cancelled) count too: a client that gave up usually
  // sends its next request, or a retry, right away. With several lanes the last to end wins (see
  // BatchLimits::regroup_delay).
  last_end_ = absl::Now();
  last_requests_ = static_cast<int>(batch.size());
  ids_at_last_end_ = next_id_;
  ++forwards_ended_;
  --running_;  // the lane is free: a waiting lane thread forms the next batch
}

bool BatchQueue::RegroupedLocked() const { return next_id_ - ids_at_last_end_ >= last_requests_; }

void BatchQueue::Loop() {
  while (true) {
    std::vector<std::shared_ptr<Request>> batch = NextBatch();
    if (batch.empty()) return;
    RunBatch(std::move(batch));
  }
}

}  // namespace bertshard::server
