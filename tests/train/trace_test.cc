// --trace: a Chrome trace-event JSON with compute, SSD I/O, copy and optimizer spans that agree
// with what the step did.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <vector>

#include "absl/strings/str_cat.h"

#include "proto/config_io.h"
#include "tests/test_util.h"
#include "train/trainer.h"

namespace strata::train {
namespace {

using strata::testing::ReadFile;
using strata::testing::RunCommand;
using strata::testing::TempDir;
using strata::testing::WriteFile;

struct Span {
  std::string name;
  double start, end;
};

// The complete spans of a trace written by Tracer::Write (one event per line), by start time.
std::vector<Span> Spans(const std::string& json) {
  std::vector<Span> out;
  auto field = [](const std::string& line, const std::string& key) {
    const size_t p = line.find("\"" + key + "\":");
    if (p == std::string::npos) return std::string();
    size_t b = p + key.size() + 3;
    if (line[b] == '"') {
      ++b;
      return line.substr(b, line.find('"', b) - b);
    }
    return line.substr(b, line.find_first_of(",}", b) - b);
  };
  size_t pos = 0;
  while (pos < json.size()) {
    size_t eol = json.find('\n', pos);
    if (eol == std::string::npos) eol = json.size();
    const std::string line = json.substr(pos, eol - pos);
    pos = eol + 1;
    if (field(line, "ph") != "X") continue;
    const double ts = std::stod(field(line, "ts")), dur = std::stod(field(line, "dur"));
    out.push_back(Span{field(line, "name"), ts, ts + dur});
  }
  std::sort(out.begin(), out.end(), [](const Span& a, const Span& b) { return a.start < b.start; });
  return out;
}

bool StartsWith(const std::string& s, const std::string& prefix) {
  return s.compare(0, prefix.size(), prefix) == 0;
}

size_t Count(const std::string& text, const std::string& needle) {
  size_t n = 0;
  for (size_t p = text.find(needle); p != std::string::npos; p = text.find(needle, p + 1)) ++n;
  return n;
}

TEST(TraceTest, SpansMatchTheStepsAndTheFileIsValidJson) {
  TempDir dir;
  WriteFile(dir.File("text.txt"), strata::testing::SyntheticText(20000));
  auto cfg = config::ParseJobConfig(
      R"pb(
        seed: 3
        model {
          seq_len: 16
          d_model: 32
          n_layers: 2
          n_heads: 2
          moe { num_experts: 8 top_k: 2 d_expert: 32 }
        }
        data { path: "x" }
        train { steps: 3 global_batch: 4 eval_every: 0 eval_batches: 1 threads: 2 }
        storage { mode: TIERED io_block_bytes: 8192 }
      )pb",
      "trace.textproto", "");
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  cfg->mutable_data()->set_path(dir.File("text.txt"));
  // Budgets that force the SSD tier: 1 expert's weights are 2*32*32+32+32 floats.
  const uint64_t slot = ((2 * 32 * 32 + 64) * 4 + 4095) / 4096 * 4096;
  TrainOptions o;
  o.config = *cfg;
  o.progress = false;
  o.trace_path = dir.File("trace.json");
  {
    auto probe = Trainer::Create(o);
    ASSERT_TRUE(probe.ok()) << probe.status();
    const uint64_t dense = model::CountScalars((*probe)->model().DenseParameters()) * 16;
    o.config.mutable_storage()->set_device_budget_bytes(dense + 6 * slot);
    o.config.mutable_storage()->set_host_budget_bytes(12 * slot);
  }
  auto t = Trainer::Create(o);
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_TRUE((*t)->Run().ok());

  const std::string json = ReadFile(dir.File("trace.json"));
  auto parse = RunCommand(
      "python3 -c \"import json,sys; j=json.load(open(sys.argv[1])); "
      "print(len(j['traceEvents']))\" " +
      dir.File("trace.json"));
  ASSERT_EQ(parse.exit_code, 0) << "not valid JSON: " << parse.output;

  // Every expert that got tokens ran forward and backward once per step, on some compute thread;
  // the final evaluation (one batch, the model's last forward) ran forward only.
  int routed = 0, eval_routed = 0;
  for (const StepResult& r : (*t)->history()) {
    for (const model::MoeStats& s : r.moe) {
      for (int64_t load : s.load) routed += load > 0;
    }
  }
  for (const auto& ref : (*t)->model().moe_layers()) {
    for (int64_t load : ref.layer->stats().load) eval_routed += load > 0;
  }
  EXPECT_EQ(Count(json, "\"expert fwd L"), static_cast<size_t>(routed + eval_routed));
  EXPECT_EQ(Count(json, "\"expert bwd L"), static_cast<size_t>(routed));
  // DENSE: every expert takes an optimizer step every step.
  EXPECT_EQ(Count(json, "\"adamw L"), 3u * 2u * 8u);
  EXPECT_EQ(Count(json, "\"step "), 3u);
  EXPECT_EQ(Count(json, "\"forward block 0\""), 3u + 1u);
  EXPECT_EQ(Count(json, "\"backward block 1\""), 3u);
  // The SSD and copy stages are their own tracks, with as many reads and writes as the store
  // counted (bytes_in: into the tier, written; bytes_out: read out of it).
  uint64_t ssd_reads = 0, ssd_writes = 0;
  for (const StepResult& r : (*t)->history()) {
    ssd_reads += r.store.ssd.bytes_out;
    ssd_writes += r.store.ssd.bytes_in;
  }
  // What the stages did after the last step (prefetching for a step that did not come).
  const storage::StoreStats rest = (*t)->tiered()->store().TakeStats();
  ssd_reads += rest.ssd.bytes_out;
  ssd_writes += rest.ssd.bytes_in;
  ASSERT_GT(ssd_reads, 0u) << "the budgets should have forced SSD traffic";
  EXPECT_EQ(Count(json, "\"ssd_read L") * slot, ssd_reads);
  EXPECT_EQ(Count(json, "\"ssd_write L") * slot, ssd_writes);
  EXPECT_GT(Count(json, "\"h2d_copy L"), 0u);
  EXPECT_GT(Count(json, "\"d2h_copy L"), 0u);
  EXPECT_NE(json.find("\"name\":\"ssd stage\""), std::string::npos);
  EXPECT_NE(json.find("\"name\":\"copy stage\""), std::string::npos);
  EXPECT_NE(json.find("\"name\":\"compute 1\""), std::string::npos);

  // The experts' update of step t runs behind the forward of step t+1 (overlap_optimizer), but
  // never ahead of it: every expert of block b is updated before any expert of block b computes
  // in the next forward.
  const std::vector<Span> spans = Spans(json);
  for (int b = 0; b < 2; ++b) {
    const std::string block = absl::StrCat("forward block ", b);
    const std::string adamw = absl::StrCat("adamw L", b, " ");
    const std::string fwd = absl::StrCat("expert fwd L", b, " ");
    std::vector<const Span*> forwards, updates;
    for (const Span& s : spans) {
      if (s.name == block) forwards.push_back(&s);
      if (StartsWith(s.name, adamw)) updates.push_back(&s);
    }
    ASSERT_EQ(forwards.size(), 4u);      // 3 steps and the final evaluation
    ASSERT_EQ(updates.size(), 3u * 8u);  // 8 experts per step
    for (int t = 0; t < 3; ++t) {
      double updated = 0;
      for (int k = 0; k < 8; ++k) updated = std::max(updated, updates[8 * t + k]->end);
      const Span& next = *forwards[t + 1];
      int computed = 0;
      for (const Span& s : spans) {
        if (!StartsWith(s.name, fwd) || s.start < next.start || s.start > next.end) continue;
        ++computed;
        EXPECT_GE(s.start, updated) << s.name << " of forward " << t + 2
                                    << " started before the update of step " << t + 1 << " ended";
      }
      EXPECT_GT(computed, 0) << "forward " << t + 2 << " of block " << b;
    }
  }
}

TEST(TraceTest, UnwritablePathIsAClearError) {
  TempDir dir;
  WriteFile(dir.File("text.txt"), strata::testing::SyntheticText(20000));
  auto cfg = config::ParseJobConfig(
      "model { seq_len: 16 d_model: 16 n_layers: 1 n_heads: 2 moe { num_experts: 2 d_expert: 16 "
      "} } data { path: \"x\" } train { steps: 1 global_batch: 2 eval_every: 0 eval_batches: 1 "
      "threads: 1 }",
      "t.textproto", "");
  ASSERT_TRUE(cfg.ok());
  cfg->mutable_data()->set_path(dir.File("text.txt"));
  TrainOptions o;
  o.config = *cfg;
  o.progress = false;
  o.trace_path = dir.File("no/such/folder/trace.json");
  auto t = Trainer::Create(o);
  ASSERT_TRUE(t.ok()) << t.status();
  Status s = (*t)->Run();
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("no/such/folder/trace.json"), std::string::npos) << s;
}

}  // namespace
}  // namespace strata::train
