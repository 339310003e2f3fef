// File: common/metrics.h
// -----------------------------------------------------------------------------
// A small metrics registry for bertshard's servers, rendered in the Prometheus text exposition
// format 0.0.4 (see common/metrics_endpoint.h for the HTTP side). Three kinds of families, each a
// metric name with fixed label names and one child per combination of label values:
//
//   - counters (names end in `_total`): only go up; requests, bytes read.
//   - gauges: go up and down; set directly.
//   - histograms: fixed bucket upper bounds chosen at registration; exposed as cumulative
//     `_bucket{le="..."}` lines (with `+Inf`), `_sum` and `_count`.
//
// Values that are cheaper to read when scraped than to keep up to date (jobs by state, workers by
// health) are "collectors": a callback registered with a name, evaluated at every Render().
//
// There is no global registry: a server's main owns one and passes a pointer to whoever records.
// Families live as long as the registry, so pointers to families stay valid; a child stays valid
// until its series is removed (Family::Remove: a job's series go when the job ends, so that ended
// jobs do not pile up in the exposition); a collector lives until its CollectorHandle is destroyed.
//
// Example:
//   MetricsRegistry registry;
//   ASSIGN_OR_RETURN(CounterFamily* requests,
//                    registry.AddCounter("app_requests_total", "Requests served.", {"method"}));
//   ASSIGN_OR_RETURN(Counter* plan, requests->WithLabels({"Plan"}));
//   plan->Increment();
//   registry.Render();
//   // # HELP app_requests_total Requests served.
//   // # TYPE app_requests_total counter
//   // app_requests_total{method="Plan"} 1
//
// Thread safety: thread-safe. Recording (Increment, Set, Observe) takes no registry-wide lock.
// Collectors run on the thread that calls Render(), one Render at a time, and must not call
// AddCollector or Render themselves.
#ifndef BERTSHARD_COMMON_METRICS_H_
#define BERTSHARD_COMMON_METRICS_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace bertshard::common {

enum class MetricType { kCounter, kGauge, kHistogram };

// A value that only goes up.
class Counter {
 public:
  // Adds `amount`. Negative or NaN amounts are ignored: a counter that went down would read as a
  // process restart to Prometheus' rate().
  void Increment(double amount = 1);
  double Value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0};
};

// A value that goes up and down.
class Gauge {
 public:
  void Set(double value) { value_.store(value, std::memory_order_relaxed); }
  void Add(double amount);
  double Value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0};
};

// Observations counted into fixed buckets. Observe and the exposition see one consistent state
// (the `+Inf` bucket always equals `_count`).
class Histogram {
 public:
  // `bounds`: the family's upper bounds, strictly increasing and finite (checked at registration).
  explicit Histogram(const std::vector<double>* bounds);

  // Counts `value` into the first bucket whose bound is >= value (Prometheus' `le`), or `+Inf`.
  void Observe(double value);

  struct Snapshot {
    std::vector<uint64_t> cumulative;  // one per bound, then +Inf
    double sum = 0;
    uint64_t count = 0;
  };
  Snapshot Read() const;

 private:
  const std::vector<double>* const bounds_;
  mutable absl::Mutex mu_;
  std::vector<uint64_t> counts_ ABSL_GUARDED_BY(mu_);  // per bucket, not cumulative; last is +Inf
  double sum_ ABSL_GUARDED_BY(mu_) = 0;
};

// One family: a name, help text, label names and a child per combination of label values.
template <typename Metric>
class Family;
using CounterFamily = Family<Counter>;
using GaugeFamily = Family<Gauge>;
using HistogramFamily = Family<Histogram>;

// A sample a collector reports: label values in the order of its label names, and the value.
struct Sample {
  std::vector<std::string> label_values;
  double value = 0;
};
using Collector = std::function<absl::StatusOr<std::vector<Sample>>()>;

class MetricsRegistry {
 public:
  MetricsRegistry();
  ~MetricsRegistry();
  MetricsRegistry(const MetricsRegistry&) = delete;
  MetricsRegistry& operator=(const MetricsRegistry&) = delete;

  // Registers a family, or returns the one already registered under `name` with the same type,
  // label names (and bounds), so independent users may register the same family.
  // INVALID_ARGUMENT: a name that is not [a-zA-Z_:][a-zA-Z0-9_:]*, a counter name without the
  // `_total` suffix, a label name that is not [a-zA-Z_][a-zA-Z0-9_]* or starts with "__", a
  // repeated label name, `le` on a histogram, bounds not strictly increasing and finite.
  // ALREADY_EXISTS: the name is taken by a different family or a collector.
  absl::StatusOr<CounterFamily*> AddCounter(const std::string& name, const std::string& help,
                                            const std::vector<std::string>& label_names);
  absl::StatusOr<GaugeFamily*> AddGauge(const std::string& name, const std::string& help,
                                        const std::vector<std::string>& label_names);
  absl::StatusOr<HistogramFamily*> AddHistogram(const std::string& name, const std::string& help,
                                                const std::vector<std::string>& label_names,
                                                const std::vector<double>& bounds);

  // Unregisters its collector on destruction, waiting for a Render() that is running it. It must
  // not outlive the registry.
  class CollectorHandle {
   public:
    CollectorHandle() = default;
    CollectorHandle(CollectorHandle&& other) noexcept;
    CollectorHandle& operator=(CollectorHandle&& other) noexcept;
    ~CollectorHandle();

   private:
    friend class MetricsRegistry;
    CollectorHandle(MetricsRegistry* registry, std::string name) : registry_(registry), name_(std::move(name)) {}
    MetricsRegistry* registry_ = nullptr;
    std::string name_;
  };

  // Registers `collect` as the family `name` (a counter or gauge; names and labels checked as
  // above), called at every Render(). A Render where it fails, or returns samples with the wrong
  // number of label values, shows the family without samples and a comment saying why.
  // INVALID_ARGUMENT as above (and for kHistogram); ALREADY_EXISTS if the name is taken.
  absl::StatusOr<CollectorHandle> AddCollector(MetricType type, const std::string& name, const std::string& help,
                                               const std::vector<std::string>& label_names, Collector collect);

  // Every family and collector in the text format 0.0.4, sorted by name, children sorted by
  // label values.
  std::string Render();

  // What every family has, whatever its metric type (the base of Family<Metric>).
  class FamilyBase;

 private:
  struct CollectorEntry;
  template <typename Metric>
  absl::StatusOr<Family<Metric>*> Add(MetricType type, const std::string& name, const std::string& help,
                                      const std::vector<std::string>& label_names, const std::vector<double>& bounds);
  void RemoveCollector(const std::string& name);

  // Held while collectors run (so removing one waits for a running Render) and while the set of
  // collectors changes. Acquired before mu_.
  absl::Mutex render_mu_;
  absl::Mutex mu_ ABSL_ACQUIRED_AFTER(render_mu_);
  std::map<std::string, std::unique_ptr<FamilyBase>> families_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::shared_ptr<CollectorEntry>> collectors_ ABSL_GUARDED_BY(mu_);
};

// The part of a family the registry renders; Family<Metric> below adds the children.
class MetricsRegistry::FamilyBase {
 public:
  FamilyBase(MetricType type, std::string name, std::string help, std::vector<std::string> label_names,
             std::vector<double> bounds);
  virtual ~FamilyBase() = default;

  MetricType type() const { return type_; }
  const std::string& name() const { return name_; }
  const std::vector<std::string>& label_names() const { return label_names_; }
  const std::vector<double>& bounds() const { return bounds_; }
  const std::string& help() const { return help_; }

  // Appends the sample lines (not HELP/TYPE) of every child.
  virtual void RenderSamples(std::string* out) const = 0;

 private:
  const MetricType type_;
  const std::string name_;
  const std::string help_;
  const std::vector<std::string> label_names_;
  const std::vector<double> bounds_;  // histograms only
};

template <typename Metric>
class Family final : public MetricsRegistry::FamilyBase {
 public:
  using FamilyBase::FamilyBase;

  // The child for `label_values` (one per label name, in order), created at first use with value
  // 0. The pointer stays valid until Remove(label_values) (else as long as the registry).
  // INTERNAL when the number of values is not the number of label names (a bug in the caller).
  absl::StatusOr<Metric*> WithLabels(const std::vector<std::string>& label_values);
  // Drops the child for `label_values` (its series leaves the exposition); false when there was
  // none. Whoever recorded into it must have stopped: its pointer is dangling after.
  bool Remove(const std::vector<std::string>& label_values);
  // Children now (for tests and bounds).
  size_t size() const;

  void RenderSamples(std::string* out) const override;

 private:
  mutable absl::Mutex mu_;
  std::map<std::vector<std::string>, std::unique_ptr<Metric>> children_ ABSL_GUARDED_BY(mu_);
};

// Exposition helpers, public for tests and for the endpoint.
namespace metrics_internal {

// `{a="x",b="y"}` with label values escaped (backslash, double quote, newline); "" when empty.
std::string FormatLabels(const std::vector<std::string>& names, const std::vector<std::string>& values);
// Shortest round-tripping decimal, or `+Inf`, `-Inf`, `NaN`.
std::string FormatValue(double value);

}  // namespace metrics_internal

}  // namespace bertshard::common

#endif  // BERTSHARD_COMMON_METRICS_H_
