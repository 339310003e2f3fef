#include "server/rank_fanout.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/grpc_auth.h"
#include "grpcpp/grpcpp.h"

namespace bertshard::server {

namespace {

// What the calls of one fan-out share; every call's completion holds it, so it outlives an early
// return.
struct FanOut {
  FanOut(size_t n, const v1::ForwardRequest& forward) : request(forward), responses(n), contexts(n) {}
  const v1::ForwardRequest request;
  absl::Mutex mu;
  std::vector<v1::ForwardResponse> responses;                  // each written by its own call only
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;  // set before any call starts
  size_t answered ABSL_GUARDED_BY(mu) = 0;
  int failed_rank ABSL_GUARDED_BY(mu) = -1;  // the first failure that is not a refusal
  grpc::Status failure ABSL_GUARDED_BY(mu);
  int refused_rank ABSL_GUARDED_BY(mu) = -1;  // the first INVALID_ARGUMENT
  grpc::Status refusal ABSL_GUARDED_BY(mu);
  bool aborted ABSL_GUARDED_BY(mu) = false;
};

// How long the other ranks' answers are awaited after one rank refused the request: they check it
// alike before any collective, so they answer within a round trip; one still running after this
// is in a collective its refusing peer never joins.
constexpr absl::Duration kRefusalGrace = absl::Seconds(5);

}  // namespace

void ForwardAbort::Abort(const std::string& reason) {
  absl::MutexLock lock(&mu_);
  if (aborted_) return;
  aborted_ = true;
  reason_ = reason;
  if (in_flight_) in_flight_(reason);
}

ForwardOutcome ForwardOnAllRanks(const std::vector<RankStub>& ranks, const v1::ForwardRequest& forward,
                                 absl::Time deadline, ForwardAbort* abort) {
  auto fan = std::make_shared<FanOut>(ranks.size(), forward);
  if (abort != nullptr) {
    absl::MutexLock lock(&abort->mu_);
    if (abort->aborted_) {
      ForwardOutcome outcome;
      outcome.aborted = true;
      outcome.status = grpc::Status(grpc::StatusCode::UNAVAILABLE, abort->reason_);
      return outcome;
    }
    abort->in_flight_ = [fan](const std::string& reason) {
      absl::MutexLock fan_lock(&fan->mu);
      if (fan->failed_rank >= 0 || fan->aborted) return;
      fan->aborted = true;
      fan->failure = grpc::Status(grpc::StatusCode::UNAVAILABLE, reason);
    };
  }
  for (auto& context : fan->contexts) {
    context = std::make_unique<grpc::ClientContext>();
    context->set_deadline(absl::ToChronoTime(deadline));
  }
  for (size_t r = 0; r < ranks.size(); ++r) common::AttachToken(fan->contexts[r].get(), ranks[r].token);
  for (size_t r = 0; r < ranks.size(); ++r) {
    // gRPC's callback API: no thread per rank and forward. The completion owns the fan-out and the
    // stub (so the channel), so after an early return the remaining calls end by cancellation on
    // their own.
    ranks[r].stub->async()->Forward(fan->contexts[r].get(), &fan->request, &fan->responses[r],
                                    [fan, stub = ranks[r].stub, r](grpc::Status status) {
                                      absl::MutexLock lock(&fan->mu);
                                      ++fan->answered;
                                      if (status.error_code() == grpc::StatusCode::INVALID_ARGUMENT) {
                                        if (fan->refused_rank < 0) {
                                          fan->refused_rank = static_cast<int>(r);
                                          fan->refusal = std::move(status);
                                        }
                                      } else if (!status.ok() && fan->failed_rank < 0) {
                                        fan->failed_rank = static_cast<int>(r);
                                        fan->failure = std::move(status);
                                      }
                                    });
  }
  ForwardOutcome outcome;
  {
    absl::MutexLock lock(&fan->mu);
    const size_t n = ranks.size();
    auto settled = [&fan, n] {
      return fan->failed_rank >= 0 || fan->aborted || fan->refused_rank >= 0 || fan->answered == n;
    };
    fan->mu.Await(absl::Condition(&settled));
    if (fan->refused_rank >= 0 && fan->failed_rank < 0 && !fan->aborted && fan->answered < n) {
      // A refusal: the others are awaited (not cancelled: a rank cancelled before its own check
      // would not take the forward's number, and the ranks would be out of step).
      auto all_answered = [&fan, n] { return fan->failed_rank >= 0 || fan->aborted || fan->answered == n; };
      fan->mu.AwaitWithDeadline(absl::Condition(&all_answered), std::min(deadline, absl::Now() + kRefusalGrace));
    }
    if (fan->aborted) {
      for (auto& context : fan->contexts) context->TryCancel();
      outcome.aborted = true;
      outcome.status = fan->failure;
    } else if (fan->failed_rank >= 0 || (fan->refused_rank >= 0 && fan->answered < n)) {
      // A rank failed, or refused while another has not answered: the ranks may be out of step.
      for (auto& context : fan->contexts) context->TryCancel();
      outcome.failed_rank = fan->failed_rank >= 0 ? fan->failed_rank : fan->refused_rank;
      outcome.status = fan->failed_rank >= 0 ? fan->failure : fan->refusal;
    } else if (fan->refused_rank >= 0) {
      // Every rank answered, each with its answer or INVALID_ARGUMENT: each took the forward's
      // number, so the group is in step; only the request was bad.
      outcome.refused = true;
      outcome.failed_rank = fan->refused_rank;
      outcome.status = fan->refusal;
    } else {
      outcome.responses = std::move(fan->responses);
    }
  }
  if (abort != nullptr) {
    // Off the fan-out's lock: Abort takes its own lock first, then the fan-out's.
    absl::MutexLock lock(&abort->mu_);
    abort->in_flight_ = nullptr;
  }
  return outcome;
}

// The ping is the worker's gRPC health check: it changes nothing there (ReservePort, used before,
// now hosts a rendezvous store for minutes) and needs no token. Pings need no lock.
UnreachableRank FindUnreachableRank(const std::vector<RankStub>& ranks) {
  for (size_t r = 0; r < ranks.size(); ++r) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
    grpc::health::v1::HealthCheckResponse ignored;
    grpc::Status status = ranks[r].health->Check(&context, grpc::health::v1::HealthCheckRequest(), &ignored);
    if (!status.ok()) {
      return {static_cast<int>(r), absl::StrCat("worker ", ranks[r].worker_id, " (rank ", r, ") at ", ranks[r].address,
                                                " is unreachable: ", status.error_message())};
    }
  }
  return {};
}

std::string Blame(const std::vector<RankStub>& ranks, const std::string& first_failure) {
  UnreachableRank down = FindUnreachableRank(ranks);
  return down.rank >= 0 ? down.cause : first_failure;
}

}  // namespace bertshard::server
