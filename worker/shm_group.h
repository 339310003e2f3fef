// File: worker/shm_group.h
// -----------------------------------------------------------------------------
// The tensor-parallel collectives of ranks that share a host, through one shared-memory segment
// instead of Gloo's TCP loopback. Gloo moves a BERT-base all-reduce (3 MiB, 2 ranks) in ~6.7 ms
// over loopback, 25 times a forward: ~170 ms of a ~0.9 s TP 2 forward on two cores. Through shared
// memory the same all-reduce is a few copies of 3 MiB. NCCL does the same on one host; Gloo does not.
//
// How: the group's first rank creates a file in `dir` (tmpfs: /dev/shm), reserves it whole
// (posix_fallocate, so a small /dev/shm -- a container's 64 MiB -- fails here rather than with
// SIGBUS mid-forward) and maps it; the others map it by the name it publishes in the store. Ranks
// that cannot map it (another host, or a container with its own /dev/shm) say so in the store and
// the whole group falls back to Gloo: Join returns nullptr. The file is unlinked as soon as every
// rank has answered, so a crash afterwards leaves nothing behind; a failure before that unlinks it
// too, and one that cannot (the creator killed) is swept at the next start (SweepStaleSegments).
//
// Every collective moves data in pieces of at most one slot: each rank writes its piece into its
// slot, a barrier, then each rank reads what it needs. Two sets of slots alternate, so a rank
// writes a set only after every rank has left the previous use of that set (it has passed the
// barrier of the use in between, which every rank reached only after finishing the earlier one).
// Sums are computed once per element by one rank, in rank order, so every rank gets bit-identical
// results; bf16/fp16 sum in float32 and round once, as the Gloo path does.
//
// Waiting spins briefly, then sleeps on a futex. A wait gives up after `timeout`, and sooner when a
// peer's process is gone (checked when the peers share this process's PID namespace) or a peer has
// marked the group broken after its own failure. Errors are UNAVAILABLE and leave the group
// broken: the rank must end, as with Gloo.
//
// Thread safety: thread-compatible (one collective at a time per rank).
#ifndef BERTSHARD_WORKER_SHM_GROUP_H_
#define BERTSHARD_WORKER_SHM_GROUP_H_

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace bertshard::worker {

struct ShmOptions {
  std::string dir = "/dev/shm";
  // The segment's whole size (two sets of one slot per rank plus one for sums); pieces of a large
  // collective are one slot each. Every page a collective touches counts in each rank's RSS: 24 MiB
  // (a BERT-base batch 8 x 128 all-reduce in one piece at TP 2) added 15 MiB to a TP rank's RSS;
  // 8 MiB moves it in three pieces, a few microseconds of barriers more.
  int64_t segment_bytes = int64_t{8} << 20;
  std::chrono::milliseconds timeout{120000};
};

// Removes the segment files in `dir` that SharedMemoryGroup made (bertshard-tp-PID-PIDNS-TOKEN) and
// whose creator is gone: owned by this user, regular files, with a PID of this process's PID
// namespace that no process holds. A creator killed before its peers answered (SIGKILL, a crash)
// skips every unlink; shard-worker and shard-rank call this at start so that such files do not add
// up in RAM for good. Older names without the namespace are removed once an hour old and their
// pid is gone. Returns how many it removed; UNAVAILABLE if `dir` cannot be listed.
absl::StatusOr<int> SweepStaleSegments(const std::string& dir = "/dev/shm");

class SharedMemoryGroup {
 public:
  // Every rank of the group (`rank` of `size`) calls it at the same time, with the same `prefix`
  // for the store keys. nullptr when some rank cannot map the segment (the caller uses the network
  // instead); UNAVAILABLE when the store fails (a peer is gone); INVALID_ARGUMENT for bad sizes.
  static absl::StatusOr<std::unique_ptr<SharedMemoryGroup>> Join(c10d::Store& store, const std::string& prefix,
                                                                 int rank, int size, const ShmOptions& options);
  ~SharedMemoryGroup();
  SharedMemoryGroup(const SharedMemoryGroup&) = delete;
  SharedMemoryGroup& operator=(const SharedMemoryGroup&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  int64_t slot_bytes() const { return slot_bytes_; }

  // As model::Collectives: every rank passes a tensor of the same shape and dtype (checked).
  absl::Status AllReduceSum(at::Tensor& tensor);
  absl::StatusOr<at::Tensor> AllGather(const at::Tensor& tensor, int64_t dim);
  absl::StatusOr<at::Tensor> ReduceScatter(const at::Tensor& tensor, int64_t dim);

  // The segment's first page (public only so the .cc can check its size).
  struct Header;

 private:
  SharedMemoryGroup(int rank, int size, void* base, int64_t bytes, int64_t slot_bytes,
                    std::chrono::milliseconds timeout);

  // Returns once every rank has called it as often; UNAVAILABLE (and the group broken) on timeout,
  // a peer gone, or a peer's failure.
  absl::Status Barrier();
  // Checks that every rank called the same collective on as many bytes (recorded before the
  // barrier that precedes it): a mismatch would otherwise read garbage.
  absl::Status CheckSameCall(int set);
  // The set of slots the next piece uses; the first piece of a collective records the call.
  int BeginPiece(int64_t op, at::ScalarType dtype, int64_t elements, bool first);
  // Runs a collective: refused once the group is broken, and an exception breaks it (peers waiting
  // for this rank fail at once instead of at their timeout).
  template <typename F>
  absl::Status Guarded(F&& f);
  // Marks the group broken and wakes every waiting peer; returns `status`.
  absl::Status Fail(absl::Status status);
  // The next use's set: slot `r`'s bytes and the sum area.
  char* Slot(int set, int r) const;
  char* SumArea(int set) const;

  const int rank_;
  const int size_;
  void* const base_;
  const int64_t bytes_;
  const int64_t slot_bytes_;
  const std::chrono::milliseconds timeout_;
  Header* const header_;
  uint32_t barriers_ = 0;  // barriers passed so far (the header's count, from this rank's view)
  int64_t uses_ = 0;       // pieces moved so far: which set of slots the next one uses
};

}  // namespace bertshard::worker

#endif  // BERTSHARD_WORKER_SHM_GROUP_H_
