#include "server/readoption.h"

#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace bertshard::server {
namespace {

ReadoptionDecision Fail(std::string cause) {
  ReadoptionDecision d;
  d.outcome = ReadoptionDecision::Outcome::kFail;
  d.cause = std::move(cause);
  return d;
}

std::string Ranks(const std::vector<int>& ranks) {
  return absl::StrCat(ranks.size() == 1 ? "rank " : "ranks ", absl::StrJoin(ranks, ", "));
}

}  // namespace

ReadoptionDecision DecideReadoption(const ReadoptionInput& in) {
  std::map<int, const RankReport*> by_rank;
  for (const RankReport& r : in.reports) {
    const v1::HeldShard& s = r.shard;
    if (s.world_size() != in.world_size || s.rank() < 0 || s.rank() >= in.world_size) {
      return Fail(absl::StrCat("after a coordinator restart worker ", r.worker_id, " at ", r.address, " holds rank ",
                               s.rank(), " of a world of ", s.world_size(), "; the job's plan has ", in.world_size,
                               " ranks"));
    }
    if (!s.broken().empty()) {
      return Fail(absl::StrCat("after a coordinator restart rank ", s.rank(), " on worker ", r.worker_id, " at ",
                               r.address, " came back broken: ", s.broken()));
    }
    if (s.forward_running()) {
      return Fail(absl::StrCat("after a coordinator restart rank ", s.rank(), " on worker ", r.worker_id, " at ",
                               r.address,
                               " was still running a forward: a forward was cut off when the coordinator "
                               "stopped"));
    }
    auto [it, inserted] = by_rank.emplace(s.rank(), &r);
    if (!inserted) {
      return Fail(absl::StrCat("after a coordinator restart rank ", s.rank(),
                               " is held by two workers: ", it->second->worker_id, " at ", it->second->address, " and ",
                               r.worker_id, " at ", r.address));
    }
  }
  std::vector<int> missing;
  for (int rank = 0; rank < in.world_size; ++rank) {
    if (!by_rank.count(rank)) missing.push_back(rank);
  }
  if (missing.empty()) {
    const int64_t sequence = by_rank.begin()->second->shard.next_sequence();
    bool agree = true;
    for (const auto& [rank, r] : by_rank) agree &= r->shard.next_sequence() == sequence;
    if (!agree) {
      std::vector<std::string> expects;
      for (const auto& [rank, r] : by_rank)
        expects.push_back(absl::StrCat("rank ", rank, ": ", r->shard.next_sequence()));
      return Fail(absl::StrCat("after a coordinator restart the ranks disagree on the next forward (",
                               absl::StrJoin(expects, ", "), "): a forward was cut off when the coordinator stopped"));
    }
    ReadoptionDecision d;
    d.outcome = ReadoptionDecision::Outcome::kAdopt;
    d.next_sequence = sequence;
    for (const auto& [rank, r] : by_rank) d.rank_workers.push_back(r->worker_id);
    return d;
  }
  // A rank whose worker came back without it can never come back: no need to wait for the rest.
  std::vector<int> lost;
  for (int rank : missing) {
    if (in.lost.count(rank)) lost.push_back(rank);
  }
  if (!in.grace_over && lost.empty()) {
    ReadoptionDecision d;
    d.waiting_for = Ranks(missing);
    return d;
  }
  std::vector<std::string> where;
  for (int rank : in.grace_over ? missing : lost) {
    std::string w = absl::StrCat("rank ", rank);
    for (const v1::RankAssignment& a : in.previous) {
      if (a.rank() != rank) continue;
      if (in.lost.count(rank)) {
        absl::StrAppend(&w, " (worker ", a.worker_id(), " at ", a.worker_address(), " registered again without it)");
      } else {
        absl::StrAppend(&w, " (last on worker ", a.worker_id(), " at ", a.worker_address(), ")");
      }
    }
    where.push_back(std::move(w));
  }
  if (in.was_loading) {
    return Fail(absl::StrCat("the coordinator restarted while the job was loading; ", absl::StrJoin(where, ", "),
                             " had not finished loading"));
  }
  return Fail(absl::StrCat("after a coordinator restart ", absl::StrJoin(where, ", "),
                           in.grace_over ? absl::StrCat(" did not come back within ", absl::FormatDuration(in.grace))
                                         : " cannot come back"));
}

}  // namespace bertshard::server
