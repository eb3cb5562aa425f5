#include "web/run_board.h"

#include <cmath>
#include <cstdlib>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/common/json.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"

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

}  // namespace

RunBoard::RunBoard(std::string job, int64_t steps) : job_(std::move(job)), steps_(steps) {}

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
  absl::MutexLock lock(&mu_);
  latest_ = json;
  history_.push_back(p);
  if (p.eval_loss >= 0) last_eval_ = p;
  counters_.tokens += Number(s, "tokens");
  if (const Value* moe = Field(s, "moe"); moe != nullptr) {
    for (const Value& layer : moe->list_value().values()) {
      const std::string l = absl::StrCat(Number(layer.struct_value(), "layer"));
      counters_.by_name[absl::StrCat("strata_moe_dropped_tokens_total|", l)] +=
          Number(layer.struct_value(), "dropped_tokens");
    }
  }
  if (const Value* tiers = Field(s, "tiers"); tiers != nullptr) {
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

void RunBoard::SetState(const std::string& state) {
  absl::MutexLock lock(&mu_);
  state_ = state;
}

std::string RunBoard::Prometheus() const {
  absl::MutexLock lock(&mu_);
  Exposition e;
  e.Family("strata_info", "gauge", "The job this process trains (1), by its config's name.");
  e.Sample("strata_info", "job", job_, 1);
  e.Family("strata_steps", "gauge", "Steps the job trains in all (train.steps).");
  e.Sample("strata_steps", static_cast<double>(steps_));
  if (latest_.empty()) return e.Take();
  const StatusOr<Struct> parsed = ParseLine(latest_);  // it parsed when it was added
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
    e.Family(g.family, "gauge", g.help);
    e.Sample(g.family, Number(s, g.field) * g.scale);
  }
  e.Family("strata_tokens_total", "counter", "Tokens trained on (this process's share).");
  e.Sample("strata_tokens_total", counters_.tokens);
  if (last_eval_.eval_loss >= 0) {
    e.Family("strata_eval_step", "gauge", "The step of the latest held-out evaluation.");
    e.Sample("strata_eval_step", static_cast<double>(last_eval_.step));
    e.Family("strata_eval_loss", "gauge", "The latest held-out loss, nats per token.");
    e.Sample("strata_eval_loss", last_eval_.eval_loss);
    if (last_eval_.eval_bits_per_byte >= 0) {
      e.Family("strata_eval_bits_per_byte", "gauge", "The latest held-out bits per byte.");
      e.Sample("strata_eval_bits_per_byte", last_eval_.eval_bits_per_byte);
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
      auto it = counters_.by_name.find(absl::StrCat("strata_moe_dropped_tokens_total|", l));
      e.Sample("strata_moe_dropped_tokens_total", "layer", l,
               it == counters_.by_name.end() ? 0 : it->second);
    }
  }
  if (const Value* tiers = Field(s, "tiers"); tiers != nullptr) {
    const Struct& t = tiers->struct_value();
    for (const auto& [field, family] : kTierCounters) {
      e.Family(family, "counter",
               absl::StrCat("The tiered store's ", field, " per tier, over every step.").c_str());
      for (const char* tier : kTiers) {
        if (Field(t, tier) == nullptr) continue;
        e.Sample(family, "tier", tier, counters_.by_name.at(absl::StrCat(family, "|", tier)));
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
             counters_.by_name.at("strata_store_stall_seconds_total|"));
  }
  return e.Take();
}

std::string RunBoard::StatusJson() const {
  absl::MutexLock lock(&mu_);
  JsonWriter j;
  j.BeginObject().Field("job", job_).Field("state", state_).Field("steps", steps_);
  if (!history_.empty()) {
    const Point& p = history_.back();
    j.Field("step", p.step).Field("loss", p.loss).Field("tokens_per_s", p.tokens_per_s);
    j.Field("lr", p.lr);
  } else {
    j.Field("step", int64_t{0});
  }
  if (last_eval_.eval_loss >= 0) {
    j.Field("eval_step", last_eval_.step).Field("eval_loss", last_eval_.eval_loss);
  }
  if (!latest_.empty()) {
    const StatusOr<Struct> s = ParseLine(latest_);
    if (Has(*s, "workers")) {
      j.Field("workers", static_cast<int64_t>(Number(*s, "workers")));
      j.Field("generation", static_cast<int64_t>(Number(*s, "generation")));
    }
  }
  j.EndObject();
  return j.str();
}

std::string RunBoard::HistoryJson() const {
  absl::MutexLock lock(&mu_);
  JsonWriter j;
  j.BeginObject().Field("job", job_).Field("steps", steps_);
  j.Key("points").BeginArray();
  for (const Point& p : history_) {
    j.BeginObject()
        .Field("step", p.step)
        .Field("loss", p.loss)
        .Field("tokens_per_s", p.tokens_per_s)
        .Field("lr", p.lr);
    if (p.eval_loss >= 0) j.Field("eval_loss", p.eval_loss);
    if (p.eval_bits_per_byte >= 0) j.Field("eval_bits_per_byte", p.eval_bits_per_byte);
    j.EndObject();
  }
  j.EndArray().EndObject();
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
