#include "worker/shm_group.h"

#include <ATen/ATen.h>
#include <dirent.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstring>
#include <new>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"

namespace bertshard::worker {
namespace {

constexpr int kMaxRanks = 64;
constexpr char kSegmentPrefix[] = "bertshard-tp-";
// A segment named the old way (no pid namespace) is swept only once it is this old: its creator's
// pid cannot be checked in a namespace that is not known, and a live group unlinks its segment
// within its rendezvous timeout anyway.
constexpr auto kLegacySegmentAge = std::chrono::hours(1);
constexpr int64_t kHeaderBytes = 4096;
constexpr int64_t kMinSlotBytes = 64 << 10;
// How long a waiting rank spins before it sleeps on the futex: a TP peer usually arrives within
// microseconds of its partner (same products, same sizes), and a futex wake costs more than that.
constexpr auto kSpin = std::chrono::microseconds(50);

enum Op : int64_t { kAllReduce = 1, kAllGather = 2, kReduceScatter = 3 };

long Futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  // Not FUTEX_PRIVATE_FLAG: the word is shared between processes.
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

uint64_t PidNamespace() {
  struct stat st {};
  return stat("/proc/self/ns/pid", &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
}

std::vector<uint8_t> Bytes(const std::string& s) { return {s.begin(), s.end()}; }
std::string String(const std::vector<uint8_t>& b) { return {b.begin(), b.end()}; }

bool IsNarrowFloat(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; }

at::Tensor View(char* p, int64_t elements, at::ScalarType dtype) {
  return at::from_blob(p, {elements}, at::TensorOptions().dtype(dtype));
}

// out = sum over `parts` in order; narrow floats accumulate in float32 and round once. `out` is a
// view of the destination (a handle: writing through it writes there).
void SumInto(at::Tensor out, const std::vector<at::Tensor>& parts) {
  if (IsNarrowFloat(out.scalar_type())) {
    at::Tensor acc = parts[0].to(at::kFloat);
    for (size_t j = 1; j < parts.size(); ++j) acc.add_(parts[j]);
    out.copy_(acc);
    return;
  }
  if (parts.size() == 1) {
    out.copy_(parts[0]);
    return;
  }
  at::add_out(out, parts[0], parts[1]);
  for (size_t j = 2; j < parts.size(); ++j) out.add_(parts[j]);
}

}  // namespace

struct SharedMemoryGroup::Header {
  uint64_t token;  // the creator's random token: the others check they mapped the file they were told of
  int32_t size;
  int64_t slot_bytes;
  std::atomic<uint64_t> arrived;     // barrier arrivals, ever (barrier k completes at (k + 1) * size)
  std::atomic<uint32_t> generation;  // barriers completed (the futex word)
  std::atomic<uint32_t> sleepers;    // ranks asleep on the futex: the last arrival wakes them only if any
  std::atomic<uint32_t> broken;      // set by a rank whose collective failed; everyone else fails too
  int32_t pid[kMaxRanks];
  uint64_t pid_namespace[kMaxRanks];
  // Each rank's current collective (op, dtype, elements), written before its first barrier, in the
  // set of slots its first piece uses: like the slots, one set is never rewritten while a peer reads it.
  int64_t call[2][kMaxRanks][3];
};
static_assert(sizeof(SharedMemoryGroup::Header) <= kHeaderBytes);

absl::StatusOr<std::unique_ptr<SharedMemoryGroup>> SharedMemoryGroup::Join(c10d::Store& store,
                                                                           const std::string& prefix, int rank,
                                                                           int size, const ShmOptions& options) {
  if (size < 2 || size > kMaxRanks || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared-memory group: rank ", rank, " of ", size, " (2 to ", kMaxRanks, " ranks)"));
  }
  const int64_t slot_bytes = (options.segment_bytes - kHeaderBytes) / (2 * (size + 1)) / 64 * 64;
  if (slot_bytes < kMinSlotBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared-memory segment of ", options.segment_bytes, " bytes is too small for ", size, " ranks"));
  }
  const int64_t bytes = kHeaderBytes + 2 * (size + 1) * slot_bytes;
  void* base = MAP_FAILED;
  std::string why_not;  // why this rank has no mapping ("" when it has one)
  // The segment file this rank created and has not unlinked yet: a wait for peers that throws
  // (a peer died before answering) must not leave it in /dev/shm for good.
  std::string created;
  try {
    if (rank == 0) {
      std::random_device random;
      const uint64_t token = (static_cast<uint64_t>(random()) << 32) ^ random();
      // The creator's pid and pid namespace in the name: SweepStaleSegments can tell, after a
      // crash that skipped every unlink, that nobody can be using it.
      const std::string name = absl::StrCat(kSegmentPrefix, getpid(), "-", PidNamespace(), "-", absl::Hex(token));
      const std::string path = absl::StrCat(options.dir, "/", name);
      const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
      if (fd >= 0) created = path;
      if (fd < 0) {
        why_not = absl::StrCat("cannot create ", path, ": ", std::strerror(errno));
      } else {
        // Reserve every page now: tmpfs would otherwise hand them out on first touch and a full
        // /dev/shm would kill the rank with SIGBUS in the middle of a forward.
        if (const int err = posix_fallocate(fd, 0, bytes); err != 0) {
          why_not = absl::StrCat("cannot reserve ", bytes, " bytes in ", options.dir, ": ", std::strerror(err));
        } else if (base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0); base == MAP_FAILED) {
          why_not = absl::StrCat("cannot map ", path, ": ", std::strerror(errno));
        } else {
          Header* h = new (base) Header();
          h->token = token;
          h->size = size;
          h->slot_bytes = slot_bytes;
        }
        close(fd);
      }
      store.set(prefix + "/segment", Bytes(why_not.empty() ? absl::StrCat(name, "\n", token) : ""));
      if (!why_not.empty()) {
        unlink(path.c_str());
        created.clear();
      }
      // Unlinked once every rank has answered (mapped or not): nothing to clean up after a crash.
      std::vector<std::string> answers;
      if (why_not.empty()) store.set(prefix + "/mapped/0", Bytes("1"));
      for (int r = why_not.empty() ? 1 : size; r < size; ++r)
        answers.push_back(String(store.get(absl::StrCat(prefix, "/mapped/", r))));
      if (why_not.empty()) {
        unlink(path.c_str());
        created.clear();
      }
      for (const std::string& a : answers) {
        if (a != "1" && why_not.empty()) why_not = "a peer could not map the segment";
      }
    } else {
      const std::vector<std::string> segment = absl::StrSplit(String(store.get(prefix + "/segment")), '\n');
      uint64_t token = 0;
      // Looked up in this rank's own `dir`: on another host (or in a container with its own
      // /dev/shm) the name is not there, or is another file, which the token tells apart.
      const std::string path = segment.empty() ? "" : absl::StrCat(options.dir, "/", segment[0]);
      if (segment.size() != 2 || absl::StrContains(segment[0], "/") || !absl::SimpleAtoi(segment[1], &token)) {
        why_not = "the first rank has no segment";
      } else if (const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC); fd < 0) {
        why_not = absl::StrCat("cannot open ", path, ": ", std::strerror(errno));
      } else {
        struct stat st {};
        if (fstat(fd, &st) != 0 || st.st_size != bytes) {
          why_not = "the segment's size differs (another configuration?)";
        } else if (base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0); base == MAP_FAILED) {
          why_not = absl::StrCat("cannot map ", path, ": ", std::strerror(errno));
        } else if (const Header* h = static_cast<const Header*>(base); h->token != token || h->size != size) {
          why_not = "the file mapped is not the first rank's segment (another host's /dev/shm?)";
        }
        close(fd);
      }
      store.set(absl::StrCat(prefix, "/mapped/", rank), Bytes(why_not.empty() ? "1" : "0"));
      // Everyone learns whether everyone mapped it: all use the segment or none does.
      for (int r = 1; r < size && why_not.empty(); ++r) {
        if (r != rank && String(store.get(absl::StrCat(prefix, "/mapped/", r))) != "1") {
          why_not = "a peer could not map the segment";
        }
      }
    }
  } catch (const std::exception& e) {
    if (!created.empty()) unlink(created.c_str());
    if (base != MAP_FAILED) munmap(base, bytes);
    return absl::UnavailableError(absl::StrCat("shared-memory rendezvous failed: ", e.what()));
  }
  if (!why_not.empty()) {
    if (base != MAP_FAILED) munmap(base, bytes);
    return std::unique_ptr<SharedMemoryGroup>();
  }
  auto group =
      std::unique_ptr<SharedMemoryGroup>(new SharedMemoryGroup(rank, size, base, bytes, slot_bytes, options.timeout));
  group->header_->pid[rank] = getpid();
  group->header_->pid_namespace[rank] = PidNamespace();
  // Every rank's pid is in before anyone relies on it.
  if (absl::Status s = group->Barrier(); !s.ok()) return s;
  return group;
}

SharedMemoryGroup::SharedMemoryGroup(int rank, int size, void* base, int64_t bytes, int64_t slot_bytes,
                                     std::chrono::milliseconds timeout)
    : rank_(rank),
      size_(size),
      base_(base),
      bytes_(bytes),
      slot_bytes_(slot_bytes),
      timeout_(timeout),
      header_(static_cast<Header*>(base)) {}

SharedMemoryGroup::~SharedMemoryGroup() { munmap(base_, bytes_); }

char* SharedMemoryGroup::Slot(int set, int r) const {
  return static_cast<char*>(base_) + kHeaderBytes + (set * (size_ + 1) + r) * slot_bytes_;
}
char* SharedMemoryGroup::SumArea(int set) const { return Slot(set, size_); }

absl::Status SharedMemoryGroup::Fail(absl::Status status) {
  header_->broken.store(1);
  // Sleepers that miss this wake see the flag when their nap ends (20 ms).
  Futex(&header_->generation, FUTEX_WAKE, INT_MAX, nullptr);
  return status;
}

absl::Status SharedMemoryGroup::Barrier() {
  if (header_->broken.load()) return absl::UnavailableError("a tensor-parallel peer failed (shared memory)");
  const uint32_t passed = barriers_;
  const uint64_t last_arrival = (static_cast<uint64_t>(passed) + 1) * static_cast<uint64_t>(size_);
  if (header_->arrived.fetch_add(1) + 1 == last_arrival) {
    header_->generation.store(passed + 1);
    if (header_->sleepers.load() > 0) Futex(&header_->generation, FUTEX_WAKE, INT_MAX, nullptr);
    ++barriers_;
    return absl::OkStatus();
  }
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; header_->generation.load(std::memory_order_acquire) == passed; ++i) {
    if ((i & 63) == 0 && std::chrono::steady_clock::now() - start > kSpin) break;
    CpuRelax();
  }
  const uint64_t my_namespace = header_->pid_namespace[rank_];
  auto next_check = std::chrono::steady_clock::now();
  while (header_->generation.load() == passed) {
    header_->sleepers.fetch_add(1);
    const timespec nap = {0, 20'000'000};  // 20 ms: how often a sleeper looks for dead peers
    Futex(&header_->generation, FUTEX_WAIT, passed, &nap);
    header_->sleepers.fetch_sub(1);
    // The barrier completed: passed, even if a peer failed since (this rank then sees why itself).
    if (header_->generation.load() != passed) break;
    if (header_->broken.load()) return absl::UnavailableError("a tensor-parallel peer failed (shared memory)");
    const auto now = std::chrono::steady_clock::now();
    if (now - start > timeout_) {
      return Fail(absl::UnavailableError(
          absl::StrCat("tensor-parallel peers did not arrive within ", timeout_.count(), " ms (shared memory)")));
    }
    if (now >= next_check) {
      next_check = now + std::chrono::milliseconds(200);
      for (int r = 0; r < size_; ++r) {
        const int32_t pid = header_->pid[r];
        // Only a pid in this rank's own namespace means what it says (a peer in another container
        // that shares /dev/shm has its own numbering).
        if (r == rank_ || pid <= 0 || my_namespace == 0 || header_->pid_namespace[r] != my_namespace) continue;
        if (kill(pid, 0) != 0 && errno == ESRCH) {
          return Fail(absl::UnavailableError(
              absl::StrCat("tensor-parallel peer rank ", r, " (pid ", pid, ") is gone (shared memory)")));
        }
      }
    }
  }
  ++barriers_;
  return absl::OkStatus();
}

absl::Status SharedMemoryGroup::CheckSameCall(int set) {
  const int64_t* mine = header_->call[set][rank_];
  for (int r = 0; r < size_; ++r) {
    const int64_t* theirs = header_->call[set][r];
    if (std::memcmp(theirs, mine, sizeof(header_->call[set][r])) != 0) {
      return Fail(absl::InternalError(absl::StrCat(
          "tensor-parallel ranks ", rank_, " and ", r, " called different collectives (op ", mine[0], " vs ", theirs[0],
          ", dtype ", mine[1], " vs ", theirs[1], ", ", mine[2], " vs ", theirs[2], " elements)")));
    }
  }
  return absl::OkStatus();
}

int SharedMemoryGroup::BeginPiece(int64_t op, at::ScalarType dtype, int64_t elements, bool first) {
  const int set = static_cast<int>(uses_++ % 2);
  if (first) {
    int64_t* call = header_->call[set][rank_];
    call[0] = op;
    call[1] = static_cast<int64_t>(dtype);
    call[2] = elements;
  }
  return set;
}

template <typename F>
absl::Status SharedMemoryGroup::Guarded(F&& f) {
  if (header_->broken.load()) return absl::UnavailableError("a tensor-parallel peer failed (shared memory)");
  try {
    return f();
  } catch (const std::exception& e) {
    // Peers may be waiting for this rank at a barrier: let them fail now, not at their timeout.
    return Fail(absl::InternalError(absl::StrCat("shared-memory collective: ", e.what())));
  }
}

absl::Status SharedMemoryGroup::AllReduceSum(at::Tensor& tensor) {
  return Guarded([&]() -> absl::Status {
    const at::Tensor flat = tensor.contiguous().view(-1);  // `tensor` itself when contiguous
    const int64_t n = flat.numel(), elt = flat.element_size();
    const at::ScalarType dtype = flat.scalar_type();
    char* data = static_cast<char*>(flat.data_ptr());
    const int64_t piece_max = slot_bytes_ / elt;
    for (int64_t start = 0; start < n; start += piece_max) {
      const int64_t piece = std::min(piece_max, n - start);
      const int set = BeginPiece(kAllReduce, dtype, n, start == 0);
      std::memcpy(Slot(set, rank_), data + start * elt, static_cast<size_t>(piece * elt));
      RETURN_IF_ERROR(Barrier());
      if (start == 0) RETURN_IF_ERROR(CheckSameCall(set));
      // This rank sums its share of the piece for everyone.
      const int64_t lo = piece * rank_ / size_, hi = piece * (rank_ + 1) / size_;
      if (hi > lo) {
        std::vector<at::Tensor> parts;
        for (int j = 0; j < size_; ++j) parts.push_back(View(Slot(set, j) + lo * elt, hi - lo, dtype));
        SumInto(View(SumArea(set) + lo * elt, hi - lo, dtype), parts);
      }
      RETURN_IF_ERROR(Barrier());
      std::memcpy(data + start * elt, SumArea(set), static_cast<size_t>(piece * elt));
    }
    if (!tensor.is_contiguous()) tensor.copy_(flat.view(tensor.sizes()));
    return absl::OkStatus();
  });
}

absl::StatusOr<at::Tensor> SharedMemoryGroup::AllGather(const at::Tensor& tensor, int64_t dim) {
  at::Tensor result;
  absl::Status status = Guarded([&]() -> absl::Status {
    const at::Tensor t = tensor.contiguous();
    const int64_t n = t.numel(), elt = t.element_size();
    const at::Tensor staging = at::empty({size_, n}, t.options());
    const char* data = static_cast<const char*>(t.data_ptr());
    const int64_t piece_max = slot_bytes_ / elt;
    for (int64_t start = 0; start < n; start += piece_max) {
      const int64_t piece = std::min(piece_max, n - start);
      const int set = BeginPiece(kAllGather, t.scalar_type(), n, start == 0);
      std::memcpy(Slot(set, rank_), data + start * elt, static_cast<size_t>(piece * elt));
      RETURN_IF_ERROR(Barrier());
      if (start == 0) RETURN_IF_ERROR(CheckSameCall(set));
      for (int j = 0; j < size_; ++j) {
        std::memcpy(static_cast<char*>(staging[j].data_ptr()) + start * elt, Slot(set, j),
                    static_cast<size_t>(piece * elt));
      }
    }
    std::vector<int64_t> shape = {size_};
    shape.insert(shape.end(), t.sizes().begin(), t.sizes().end());
    const at::Tensor each = staging.view(shape);
    const int64_t d = dim < 0 ? dim + t.dim() : dim;
    result = d == 0 ? each.flatten(0, 1) : at::cat(each.unbind(0), d);  // dim 0: no copy
    return absl::OkStatus();
  });
  if (!status.ok()) return status;
  return result;
}

absl::StatusOr<at::Tensor> SharedMemoryGroup::ReduceScatter(const at::Tensor& tensor, int64_t dim) {
  at::Tensor result;
  absl::Status status = Guarded([&]() -> absl::Status {
    const std::vector<at::Tensor> chunks = tensor.chunk(size_, dim);
    if (static_cast<int>(chunks.size()) != size_ || tensor.size(dim) % size_ != 0) {
      return absl::InternalError("reduce-scatter dimension is not a multiple of the TP size");
    }
    // Row j: what goes to rank j.
    const at::Tensor stacked = at::stack(chunks, 0).contiguous().view({size_, -1});
    const int64_t m = stacked.size(1), elt = stacked.element_size();
    const at::ScalarType dtype = stacked.scalar_type();
    const at::Tensor out = at::empty({m}, stacked.options());
    const int64_t piece_max = slot_bytes_ / (elt * size_);
    for (int64_t start = 0; start < m; start += piece_max) {
      const int64_t piece = std::min(piece_max, m - start);
      const int set = BeginPiece(kReduceScatter, dtype, tensor.numel(), start == 0);
      for (int j = 0; j < size_; ++j) {
        std::memcpy(Slot(set, rank_) + j * piece * elt, static_cast<const char*>(stacked[j].data_ptr()) + start * elt,
                    static_cast<size_t>(piece * elt));
      }
      RETURN_IF_ERROR(Barrier());
      if (start == 0) RETURN_IF_ERROR(CheckSameCall(set));
      std::vector<at::Tensor> parts;
      for (int j = 0; j < size_; ++j) parts.push_back(View(Slot(set, j) + rank_ * piece * elt, piece, dtype));
      SumInto(View(static_cast<char*>(out.data_ptr()) + start * elt, piece, dtype), parts);
    }
    result = out.view(chunks[0].sizes());
    return absl::OkStatus();
  });
  if (!status.ok()) return status;
  return result;
}

absl::StatusOr<int> SweepStaleSegments(const std::string& dir) {
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) {
    return absl::UnavailableError(absl::StrCat("cannot list ", dir, ": ", std::strerror(errno)));
  }
  const uint64_t my_namespace = PidNamespace();
  const auto now = std::chrono::system_clock::now();
  int removed = 0;
  while (const dirent* entry = readdir(d)) {
    const absl::string_view name = entry->d_name;
    if (!absl::StartsWith(name, kSegmentPrefix)) continue;
    // bertshard-tp-PID-PIDNS-TOKEN, or bertshard-tp-PID-TOKEN before the namespace was named.
    const std::vector<absl::string_view> parts = absl::StrSplit(name.substr(sizeof(kSegmentPrefix) - 1), '-');
    int32_t pid = 0;
    uint64_t pid_namespace = 0;
    if (parts.size() < 2 || parts.size() > 3 || !absl::SimpleAtoi(parts[0], &pid) || pid <= 0) continue;
    if (parts.size() == 3 && !absl::SimpleAtoi(parts[1], &pid_namespace)) continue;
    struct stat st {};
    // Only this user's regular files (never another user's, nor a link someone placed).
    if (fstatat(dirfd(d), entry->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode) ||
        st.st_uid != geteuid()) {
      continue;
    }
    if (parts.size() == 3) {
      // A pid means what it says only in its own namespace: another container's segment stays.
      if (my_namespace == 0 || pid_namespace != my_namespace) continue;
    } else if (now - std::chrono::system_clock::from_time_t(st.st_mtime) < kLegacySegmentAge) {
      continue;
    }
    // Alive (or alive under another user, EPERM), or a pid reused since: left alone.
    if (kill(pid, 0) == 0 || errno != ESRCH) continue;
    if (unlinkat(dirfd(d), entry->d_name, 0) == 0) ++removed;
  }
  closedir(d);
  return removed;
}

}  // namespace bertshard::worker
