#include "common/metrics.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <type_traits>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace bertshard::common {

void Counter::Increment(double amount) {
  if (!(amount > 0)) return;  // also drops NaN
  double current = value_.load(std::memory_order_relaxed);
  while (!value_.compare_exchange_weak(current, current + amount, std::memory_order_relaxed)) {
  }
}

void Gauge::Add(double amount) {
  double current = value_.load(std::memory_order_relaxed);
  while (!value_.compare_exchange_weak(current, current + amount, std::memory_order_relaxed)) {
  }
}

Histogram::Histogram(const std::vector<double>* bounds) : bounds_(bounds), counts_(bounds->size() + 1, 0) {}

void Histogram::Observe(double value) {
  // NaN compares false with every bound, so it lands in +Inf (as in the Go client).
  const size_t bucket =
      std::find_if(bounds_->begin(), bounds_->end(), [value](double bound) { return value <= bound; }) -
      bounds_->begin();
  absl::MutexLock lock(&mu_);
  ++counts_[bucket];
  sum_ += value;
}

Histogram::Snapshot Histogram::Read() const {
  Snapshot snapshot;
  absl::MutexLock lock(&mu_);
  uint64_t running = 0;
  for (uint64_t c : counts_) {
    running += c;
    snapshot.cumulative.push_back(running);
  }
  snapshot.count = running;
  snapshot.sum = sum_;
  return snapshot;
}

namespace metrics_internal {

std::string FormatValue(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
  char buffer[32];
  const auto result = std::to_chars(buffer, buffer + sizeof(buffer), value);
  return std::string(buffer, result.ptr);
}

std::string FormatLabels(const std::vector<std::string>& names, const std::vector<std::string>& values) {
  if (names.empty()) return "";
  std::string out = "{";
  for (size_t i = 0; i < names.size(); ++i) {
    if (i > 0) out += ',';
    absl::StrAppend(&out, names[i], "=\"");
    for (char c : values[i]) {
      switch (c) {
        case '\\':
          out += "\\\\";
          break;
        case '"':
          out += "\\\"";
          break;
        case '\n':
          out += "\\n";
          break;
        default:
          out += c;
      }
    }
    out += '"';
  }
  out += '}';
  return out;
}

}  // namespace metrics_internal

namespace {

using metrics_internal::FormatLabels;
using metrics_internal::FormatValue;

bool IsMetricName(const std::string& name) {
  if (name.empty()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool letter = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':';
    if (!letter && !(i > 0 && c >= '0' && c <= '9')) return false;
  }
  return true;
}

bool IsLabelName(const std::string& name) {
  if (name.empty() || absl::StartsWith(name, "__")) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool letter = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
    if (!letter && !(i > 0 && c >= '0' && c <= '9')) return false;
  }
  return true;
}

const char* TypeName(MetricType type) {
  switch (type) {
    case MetricType::kCounter:
      return "counter";
    case MetricType::kGauge:
      return "gauge";
    case MetricType::kHistogram:
      return "histogram";
  }
  return "untyped";
}

absl::Status CheckFamily(MetricType type, const std::string& name, const std::vector<std::string>& label_names,
                         const std::vector<double>& bounds) {
  if (!IsMetricName(name)) {
    return absl::InvalidArgumentError(
        absl::StrCat("metric name '", name, "' is not [a-zA-Z_:][a-zA-Z0-9_:]* (e.g. bertshard_requests_total)"));
  }
  if (type == MetricType::kCounter && !absl::EndsWith(name, "_total")) {
    return absl::InvalidArgumentError(absl::StrCat("counter name '", name, "' must end in _total"));
  }
  for (size_t i = 0; i < label_names.size(); ++i) {
    const std::string& label = label_names[i];
    if (!IsLabelName(label)) {
      return absl::InvalidArgumentError(
          absl::StrCat("label name '", label, "' of ", name, " is not [a-zA-Z_][a-zA-Z0-9_]* or starts with __"));
    }
    if (std::find(label_names.begin(), label_names.begin() + i, label) != label_names.begin() + i) {
      return absl::InvalidArgumentError(absl::StrCat("label name '", label, "' appears twice in ", name));
    }
    if (type == MetricType::kHistogram && label == "le") {
      return absl::InvalidArgumentError(absl::StrCat("histogram ", name, " cannot have a label named le"));
    }
  }
  for (size_t i = 0; i < bounds.size(); ++i) {
    if (!std::isfinite(bounds[i]) || (i > 0 && !(bounds[i] > bounds[i - 1]))) {
      return absl::InvalidArgumentError(absl::StrCat("bucket bounds of ", name,
                                                     " must be finite and strictly "
                                                     "increasing (+Inf is implicit); got ",
                                                     absl::StrJoin(bounds, ", ")));
    }
  }
  return absl::OkStatus();
}

std::string EscapeHelp(const std::string& help) {
  std::string out;
  for (char c : help) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

void AppendHeader(const std::string& name, const std::string& help, MetricType type, std::string* out) {
  absl::StrAppend(out, "# HELP ", name, " ", EscapeHelp(help), "\n# TYPE ", name, " ", TypeName(type), "\n");
}

}  // namespace

MetricsRegistry::FamilyBase::FamilyBase(MetricType type, std::string name, std::string help,
                                        std::vector<std::string> label_names, std::vector<double> bounds)
    : type_(type),
      name_(std::move(name)),
      help_(std::move(help)),
      label_names_(std::move(label_names)),
      bounds_(std::move(bounds)) {}

template <typename Metric>
absl::StatusOr<Metric*> Family<Metric>::WithLabels(const std::vector<std::string>& label_values) {
  if (label_values.size() != label_names().size()) {
    return absl::InternalError(absl::StrCat(name(), " has ", label_names().size(), " labels (",
                                            absl::StrJoin(label_names(), ", "), "); got ", label_values.size(),
                                            " values"));
  }
  absl::MutexLock lock(&mu_);
  std::unique_ptr<Metric>& child = children_[label_values];
  if (child == nullptr) {
    if constexpr (std::is_same_v<Metric, Histogram>) {
      child = std::make_unique<Histogram>(&bounds());
    } else {
      child = std::make_unique<Metric>();
    }
  }
  return child.get();
}

template <typename Metric>
bool Family<Metric>::Remove(const std::vector<std::string>& label_values) {
  absl::MutexLock lock(&mu_);
  return children_.erase(label_values) > 0;
}

template <typename Metric>
size_t Family<Metric>::size() const {
  absl::MutexLock lock(&mu_);
  return children_.size();
}

template <typename Metric>
void Family<Metric>::RenderSamples(std::string* out) const {
  absl::MutexLock lock(&mu_);
  for (const auto& [values, child] : children_) {
    if constexpr (std::is_same_v<Metric, Histogram>) {
      const Histogram::Snapshot snapshot = child->Read();
      std::vector<std::string> names = label_names();
      names.push_back("le");
      std::vector<std::string> with_le = values;
      with_le.push_back("");
      for (size_t i = 0; i < snapshot.cumulative.size(); ++i) {
        with_le.back() = i < bounds().size() ? FormatValue(bounds()[i]) : "+Inf";
        absl::StrAppend(out, name(), "_bucket", FormatLabels(names, with_le), " ", snapshot.cumulative[i], "\n");
      }
      const std::string labels = FormatLabels(label_names(), values);
      absl::StrAppend(out, name(), "_sum", labels, " ", FormatValue(snapshot.sum), "\n");
      absl::StrAppend(out, name(), "_count", labels, " ", snapshot.count, "\n");
    } else {
      absl::StrAppend(out, name(), FormatLabels(label_names(), values), " ", FormatValue(child->Value()), "\n");
    }
  }
}

template class Family<Counter>;
template class Family<Gauge>;
template class Family<Histogram>;

struct MetricsRegistry::CollectorEntry {
  MetricType type;
  std::string name;
  std::string help;
  std::vector<std::string> label_names;
  Collector collect;
};

MetricsRegistry::MetricsRegistry() = default;
MetricsRegistry::~MetricsRegistry() = default;

template <typename Metric>
absl::StatusOr<Family<Metric>*> MetricsRegistry::Add(MetricType type, const std::string& name, const std::string& help,
                                                     const std::vector<std::string>& label_names,
                                                     const std::vector<double>& bounds) {
  if (absl::Status s = CheckFamily(type, name, label_names, bounds); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  if (collectors_.count(name)) {
    return absl::AlreadyExistsError(absl::StrCat("metric ", name, " is already registered as a collector"));
  }
  auto it = families_.find(name);
  if (it != families_.end()) {
    FamilyBase* existing = it->second.get();
    if (existing->type() != type || existing->label_names() != label_names || existing->bounds() != bounds) {
      return absl::AlreadyExistsError(absl::StrCat("metric ", name, " is already registered as a ",
                                                   TypeName(existing->type()), " with labels (",
                                                   absl::StrJoin(existing->label_names(), ", "), ")"));
    }
    return static_cast<Family<Metric>*>(existing);
  }
  auto family = std::make_unique<Family<Metric>>(type, name, help, label_names, bounds);
  Family<Metric>* raw = family.get();
  // A family without labels has exactly one child: show it (as 0) from the start.
  if (label_names.empty()) {
    if (auto child = raw->WithLabels({}); !child.ok()) return child.status();
  }
  families_.emplace(name, std::move(family));
  return raw;
}

absl::StatusOr<CounterFamily*> MetricsRegistry::AddCounter(const std::string& name, const std::string& help,
                                                           const std::vector<std::string>& label_names) {
  return Add<Counter>(MetricType::kCounter, name, help, label_names, {});
}

absl::StatusOr<GaugeFamily*> MetricsRegistry::AddGauge(const std::string& name, const std::string& help,
                                                       const std::vector<std::string>& label_names) {
  return Add<Gauge>(MetricType::kGauge, name, help, label_names, {});
}

absl::StatusOr<HistogramFamily*> MetricsRegistry::AddHistogram(const std::string& name, const std::string& help,
                                                               const std::vector<std::string>& label_names,
                                                               const std::vector<double>& bounds) {
  return Add<Histogram>(MetricType::kHistogram, name, help, label_names, bounds);
}

absl::StatusOr<MetricsRegistry::CollectorHandle> MetricsRegistry::AddCollector(
    MetricType type, const std::string& name, const std::string& help, const std::vector<std::string>& label_names,
    Collector collect) {
  if (type == MetricType::kHistogram) {
    return absl::InvalidArgumentError(absl::StrCat("collector ", name, " must be a counter or a gauge"));
  }
  if (absl::Status s = CheckFamily(type, name, label_names, {}); !s.ok()) return s;
  absl::MutexLock render_lock(&render_mu_);
  absl::MutexLock lock(&mu_);
  if (families_.count(name) || collectors_.count(name)) {
    return absl::AlreadyExistsError(absl::StrCat("metric ", name, " is already registered"));
  }
  collectors_.emplace(
      name, std::make_shared<CollectorEntry>(CollectorEntry{type, name, help, label_names, std::move(collect)}));
  return CollectorHandle(this, name);
}

void MetricsRegistry::RemoveCollector(const std::string& name) {
  absl::MutexLock render_lock(&render_mu_);
  absl::MutexLock lock(&mu_);
  collectors_.erase(name);
}

MetricsRegistry::CollectorHandle::CollectorHandle(CollectorHandle&& other) noexcept
    : registry_(std::exchange(other.registry_, nullptr)), name_(std::move(other.name_)) {}

MetricsRegistry::CollectorHandle& MetricsRegistry::CollectorHandle::operator=(CollectorHandle&& other) noexcept {
  if (this != &other) {
    if (registry_ != nullptr) registry_->RemoveCollector(name_);
    registry_ = std::exchange(other.registry_, nullptr);
    name_ = std::move(other.name_);
  }
  return *this;
}

MetricsRegistry::CollectorHandle::~CollectorHandle() {
  if (registry_ != nullptr) registry_->RemoveCollector(name_);
}

std::string MetricsRegistry::Render() {
  // Collectors read other components' state under those components' locks: call them with
  // render_mu_ only, never with mu_, so a component may record metrics while holding its lock.
  absl::MutexLock render_lock(&render_mu_);
  std::map<std::string, const FamilyBase*> families;
  std::map<std::string, std::shared_ptr<CollectorEntry>> collectors;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [name, family] : families_) families.emplace(name, family.get());
    collectors = collectors_;
  }
  std::map<std::string, std::string> sections;  // by name, so the output is sorted
  for (const auto& [name, family] : families) {
    std::string& out = sections[name];
    AppendHeader(name, family->help(), family->type(), &out);
    family->RenderSamples(&out);
  }
  for (const auto& [name, entry] : collectors) {
    std::string& out = sections[name];
    AppendHeader(name, entry->help, entry->type, &out);
    absl::StatusOr<std::vector<Sample>> samples = entry->collect();
    if (samples.ok()) {
      auto wrong = std::find_if(samples->begin(), samples->end(),
                                [&](const Sample& s) { return s.label_values.size() != entry->label_names.size(); });
      if (wrong != samples->end()) {
        samples = absl::InternalError(absl::StrCat("a sample has ", wrong->label_values.size(), " label values for ",
                                                   entry->label_names.size(), " labels"));
      }
    }
    if (!samples.ok()) {
      // A comment, not a sample: parsers skip it, and a reader of the page sees why it is empty.
      std::string why = samples.status().ToString();
      std::replace(why.begin(), why.end(), '\n', ' ');
      absl::StrAppend(&out, "# collecting ", name, " failed: ", why, "\n");
      continue;
    }
    std::sort(samples->begin(), samples->end(),
              [](const Sample& a, const Sample& b) { return a.label_values < b.label_values; });
    for (const Sample& s : *samples) {
      absl::StrAppend(&out, name, FormatLabels(entry->label_names, s.label_values), " ", FormatValue(s.value), "\n");
    }
  }
  std::string out;
  for (const auto& [name, section] : sections) out += section;
  return out;
}

}  // namespace bertshard::common
