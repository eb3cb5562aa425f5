#include "web/run_board.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/common/json.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "web/dashboard_page.h"

namespace strata::web {
namespace {

using google::protobuf::Struct;
using google::protobuf::Value;

const char* const kTiers[] = {"device", "host", "ssd"};
// The per-tier counters of a TIERED step's line, summed over steps: (line field, family).
const std::pair<const char*, const char*> kTierCounters[] = {
    {"hits", "strata_tier_hits_total"},           {"misses", "strata_tier_misses_total"},
    {"bytes_in", "strata_tier_bytes_in_total"},   {"bytes_out", "strata_tier_bytes_out_total"},
    {"evictions", "strata_tier_evictions_total"},
};

const Value* Field(const Struct& s, const char* key) {
  auto it = s.fields().find(key);
  return it == s.fields().end() ? nullptr : &it->second;
}
double Number(const Struct& s, const char* key, double otherwise = 0) {
  const Value* v = Field(s, key);
  return v != nullptr && v->kind_case() == Value::kNumberValue ? v->number_value() : otherwise;
}
bool Has(const Struct& s, const char* key) {
  const Value* v = Field(s, key);
  return v != nullptr && v->kind_case() == Value::kNumberValue;
}

// A double exactly, in the fewest digits that read back to it: a value of the JSONL line prints
// as the line has it.
std::string Num(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  for (int digits = 1; digits < 17; ++digits) {
    std::string s = absl::StrFormat("%.*g", digits, v);
    if (std::strtod(s.c_str(), nullptr) == v) return s;
  }
  return absl::StrFormat("%.17g", v);
}

// The text exposition format: each family's HELP and TYPE once, then its samples together.
class Exposition {
 public:
  void Family(const std::string& name, const char* type, const char* help) {
    absl::StrAppend(&out_, "# HELP ", name, " ", help, "\n# TYPE ", name, " ", type, "\n");
  }
  void Sample(const std::string& name, double value) {
    absl::StrAppend(&out_, name, " ", Num(value), "\n");
  }
  void Sample(const std::string& name, const char* label, const std::string& label_value,
              double value) {
    // Label values here are layer numbers, tier names and a job's name: escape \ " and newline.
    std::string escaped;
    for (char c : label_value) {
      if (c == '\\' || c == '"') escaped += '\\';
      escaped += c == '\n' ? std::string("\\n") : std::string(1, c);
    }
    absl::StrAppend(&out_, name, "{", label, "=\"", escaped, "\"} ", Num(value), "\n");
  }
  std::string Take() { return std::move(out_); }

 private:
  std::string out_;
};

StatusOr<Struct> ParseLine(const std::string& json) {
  Struct s;
  if (const auto st = google::protobuf::util::JsonStringToMessage(json, &s); !st.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("a metrics line is not a JSON object: ", st.ToString()));
  }
  const double step = Number(s, "step", -1);
  if (!(step >= 0 && step == std::floor(step))) {
    return absl::InvalidArgumentError("a metrics line has no whole `step`");
  }
  return s;
}

int64_t UnixMillisNow() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// The coordinator's figures: the membership now and the counts over the job.
void MembershipFamilies(Exposition& e, const coordinator::CoordinatorRecord& r) {
  e.Family("strata_workers", "gauge", "Workers of the current membership generation.");
  e.Sample("strata_workers", r.generation().workers_size());
  e.Family("strata_pending_workers", "gauge",
           "Workers admitted to the next generation (at the next step boundary).");
  e.Sample("strata_pending_workers", r.pending_size());
  e.Family("strata_generation", "gauge", "The current membership generation.");
  e.Sample("strata_generation", static_cast<double>(r.generation().number()));
  e.Family("strata_job_finished", "gauge", "1 once a worker finished the job's last step.");
  e.Sample("strata_job_finished", r.finished() ? 1 : 0);
  e.Family("strata_worker_failures_total", "counter",
           "Members that failed (missed heartbeats, a broken stream), over the job.");
  e.Sample("strata_worker_failures_total", static_cast<double>(r.workers_failed()));
  e.Family("strata_worker_leaves_total", "counter", "Members that left the job.");
  e.Sample("strata_worker_leaves_total", static_cast<double>(r.workers_left()));
  e.Family("strata_worker_joins_total", "counter", "Workers that joined the running job.");
  e.Sample("strata_worker_joins_total", static_cast<double>(r.workers_joined()));
  // The newest re-form whose members all started again.
  for (int i = r.timeline_size() - 1; i >= 0; --i) {
    const coordinator::GenerationEvent& g = r.timeline(i);
    if (g.number() <= 1 || g.started_unix_ms() == 0) continue;
    e.Family("strata_last_reform_seconds", "gauge",
             "The newest re-form: from the generation forming to its last member's start.");
    e.Sample(
        "strata_last_reform_seconds",
        static_cast<double>(std::max<int64_t>(0, g.started_unix_ms() - g.formed_unix_ms())) / 1e3);
    e.Family("strata_last_reform_steps_replayed", "gauge",
             "The newest re-form: steps its generation trains again.");
    e.Sample("strata_last_reform_steps_replayed",
             static_cast<double>(std::max<int64_t>(0, g.boundary_step() - g.first_step())));
    break;
  }
}

void CheckpointFamilies(Exposition& e, const RunBoard::CheckpointList& list) {
  e.Family("strata_checkpoint_list_ok", "gauge",
           "1 when the checkpoint folder could be listed, 0 when not.");
  e.Sample("strata_checkpoint_list_ok", list.error.empty() ? 1 : 0);
  if (!list.error.empty()) return;  // what it holds is not known
  e.Family("strata_checkpoints", "gauge", "Checkpoints the job's folder holds.");
  e.Sample("strata_checkpoints", static_cast<double>(list.rows.size()));
  if (list.rows.empty()) return;
  const RunBoard::CheckpointRow& newest = list.rows.back();
  e.Family("strata_checkpoint_step", "gauge", "The newest checkpoint's step.");
  e.Sample("strata_checkpoint_step", static_cast<double>(newest.step));
  e.Family("strata_checkpoint_age_seconds", "gauge",
           "Seconds since the newest checkpoint was committed.");
  e.Sample("strata_checkpoint_age_seconds",
           std::max(0.0, static_cast<double>(UnixMillisNow() - newest.created_unix_ms) / 1e3));
  e.Family("strata_checkpoint_bytes", "gauge", "Stored bytes the newest checkpoint refers to.");
  e.Sample("strata_checkpoint_bytes", static_cast<double>(newest.bytes));
  if (newest.write_ms >= 0) {
    e.Family("strata_checkpoint_write_seconds", "gauge",
             "The newest checkpoint's time from its snapshot to its commit.");
    e.Sample("strata_checkpoint_write_seconds", static_cast<double>(newest.write_ms) / 1e3);
  }
}

// The job's state: the board's own, or, at a coordinator, its record's.
std::string StateOf(const std::string& state,
                    const std::optional<coordinator::CoordinatorRecord>& record) {
  if (!record || state != "training") return state;
  if (record->finished()) return "finished";
  if (record->generation().workers_size() == 0) {
    return record->generation().number() == 0 ? "waiting for the first workers"
                                              : record->generation().reason();
  }
  return "training";
}

// The membership as /api/status and /api/history give it.
void WriteMembership(JsonWriter& j, const coordinator::CoordinatorRecord& r) {
  j.Key("membership").BeginObject();
  j.Field("generation", r.generation().number())
      .Field("reason", r.generation().reason())
      .Field("first_step", r.generation().first_step())
      .Field("boundary_step", r.step())
      .Field("finished", r.finished());
  j.Key("workers").BeginArray();
  for (int i = 0; i < r.generation().workers_size(); ++i) {
    const coordinator::WorkerInfo& w = r.generation().workers(i);
    j.BeginObject().Field("rank", i).Field("id", w.id()).Field("host", w.host());
    if (i < r.experts_per_worker_size()) j.Field("experts", r.experts_per_worker(i));
    j.EndObject();
  }
  j.EndArray().Key("pending").BeginArray();
  for (const auto& w : r.pending()) j.String(w.id());
  j.EndArray();
  j.Field("workers_failed", r.workers_failed())
      .Field("workers_left", r.workers_left())
      .Field("workers_joined", r.workers_joined());
  if (!r.catalog_error().empty()) j.Field("catalog_error", r.catalog_error());
  j.EndObject();
}

void WriteTimeline(JsonWriter& j, const coordinator::CoordinatorRecord& r) {
  j.Key("timeline").BeginArray();
  for (const coordinator::GenerationEvent& g : r.timeline()) {
    j.BeginObject()
        .Field("generation", g.number())
        .Field("reason", g.reason())
        .Field("formed_unix_ms", g.formed_unix_ms())
        .Field("workers", g.workers())
        .Field("boundary_step", g.boundary_step());
    for (const auto& [key, ids] :
         {std::pair{"joined", &g.joined()}, std::pair{"failed", &g.failed()},
          std::pair{"left", &g.left()}}) {
      j.Key(key).BeginArray();
      for (const std::string& id : *ids) j.String(id);
      j.EndArray();
    }
    if (g.first_step() >= 0) {
      j.Field("first_step", g.first_step())
          .Field("steps_replayed", std::max<int64_t>(0, g.boundary_step() - g.first_step()));
    }
    if (g.started_unix_ms() > 0) {
      j.Field("started_unix_ms", g.started_unix_ms())
          .Field("reform_ms", std::max<int64_t>(0, g.started_unix_ms() - g.formed_unix_ms()));
    }
    j.EndObject();
  }
  j.EndArray();
}

void WriteCheckpoints(JsonWriter& j, const RunBoard::CheckpointList& list) {
  j.Key("checkpoints").BeginObject().Field("dir", list.dir);
  if (!list.error.empty()) j.Field("error", list.error);
  if (!list.note.empty()) j.Field("note", list.note);
  j.Key("list").BeginArray();
  for (const RunBoard::CheckpointRow& c : list.rows) {
    j.BeginObject()
        .Field("step", c.step)
        .Field("created_unix_ms", c.created_unix_ms)
        .Field("bytes", c.bytes)
        .Field("shards", c.shards)
        .Field("checked", c.problem.empty());
    if (c.write_ms >= 0) j.Field("write_ms", c.write_ms);
    if (!c.problem.empty()) j.Field("problem", c.problem);
    j.EndObject();
  }
  j.EndArray().EndObject();
}

}  // namespace

RunBoard::RunBoard(std::string job, int64_t steps, size_t max_points)
    : job_(std::move(job)), steps_(steps), max_points_(std::max<size_t>(max_points, 1)) {}

void RunBoard::Add(Series* series, const Point& p) const {
  series->latest = p;
  // A step that goes back (a generation trains again from a checkpoint) replaces what was kept
  // from it on: the history shows the steps that count.
  while (!series->kept.empty() && series->kept.back().step >= p.step) series->kept.pop_back();
  if (!series->kept.empty() && p.step - series->kept.back().step < series->stride) return;
  series->kept.push_back(p);
  if (series->kept.size() / 2 < max_points_) return;
  std::vector<Point> even;
  even.reserve(series->kept.size() / 2);
  for (size_t i = 0; i < series->kept.size(); i += 2) even.push_back(series->kept[i]);
  series->kept = std::move(even);
  series->stride *= 2;
}

std::vector<RunBoard::Point> RunBoard::Series::Points() const {
  std::vector<Point> points = kept;
  if (latest && (points.empty() || points.back().step != latest->step)) points.push_back(*latest);
  return points;
}

Status RunBoard::AddStepLine(const std::string& json) {
  ASSIGN_OR_RETURN(const Struct s, ParseLine(json));
  Point p;
  p.step = static_cast<int64_t>(Number(s, "step"));
  p.loss = Number(s, "loss");
  p.tokens_per_s = Number(s, "tokens_per_s");
  p.lr = Number(s, "lr");
  if (Has(s, "eval_loss")) {
    p.eval_loss = Number(s, "eval_loss");
    p.eval_bits_per_byte = Number(s, "eval_bits_per_byte", -1);
  }
  const Value* tiers = Field(s, "tiers");
  if (tiers != nullptr) {
    const Struct& t = tiers->struct_value();
    p.stall_ms = Number(s, "stall_ms");
    auto ratio = [&](const char* tier) {
      const Value* v = Field(t, tier);
      if (v == nullptr) return 1.0;
      const double hits = Number(v->struct_value(), "hits");
      const double asked = hits + Number(v->struct_value(), "misses");
      return asked > 0 ? hits / asked : 1.0;
    };
    p.device_hit_ratio = ratio("device");
    p.host_hit_ratio = ratio("host");
    if (const Value* ssd = Field(t, "ssd"); ssd != nullptr) {
      p.ssd_read_gbps = Number(ssd->struct_value(), "read_gbps");
    }
  }
  std::vector<int64_t> blocks;
  std::vector<std::vector<double>> loads;
  double dropped = 0;
  const Value* moe = Field(s, "moe");
  if (moe != nullptr) {
    for (const Value& layer : moe->list_value().values()) {
      const Struct& l = layer.struct_value();
      blocks.push_back(static_cast<int64_t>(Number(l, "layer")));
      dropped += Number(l, "dropped_tokens");
      loads.emplace_back();
      if (const Value* load = Field(l, "load"); load != nullptr) {
        for (const Value& v : load->list_value().values()) loads.back().push_back(v.number_value());
      }
    }
  }
  absl::MutexLock lock(&mu_);
  latest_ = json;
  if (history_.latest && p.step <= history_.latest->step) {
    // The job went back (a generation trains again from a checkpoint): the evaluations of the
    // steps it left behind go too.
    while (!evals_.kept.empty() && evals_.kept.back().step >= p.step) evals_.kept.pop_back();
    if (evals_.latest && evals_.latest->step >= p.step) evals_.latest.reset();
    if (last_eval_.step >= p.step) last_eval_ = Point{};
  }
  Add(&history_, p);
  if (p.eval_loss >= 0) {
    last_eval_ = p;
    Add(&evals_, p);
  }
  counters_.tokens += Number(s, "tokens");
  if (moe != nullptr) {
    for (const Value& layer : moe->list_value().values()) {
      const std::string l = absl::StrCat(Number(layer.struct_value(), "layer"));
      counters_.by_name[absl::StrCat("strata_moe_dropped_tokens_total|", l)] +=
          Number(layer.struct_value(), "dropped_tokens");
    }
    AddLoads(load_, p.step, blocks, loads, dropped);
  }
  if (tiers != nullptr) {
    for (const char* tier : kTiers) {
      const Value* t = Field(tiers->struct_value(), tier);
      if (t == nullptr) continue;
      for (const auto& [field, family] : kTierCounters) {
        counters_.by_name[absl::StrCat(family, "|", tier)] += Number(t->struct_value(), field);
      }
    }
    counters_.by_name["strata_store_stall_seconds_total|"] += Number(s, "stall_ms") / 1e3;
  }
  return absl::OkStatus();
}

void RunBoard::AddLoads(LoadMap& m, int64_t step, const std::vector<int64_t>& blocks,
                        const std::vector<std::vector<double>>& loads, double dropped_tokens) {
  m.dropped_tokens += dropped_tokens;
  bool same_shape = m.blocks == blocks && step >= m.first_step;
  for (size_t l = 0; same_shape && l < loads.size(); ++l) {
    same_shape = m.sums[l].empty() || m.sums[l][0].size() == loads[l].size();
  }
  if (!same_shape) {  // the first step, or another model: start over
    m.blocks = blocks;
    m.first_step = step;
    m.bucket_steps = 1;
    m.sums.assign(blocks.size(), {});
    m.counts.assign(blocks.size(), {});
  }
  size_t column = static_cast<size_t>((step - m.first_step) / m.bucket_steps);
  while (column >= LoadMap::kMaxColumns) {  // merge neighbouring columns
    for (size_t l = 0; l < m.sums.size(); ++l) {
      auto& sums = m.sums[l];
      auto& counts = m.counts[l];
      for (size_t c = 0; 2 * c < sums.size(); ++c) {
        sums[c] = sums[2 * c];
        counts[c] = counts[2 * c];
        if (2 * c + 1 < sums.size()) {
          for (size_t e = 0; e < sums[c].size(); ++e) sums[c][e] += sums[2 * c + 1][e];
          counts[c] += counts[2 * c + 1];
        }
      }
      sums.resize((sums.size() + 1) / 2);
      counts.resize(sums.size());
    }
    m.bucket_steps *= 2;
    column = static_cast<size_t>((step - m.first_step) / m.bucket_steps);
  }
  for (size_t l = 0; l < loads.size(); ++l) {
    const std::vector<double>& load = loads[l];
    double total = 0;
    for (double v : load) total += v;
    if (m.sums[l].size() <= column) {
      m.sums[l].resize(column + 1, std::vector<double>(load.size(), 0.0));
      m.counts[l].resize(column + 1, 0);
    }
    const double mean = total / static_cast<double>(std::max<size_t>(load.size(), 1));
    for (size_t e = 0; e < load.size(); ++e) m.sums[l][column][e] += mean > 0 ? load[e] / mean : 1;
    ++m.counts[l][column];
  }
}

std::vector<double> RunBoard::LoadMap::Column(size_t l, size_t c) const {
  std::vector<double> v = sums.at(l).at(c);
  const int64_t n = counts[l][c];
  for (double& x : v) x = n > 0 ? x / static_cast<double>(n) : 1.0;
  return v;
}

RunBoard::Snapshot RunBoard::Take() const {
  absl::MutexLock lock(&mu_);
  return Snapshot{job_, state_, steps_, history_.Points(), evals_.Points(), load_};
}

void RunBoard::SetState(const std::string& state) {
  absl::MutexLock lock(&mu_);
  state_ = state;
}

void RunBoard::SetRecordSource(std::function<coordinator::CoordinatorRecord()> record) {
  record_source_ = std::move(record);
}

void RunBoard::SetCheckpointSource(std::function<CheckpointList()> list,
                                   std::chrono::milliseconds refresh) {
  checkpoint_source_ = std::move(list);
  checkpoint_refresh_ = refresh;
}

std::optional<coordinator::CoordinatorRecord> RunBoard::Record() const {
  if (!record_source_) return std::nullopt;
  return record_source_();
}

std::optional<RunBoard::CheckpointList> RunBoard::Checkpoints() const {
  if (!checkpoint_source_) return std::nullopt;
  {
    absl::MutexLock lock(&checkpoints_mu_);
    const bool fresh =
        checkpoints_ && std::chrono::steady_clock::now() - checkpoints_at_ < checkpoint_refresh_;
    if (fresh || listing_) return checkpoints_;
    listing_ = true;
  }
  // Listed without the lock: a slow folder holds up no other rendering.
  CheckpointList list = checkpoint_source_();
  absl::MutexLock lock(&checkpoints_mu_);
  listing_ = false;
  checkpoints_ = std::move(list);
  checkpoints_at_ = std::chrono::steady_clock::now();
  return checkpoints_;
}

std::string RunBoard::Prometheus() const {
  // What the rendering needs, copied under the lock; parsed and rendered outside it.
  std::string latest;
  Counters counters;
  Point last_eval;
  {
    absl::MutexLock lock(&mu_);
    latest = latest_;
    counters = counters_;
    last_eval = last_eval_;
  }
  const std::optional<coordinator::CoordinatorRecord> record = Record();
  const std::optional<CheckpointList> checkpoints = Checkpoints();
  Exposition e;
  e.Family("strata_info", "gauge", "The job this process serves (1), by its config's name.");
  e.Sample("strata_info", "name", job_, 1);
  e.Family("strata_steps", "gauge", "Steps the job trains in all (train.steps).");
  e.Sample("strata_steps", static_cast<double>(steps_));
  if (record) MembershipFamilies(e, *record);
  if (checkpoints) CheckpointFamilies(e, *checkpoints);
  if (latest.empty()) return e.Take();
  const StatusOr<Struct> parsed = ParseLine(latest);  // it parsed when it was added
  const Struct& s = *parsed;
  struct Gauge {
    const char* family;
    const char* field;
    double scale;
    const char* help;
  };
  const Gauge gauges[] = {
      {"strata_step", "step", 1, "Steps completed."},
      {"strata_loss", "loss", 1, "The latest step's mean cross-entropy, nats per token."},
      {"strata_aux_loss", "aux_loss", 1, "The latest step's load-balancing loss (unweighted)."},
      {"strata_z_loss", "z_loss", 1, "The latest step's router z-loss (unweighted)."},
      {"strata_grad_norm", "grad_norm", 1, "The latest step's gradient norm, before clipping."},
      {"strata_learning_rate", "lr", 1, "The latest step's learning rate."},
      {"strata_tokens_per_second", "tokens_per_s", 1, "The latest step's tokens per second."},
      {"strata_step_seconds", "step_ms", 1e-3, "The latest step's time, seconds."},
      {"strata_workers", "workers", 1, "Workers training the latest step."},
      {"strata_generation", "generation", 1, "The membership generation of the latest step."},
      {"strata_comm_seconds", "comm_ms", 1e-3, "The latest step's communication time, seconds."},
  };
  for (const Gauge& g : gauges) {
    if (!Has(s, g.field)) continue;
    // A coordinator's membership gauges are its own (above), not the line's.
    if (record && (std::string(g.field) == "workers" || std::string(g.field) == "generation")) {
      continue;
    }
    e.Family(g.family, "gauge", g.help);
    e.Sample(g.family, Number(s, g.field) * g.scale);
  }
  e.Family("strata_tokens_total", "counter", "Tokens trained on (this process's share).");
  e.Sample("strata_tokens_total", counters.tokens);
  if (last_eval.eval_loss >= 0) {
    e.Family("strata_eval_step", "gauge", "The step of the latest held-out evaluation.");
    e.Sample("strata_eval_step", static_cast<double>(last_eval.step));
    e.Family("strata_eval_loss", "gauge", "The latest held-out loss, nats per token.");
    e.Sample("strata_eval_loss", last_eval.eval_loss);
    if (last_eval.eval_bits_per_byte >= 0) {
      e.Family("strata_eval_bits_per_byte", "gauge", "The latest held-out bits per byte.");
      e.Sample("strata_eval_bits_per_byte", last_eval.eval_bits_per_byte);
    }
  }
  if (const Value* moe = Field(s, "moe"); moe != nullptr && moe->list_value().values_size() > 0) {
    const auto& layers = moe->list_value().values();
    const std::pair<const char*, const char*> per_layer[] = {
        {"max_over_mean", "strata_moe_load_max_over_mean"},
        {"cv", "strata_moe_load_cv"},
        {"dropped_tokens", "strata_moe_dropped_tokens"},
        {"capacity", "strata_moe_capacity"},
    };
    const char* help[] = {
        "The latest step's busiest expert's load over the mean load, per MoE layer (1 = even).",
        "The latest step's coefficient of variation of the experts' loads, per MoE layer.",
        "Tokens of the latest step that reached no expert, per MoE layer.",
        "The latest step's expert capacity (rows per expert), per MoE layer.",
    };
    for (size_t f = 0; f < std::size(per_layer); ++f) {
      e.Family(per_layer[f].second, "gauge", help[f]);
      for (const Value& layer : layers) {
        const Struct& l = layer.struct_value();
        e.Sample(per_layer[f].second, "layer", absl::StrCat(Number(l, "layer")),
                 Number(l, per_layer[f].first));
      }
    }
    e.Family("strata_moe_dropped_tokens_total", "counter",
             "Tokens that reached no expert, per MoE layer, over every step.");
    for (const Value& layer : layers) {
      const std::string l = absl::StrCat(Number(layer.struct_value(), "layer"));
      auto it = counters.by_name.find(absl::StrCat("strata_moe_dropped_tokens_total|", l));
      e.Sample("strata_moe_dropped_tokens_total", "layer", l,
               it == counters.by_name.end() ? 0 : it->second);
    }
  }
  if (const Value* tiers = Field(s, "tiers"); tiers != nullptr) {
    const Struct& t = tiers->struct_value();
    for (const auto& [field, family] : kTierCounters) {
      e.Family(family, "counter",
               absl::StrCat("The tiered store's ", field, " per tier, over every step.").c_str());
      for (const char* tier : kTiers) {
        if (Field(t, tier) == nullptr) continue;
        e.Sample(family, "tier", tier, counters.by_name.at(absl::StrCat(family, "|", tier)));
      }
    }
    e.Family("strata_tier_hit_ratio", "gauge",
             "The latest step's hits over hits and misses, per tier (1 when nothing was asked).");
    for (const char* tier : kTiers) {
      if (const Value* v = Field(t, tier); v != nullptr) {
        const double hits = Number(v->struct_value(), "hits");
        const double asked = hits + Number(v->struct_value(), "misses");
        e.Sample("strata_tier_hit_ratio", "tier", tier, asked > 0 ? hits / asked : 1.0);
      }
    }
    for (const auto& [field, family] : {std::pair{"used_bytes", "strata_tier_used_bytes"},
                                        std::pair{"budget_bytes", "strata_tier_budget_bytes"}}) {
      e.Family(family, "gauge",
               absl::StrCat("The tier's ", field, " after the latest step.").c_str());
      for (const char* tier : kTiers) {
        if (const Value* v = Field(t, tier); v != nullptr) {
          e.Sample(family, "tier", tier, Number(v->struct_value(), field));
        }
      }
    }
    if (const Value* ssd = Field(t, "ssd"); ssd != nullptr) {
      e.Family("strata_ssd_read_gbps", "gauge", "The latest step's SSD read speed, GB/s.");
      e.Sample("strata_ssd_read_gbps", Number(ssd->struct_value(), "read_gbps"));
      e.Family("strata_ssd_write_gbps", "gauge", "The latest step's SSD write speed, GB/s.");
      e.Sample("strata_ssd_write_gbps", Number(ssd->struct_value(), "write_gbps"));
    }
    e.Family("strata_store_stall_seconds", "gauge",
             "The latest step's time compute waited for the tiered store, seconds.");
    e.Sample("strata_store_stall_seconds", Number(s, "stall_ms") / 1e3);
    e.Family("strata_store_stall_seconds_total", "counter",
             "Time compute waited for the tiered store, seconds, over every step.");
    e.Sample("strata_store_stall_seconds_total",
             counters.by_name.at("strata_store_stall_seconds_total|"));
  }
  return e.Take();
}

std::string RunBoard::StatusJson() const {
  const std::optional<coordinator::CoordinatorRecord> record = Record();
  const std::optional<CheckpointList> checkpoints = Checkpoints();
  absl::MutexLock lock(&mu_);
  JsonWriter j;
  j.BeginObject().Field("job", job_).Field("state", StateOf(state_, record)).Field("steps", steps_);
  if (history_.latest) {
    const Point& p = *history_.latest;
    j.Field("step", p.step).Field("loss", p.loss).Field("tokens_per_s", p.tokens_per_s);
    j.Field("lr", p.lr);
  } else if (record) {
    j.Field("step", record->step()).Field("loss", record->loss());
  } else {
    j.Field("step", int64_t{0});
  }
  if (record) WriteMembership(j, *record);
  if (checkpoints) WriteCheckpoints(j, *checkpoints);
  if (last_eval_.eval_loss >= 0) {
    j.Field("eval_step", last_eval_.step).Field("eval_loss", last_eval_.eval_loss);
  }
  if (!latest_.empty()) {
    const StatusOr<Struct> s = ParseLine(latest_);
    if (Has(*s, "workers") && !record) {
      j.Field("workers", static_cast<int64_t>(Number(*s, "workers")));
      j.Field("generation", static_cast<int64_t>(Number(*s, "generation")));
    }
  }
  j.EndObject();
  return j.str();
}

std::string RunBoard::HistoryJson() const {
  const Snapshot run = Take();  // rendered outside the lock the training thread takes
  const std::optional<coordinator::CoordinatorRecord> record = Record();
  const std::optional<CheckpointList> checkpoints = Checkpoints();
  const LoadMap& load = run.load;
  JsonWriter j;
  j.BeginObject().Field("job", job_).Field("state", StateOf(run.state, record));
  j.Field("steps", steps_).Field("now_unix_ms", UnixMillisNow());
  if (record) {
    WriteMembership(j, *record);
    WriteTimeline(j, *record);
  }
  if (checkpoints) WriteCheckpoints(j, *checkpoints);
  j.Key("evals").BeginArray();
  for (const Point& p : run.evals) {
    j.BeginObject().Field("step", p.step).Field("eval_loss", p.eval_loss);
    if (p.eval_bits_per_byte >= 0) j.Field("eval_bits_per_byte", p.eval_bits_per_byte);
    j.EndObject();
  }
  j.EndArray();
  j.Key("points").BeginArray();
  for (const Point& p : run.points) {
    j.BeginObject()
        .Field("step", p.step)
        .Field("loss", p.loss)
        .Field("tokens_per_s", p.tokens_per_s)
        .Field("lr", p.lr);
    if (p.eval_loss >= 0) j.Field("eval_loss", p.eval_loss);
    if (p.eval_bits_per_byte >= 0) j.Field("eval_bits_per_byte", p.eval_bits_per_byte);
    if (p.stall_ms >= 0) {
      j.Field("stall_ms", p.stall_ms)
          .Field("ssd_read_gbps", p.ssd_read_gbps)
          .Field("device_hit_ratio", p.device_hit_ratio)
          .Field("host_hit_ratio", p.host_hit_ratio);
    }
    j.EndObject();
  }
  j.EndArray();
  if (!load.blocks.empty()) {
    j.Key("load").BeginObject();
    j.Field("first_step", load.first_step)
        .Field("bucket_steps", load.bucket_steps)
        .Field("dropped_tokens", load.dropped_tokens);
    j.Key("layers").BeginArray();
    for (size_t l = 0; l < load.blocks.size(); ++l) {
      j.BeginObject().Field("layer", load.blocks[l]).Key("buckets").BeginArray();
      for (size_t c = 0; c < load.sums[l].size(); ++c) {
        j.BeginArray();
        for (double v : load.Column(l, c)) j.Double(v, 4);
        j.EndArray();
      }
      j.EndArray().EndObject();
    }
    j.EndArray().EndObject();
  }
  j.EndObject();
  return j.str();
}

std::map<std::string, HttpHandler> RunBoard::Routes() const {
  auto text = [](std::string body, const char* type) {
    HttpResponse r;
    r.content_type = type;
    r.body = std::move(body);
    return r;
  };
  return {
      {"/",
       [text](const HttpRequest&) { return text(DashboardPage(), "text/html; charset=utf-8"); }},
      {"/metrics",
       [this, text](const HttpRequest&) {
         return text(Prometheus(), "text/plain; version=0.0.4; charset=utf-8");
       }},
      {"/api/status",
       [this, text](const HttpRequest&) { return text(StatusJson(), "application/json"); }},
      {"/api/history",
       [this, text](const HttpRequest&) { return text(HistoryJson(), "application/json"); }},
  };
}

}  // namespace strata::web
