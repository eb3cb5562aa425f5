// RunBoard against the metrics lines it is fed (made by the trainer's own StepMetricsLine): its
// /metrics text obeys the exposition format (read by an independent parser), each gauge equals
// the latest line's field as the line's text gives it, each counter the sum over the lines; the
// JSON it serves parses; a line that is not a step is refused and changes nothing.
#include "web/run_board.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <random>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "tests/web/exposition.h"
#include "train/metrics.h"

namespace strata::web {
namespace {

// A number field of a JSON line as its text gives it (a regex over the text, not a JSON parser).
double FieldOf(const std::string& line, const std::string& key) {
  std::smatch m;
  const std::regex re("\"" + key + "\":(-?[0-9.eE+-]+)");
  EXPECT_TRUE(std::regex_search(line, m, re)) << key << " in " << line;
  return m.empty() ? std::nan("") : std::strtod(m[1].str().c_str(), nullptr);
}

// The text of the JSON object that follows "key": in `line` (objects in these lines do not nest
// deeper than the tiers' own).
std::string ObjectOf(const std::string& line, const std::string& key) {
  const size_t at = line.find("\"" + key + "\":{");
  EXPECT_NE(at, std::string::npos) << key;
  if (at == std::string::npos) return "";
  return line.substr(at, line.find('}', at) - at + 1);
}

std::vector<std::string> Lines(int steps, bool tiered) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> u(0.01, 10.0);
  std::vector<std::string> lines;
  for (int s = 1; s <= steps; ++s) {
    train::StepResult r;
    r.step = s;
    r.loss = u(rng);
    r.aux_loss = u(rng);
    r.z_loss = u(rng);
    r.grad_norm = u(rng);
    r.lr = u(rng) * 1e-4;
    r.seconds = u(rng) / 10;
    r.tokens = 4096;
    r.comm_seconds = u(rng) / 100;
    for (int layer = 0; layer < 3; ++layer) {
      model::MoeStats m;
      m.tokens = 2048;
      for (int e = 0; e < 4; ++e) m.load.push_back(static_cast<int64_t>(rng() % 1000));
      m.routed = m.load;
      m.routed[0] += 17;
      m.dropped_tokens = static_cast<int64_t>(rng() % 9);
      m.dropped = m.dropped_tokens + 3;
      m.capacity = 640;
      r.moe.push_back(m);
    }
    r.tiered = tiered;
    storage::TierStats* tiers[] = {&r.store.device, &r.store.host, &r.store.ssd};
    for (storage::TierStats* t : tiers) {
      t->hits = rng() % 100;
      t->misses = rng() % 10;
      t->bytes_in = rng() % 100000;
      t->bytes_out = rng() % 100000;
      t->evictions = rng() % 5;
      t->used_bytes = rng() % 1000000;
      t->budget_bytes = 1000000;
    }
    r.store.ssd_read_seconds = u(rng) / 100;
    r.store.ssd_write_seconds = u(rng) / 100;
    r.store.stall_seconds = u(rng) / 1000;
    train::EvalResult eval{u(rng), u(rng), 1024};
    const bool evaluated = s % 4 == 0;
    lines.push_back(train::StepMetricsLine(r, {1, 3, 5}, false,
                                           train::WorkerStepFields{1, 2, 3, 100, 8},
                                           evaluated ? &eval : nullptr));
  }
  return lines;
}

TEST(RunBoardTest, MetricsAreTheLinesFiguresInTheExpositionFormat) {
  const std::vector<std::string> lines = Lines(10, /*tiered=*/true);
  RunBoard board("tiny \"job\"", 50);
  for (const std::string& line : lines) ASSERT_TRUE(board.AddStepLine(line).ok());
  const std::string text = board.Prometheus();
  const testing::Exposition e = testing::ParseExposition(text);
  ASSERT_EQ(e.error, "") << text;
  const std::string& last = lines.back();

  EXPECT_EQ(e.samples.at("strata_info{name=\"tiny \"job\"\"}"), 1) << "the name, escaped";
  EXPECT_EQ(e.samples.at("strata_steps"), 50);
  const std::pair<const char*, const char*> gauges[] = {
      {"strata_step", "step"},
      {"strata_loss", "loss"},
      {"strata_aux_loss", "aux_loss"},
      {"strata_z_loss", "z_loss"},
      {"strata_grad_norm", "grad_norm"},
      {"strata_learning_rate", "lr"},
      {"strata_tokens_per_second", "tokens_per_s"},
      {"strata_workers", "workers"},
      {"strata_generation", "generation"},
  };
  for (const auto& [series, field] : gauges) {
    EXPECT_EQ(e.samples.at(series), FieldOf(last, field)) << series;
    EXPECT_EQ(e.types.at(series), "gauge");
  }
  EXPECT_DOUBLE_EQ(e.samples.at("strata_step_seconds"), FieldOf(last, "step_ms") / 1e3);
  EXPECT_DOUBLE_EQ(e.samples.at("strata_comm_seconds"), FieldOf(last, "comm_ms") / 1e3);
  EXPECT_EQ(e.samples.at("strata_tokens_total"), 10 * 4096.0);
  EXPECT_EQ(e.types.at("strata_tokens_total"), "counter");
  // The latest evaluation: step 8's.
  EXPECT_EQ(e.samples.at("strata_eval_step"), 8);
  EXPECT_EQ(e.samples.at("strata_eval_loss"), FieldOf(lines[7], "eval_loss"));
  EXPECT_EQ(e.samples.at("strata_eval_bits_per_byte"), FieldOf(lines[7], "eval_bits_per_byte"));

  // Per MoE layer, labelled with its block: the latest line's, and drops summed over the lines.
  const int blocks[] = {1, 3, 5};
  for (int i = 0; i < 3; ++i) {
    const std::string layer = absl::StrCat("{layer=\"", blocks[i], "\"}");
    // The i-th "layer": object of a line.
    auto layer_object = [&](const std::string& line) {
      size_t at = 0;
      for (int k = 0; k <= i; ++k) at = line.find("{\"layer\":", at + 1);
      return line.substr(at, line.find('}', at) - at + 1);
    };
    EXPECT_EQ(e.samples.at("strata_moe_load_max_over_mean" + layer),
              FieldOf(layer_object(last), "max_over_mean"));
    EXPECT_EQ(e.samples.at("strata_moe_load_cv" + layer), FieldOf(layer_object(last), "cv"));
    EXPECT_EQ(e.samples.at("strata_moe_capacity" + layer), 640);
    double dropped = 0;
    for (const std::string& line : lines) dropped += FieldOf(layer_object(line), "dropped_tokens");
    EXPECT_EQ(e.samples.at("strata_moe_dropped_tokens_total" + layer), dropped);
    EXPECT_EQ(e.samples.at("strata_moe_dropped_tokens" + layer),
              FieldOf(layer_object(last), "dropped_tokens"));
  }

  // Per tier: counters summed over the lines, the latest step's ratio, used and budget.
  for (const char* tier : {"device", "host", "ssd"}) {
    const std::string label = absl::StrCat("{tier=\"", tier, "\"}");
    for (const char* field : {"hits", "misses", "bytes_in", "bytes_out", "evictions"}) {
      double sum = 0;
      for (const std::string& line : lines) sum += FieldOf(ObjectOf(line, tier), field);
      const std::string series = absl::StrCat("strata_tier_", field, "_total", label);
      EXPECT_EQ(e.samples.at(series), sum) << series;
      EXPECT_EQ(e.types.at(absl::StrCat("strata_tier_", field, "_total")), "counter");
    }
    const double hits = FieldOf(ObjectOf(last, tier), "hits");
    const double misses = FieldOf(ObjectOf(last, tier), "misses");
    EXPECT_DOUBLE_EQ(e.samples.at("strata_tier_hit_ratio" + label), hits / (hits + misses));
    EXPECT_EQ(e.samples.at("strata_tier_used_bytes" + label),
              FieldOf(ObjectOf(last, tier), "used_bytes"));
    EXPECT_EQ(e.samples.at("strata_tier_budget_bytes" + label), 1e6);
  }
  EXPECT_EQ(e.samples.at("strata_ssd_read_gbps"), FieldOf(ObjectOf(last, "ssd"), "read_gbps"));
  EXPECT_EQ(e.samples.at("strata_ssd_write_gbps"), FieldOf(ObjectOf(last, "ssd"), "write_gbps"));
  double stall = 0;
  for (const std::string& line : lines) stall += FieldOf(line, "stall_ms") / 1e3;
  EXPECT_NEAR(e.samples.at("strata_store_stall_seconds_total"), stall, 1e-12 * stall);
  EXPECT_DOUBLE_EQ(e.samples.at("strata_store_stall_seconds"), FieldOf(last, "stall_ms") / 1e3);
}

TEST(RunBoardTest, AnInMemoryJobHasNoTierSeriesAndAFreshBoardOnlyItsJob) {
  RunBoard fresh("tiny", 5);
  testing::Exposition e = testing::ParseExposition(fresh.Prometheus());
  ASSERT_EQ(e.error, "");
  EXPECT_EQ(e.samples.size(), 2u) << "strata_info and strata_steps";
  EXPECT_EQ(fresh.StatusJson(), R"({"job":"tiny","state":"training","steps":5,"step":0})");

  for (const std::string& line : Lines(3, /*tiered=*/false)) {
    ASSERT_TRUE(fresh.AddStepLine(line).ok());
  }
  e = testing::ParseExposition(fresh.Prometheus());
  ASSERT_EQ(e.error, "");
  for (const auto& [series, value] : e.samples) {
    EXPECT_EQ(series.find("tier"), std::string::npos) << series;
    EXPECT_EQ(series.find("stall"), std::string::npos) << series;
  }
  EXPECT_EQ(e.samples.at("strata_step"), 3);
}

TEST(RunBoardTest, StatusAndHistoryAreJsonOfTheLines) {
  const std::vector<std::string> lines = Lines(6, /*tiered=*/false);
  RunBoard board("tiny", 6);
  for (const std::string& line : lines) ASSERT_TRUE(board.AddStepLine(line).ok());
  board.SetState("finished");
  google::protobuf::Struct status, history;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(board.StatusJson(), &status).ok());
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(board.HistoryJson(), &history).ok());
  const auto& f = status.fields();
  EXPECT_EQ(f.at("state").string_value(), "finished");
  EXPECT_EQ(f.at("step").number_value(), 6);
  EXPECT_EQ(f.at("loss").number_value(), FieldOf(lines.back(), "loss"));
  EXPECT_EQ(f.at("eval_step").number_value(), 4);
  EXPECT_EQ(f.at("workers").number_value(), 2);
  EXPECT_EQ(f.at("generation").number_value(), 3);
  const auto& points = history.fields().at("points").list_value().values();
  ASSERT_EQ(points.size(), 6);
  for (int i = 0; i < 6; ++i) {
    const auto& p = points[i].struct_value().fields();
    EXPECT_EQ(p.at("step").number_value(), i + 1);
    EXPECT_EQ(p.at("loss").number_value(), FieldOf(lines[i], "loss"));
    EXPECT_EQ(p.count("eval_loss"), (i + 1) % 4 == 0 ? 1u : 0u) << i;
  }
}

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// A coordinator's record as CoordinatorState keeps it: generation 5 of a, c and e, with d
// joining; b failed in generation 2 and the job went back 3 steps, d joined in 3, then left.
coordinator::CoordinatorRecord RecordOfAJob(int64_t now_ms) {
  coordinator::CoordinatorRecord r;
  r.mutable_generation()->set_number(5);
  r.mutable_generation()->set_reason("join");
  for (const char* id : {"a", "c", "e"}) r.mutable_generation()->add_workers()->set_id(id);
  r.add_pending()->set_id("f");
  r.set_step(9);
  r.set_workers_failed(1);
  r.set_workers_joined(2);
  r.set_workers_left(1);
  auto event = [&](int64_t n, const char* reason, int workers) {
    coordinator::GenerationEvent* e = r.add_timeline();
    e->set_number(n);
    e->set_reason(reason);
    e->set_workers(workers);
    e->set_formed_unix_ms(now_ms - 60'000 + n * 1000);
    return e;
  };
  auto* start = event(1, "start", 3);
  for (const char* id : {"a", "b", "c"}) start->add_joined(id);
  auto* failure = event(2, "failure", 2);
  failure->add_failed("b");
  failure->set_boundary_step(5);
  failure->set_first_step(2);
  failure->set_started_unix_ms(failure->formed_unix_ms() + 1250);
  event(3, "join", 3)->add_joined("d");
  event(4, "leave", 2)->add_left("d");
  auto* join = event(5, "join", 3);
  join->add_joined("e");
  join->set_boundary_step(9);  // not started yet
  return r;
}

TEST(RunBoardTest, ACoordinatorsBoardShowsItsMembershipTimelineAndCheckpoints) {
  const int64_t now_ms = NowMs();
  const coordinator::CoordinatorRecord record = RecordOfAJob(now_ms);
  RunBoard board("tiny", 20);
  board.SetRecordSource([&] { return record; });
  int listings = 0;
  board.SetCheckpointSource(
      [&] {
        ++listings;
        RunBoard::CheckpointList list;
        list.dir = "/ckpt";
        list.rows.push_back({4, now_ms - 90'000, 1 << 20, 800, 2, ""});
        list.rows.push_back({8, now_ms - 30'000, 3 << 20, 1500, 3, "shard r2: missing"});
        return list;
      },
      std::chrono::hours(1));
  // Steps 1 to 4, then the job goes back to 2 and trains step 3 again: the history shows the
  // steps that count.
  const std::vector<std::string> lines = Lines(4, /*tiered=*/false);
  for (const std::string& line : lines) ASSERT_TRUE(board.AddStepLine(line).ok());
  const std::string again = Lines(3, false).back();  // the same figures, step 3
  ASSERT_TRUE(board.AddStepLine(again).ok());

  const std::string text = board.Prometheus();
  const testing::Exposition e = testing::ParseExposition(text);
  ASSERT_EQ(e.error, "") << text;
  // The coordinator's membership, not the line's (which says 2 workers in generation 3).
  EXPECT_EQ(e.samples.at("strata_workers"), 3);
  EXPECT_EQ(e.samples.at("strata_generation"), 5);
  EXPECT_EQ(e.samples.at("strata_pending_workers"), 1);
  EXPECT_EQ(e.samples.at("strata_worker_failures_total"), 1);
  EXPECT_EQ(e.samples.at("strata_worker_joins_total"), 2);
  EXPECT_EQ(e.samples.at("strata_worker_leaves_total"), 1);
  EXPECT_EQ(e.types.at("strata_worker_failures_total"), "counter");
  EXPECT_EQ(e.samples.at("strata_last_reform_seconds"), 1.25);
  EXPECT_EQ(e.samples.at("strata_last_reform_steps_replayed"), 3);
  EXPECT_EQ(e.samples.at("strata_checkpoints"), 2);
  EXPECT_EQ(e.samples.at("strata_checkpoint_step"), 8);
  EXPECT_EQ(e.samples.at("strata_checkpoint_bytes"), 3 << 20);
  EXPECT_EQ(e.samples.at("strata_checkpoint_write_seconds"), 1.5);
  // Committed 30 s before `now_ms`, read a moment later.
  EXPECT_GE(e.samples.at("strata_checkpoint_age_seconds"), 30);
  EXPECT_LT(e.samples.at("strata_checkpoint_age_seconds"), 60);
  EXPECT_EQ(e.samples.at("strata_step"), 3);

  google::protobuf::Struct history, status;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(board.HistoryJson(), &history).ok());
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(board.StatusJson(), &status).ok());
  const auto& points = history.fields().at("points").list_value().values();
  ASSERT_EQ(points.size(), 3);
  // Step 4's evaluation went with step 4.
  EXPECT_EQ(history.fields().at("evals").list_value().values_size(), 0);
  EXPECT_EQ(status.fields().count("eval_step"), 0u);
  EXPECT_EQ(e.samples.count("strata_eval_step"), 0u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(points[i].struct_value().fields().at("step").number_value(), i + 1);
  }
  EXPECT_EQ(points[2].struct_value().fields().at("loss").number_value(), FieldOf(again, "loss"));
  const auto& timeline = history.fields().at("timeline").list_value().values();
  ASSERT_EQ(timeline.size(), 5);
  const auto& failure = timeline[1].struct_value().fields();
  EXPECT_EQ(failure.at("reason").string_value(), "failure");
  EXPECT_EQ(failure.at("failed").list_value().values(0).string_value(), "b");
  EXPECT_EQ(failure.at("reform_ms").number_value(), 1250);
  EXPECT_EQ(failure.at("steps_replayed").number_value(), 3);
  const auto& pending = timeline[4].struct_value().fields();
  EXPECT_EQ(pending.count("reform_ms"), 0u) << "its members have not all started";
  EXPECT_EQ(pending.count("first_step"), 0u);
  EXPECT_EQ(timeline[3].struct_value().fields().at("left").list_value().values(0).string_value(),
            "d");
  const auto& ckpts = history.fields().at("checkpoints").struct_value().fields();
  ASSERT_EQ(ckpts.at("list").list_value().values_size(), 2);
  const auto& newest = ckpts.at("list").list_value().values(1).struct_value().fields();
  EXPECT_EQ(newest.at("checked").bool_value(), false);
  EXPECT_EQ(newest.at("problem").string_value(), "shard r2: missing");
  const auto& m = status.fields().at("membership").struct_value().fields();
  EXPECT_EQ(m.at("generation").number_value(), 5);
  ASSERT_EQ(m.at("workers").list_value().values_size(), 3);
  EXPECT_EQ(m.at("workers").list_value().values(2).struct_value().fields().at("id").string_value(),
            "e");
  EXPECT_EQ(status.fields().count("workers"), 0u) << "the line's view is not repeated";
  // The folder was listed once: renderings within `refresh` share the listing.
  EXPECT_EQ(listings, 1);
}

TEST(RunBoardTest, ASlowCheckpointListingHoldsUpNoOtherRendering) {
  RunBoard board("tiny", 20);
  absl::Notification listing, release;
  board.SetCheckpointSource([&] {
    listing.Notify();
    release.WaitForNotification();
    RunBoard::CheckpointList list;
    list.rows.push_back({4, NowMs(), 1, 1, 1, ""});
    return list;
  });
  std::thread slow([&] { (void)board.Prometheus(); });
  listing.WaitForNotification();
  // Meanwhile a scrape answers at once, without the checkpoints it does not have yet.
  testing::Exposition e = testing::ParseExposition(board.Prometheus());
  ASSERT_EQ(e.error, "");
  EXPECT_EQ(e.samples.count("strata_checkpoints"), 0u);
  release.Notify();
  slow.join();
  e = testing::ParseExposition(board.Prometheus());
  EXPECT_EQ(e.samples.at("strata_checkpoints"), 1);
  // A folder that cannot be listed: what it holds is not known.
  RunBoard broken("tiny", 20);
  broken.SetCheckpointSource([] {
    RunBoard::CheckpointList list;
    list.error = "permission denied";
    return list;
  });
  e = testing::ParseExposition(broken.Prometheus());
  EXPECT_EQ(e.samples.at("strata_checkpoint_list_ok"), 0);
  EXPECT_EQ(e.samples.count("strata_checkpoints"), 0u);
}

TEST(RunBoardTest, TheLoadMapAveragesEachExpertsLoadOverTheMeanPerColumnOfSteps) {
  // 500 steps: past 240 columns of one step, then of two, the columns hold four steps each.
  const std::vector<std::string> lines = Lines(500, /*tiered=*/true);
  RunBoard board("tiny", 500);
  for (const std::string& line : lines) ASSERT_TRUE(board.AddStepLine(line).ok());
  google::protobuf::Struct history;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(board.HistoryJson(), &history).ok());
  const auto& load = history.fields().at("load").struct_value().fields();
  EXPECT_EQ(load.at("first_step").number_value(), 1);
  ASSERT_EQ(load.at("bucket_steps").number_value(), 4);
  const auto& layers = load.at("layers").list_value().values();
  ASSERT_EQ(layers.size(), 3);
  const int blocks[] = {1, 3, 5};
  double dropped = 0;
  for (int i = 0; i < 3; ++i) {
    const auto& layer = layers[i].struct_value().fields();
    EXPECT_EQ(layer.at("layer").number_value(), blocks[i]);
    const auto& columns = layer.at("buckets").list_value().values();
    ASSERT_EQ(columns.size(), 125);
    for (int c = 0; c < 125; c += 31) {
      // The column's steps, 4c+1 .. 4c+4: each expert's load over the layer's mean, averaged.
      std::vector<double> want(4, 0.0);
      for (int s = 4 * c; s < 4 * c + 4; ++s) {
        std::string rest = lines[s];
        for (int k = 0; k <= i; ++k) rest = rest.substr(rest.find("\"load\":[") + 8);
        std::vector<double> load_of;
        for (size_t at = 0; load_of.size() < 4; ++at) {
          load_of.push_back(std::strtod(rest.c_str() + at, nullptr));
          at = rest.find(',', at);
        }
        const double mean = (load_of[0] + load_of[1] + load_of[2] + load_of[3]) / 4;
        for (int e = 0; e < 4; ++e) want[e] += load_of[e] / mean / 4;
      }
      const auto& got = columns[c].list_value().values();
      ASSERT_EQ(got.size(), 4);
      for (int e = 0; e < 4; ++e) {
        EXPECT_NEAR(got[e].number_value(), want[e], 5e-4 * want[e] + 1e-9)
            << "layer " << i << " column " << c << " expert " << e << " (4 digits served)";
      }
    }
  }
  for (const std::string& line : lines) {
    size_t at = 0;
    while ((at = line.find("\"dropped_tokens\":", at + 1)) != std::string::npos) {
      dropped += std::strtod(line.c_str() + at + 17, nullptr);
    }
  }
  EXPECT_EQ(load.at("dropped_tokens").number_value(), dropped);
  // Every step is a point (fewer than kMaxPoints), with the tier figures of a TIERED step.
  const auto& points = history.fields().at("points").list_value().values();
  ASSERT_EQ(points.size(), 500);
  const auto& p = points[499].struct_value().fields();
  EXPECT_EQ(p.at("stall_ms").number_value(), FieldOf(lines[499], "stall_ms"));
  const double hits = FieldOf(ObjectOf(lines[499], "device"), "hits");
  EXPECT_NEAR(p.at("device_hit_ratio").number_value(),
              hits / (hits + FieldOf(ObjectOf(lines[499], "device"), "misses")), 1e-7);
  EXPECT_EQ(history.fields().at("state").string_value(), "training");
}

TEST(RunBoardTest, ALongRunsHistoryStaysBoundedEvenlySpacedWithTheLatestStep) {
  const std::vector<std::string> lines = Lines(1000, /*tiered=*/false);
  RunBoard board("tiny", 1000, /*max_points=*/100);
  for (const std::string& line : lines) ASSERT_TRUE(board.AddStepLine(line).ok());
  const RunBoard::Snapshot run = board.Take();
  // Thinned at 200 points to 100, and again: between 100 and 200 remain, 8 steps apart, then
  // the latest; the 250 evaluations likewise.
  ASSERT_GE(run.points.size(), 100u);
  ASSERT_LE(run.points.size(), 200u);
  EXPECT_EQ(run.points.back().step, 1000);
  for (size_t i = 1; i + 1 < run.points.size(); ++i) {
    EXPECT_EQ(run.points[i].step - run.points[i - 1].step, 8) << i;
  }
  ASSERT_GE(run.evals.size(), 100u);
  ASSERT_LE(run.evals.size(), 200u);
  for (const RunBoard::Point& p : run.evals) {
    EXPECT_EQ(p.step % 4, 0);
    EXPECT_EQ(p.eval_loss, FieldOf(lines[static_cast<size_t>(p.step - 1)], "eval_loss"));
  }
  EXPECT_EQ(run.evals.back().step, 1000);
}

TEST(RunBoardTest, ALineThatIsNotAStepIsRefusedAndChangesNothing) {
  RunBoard board("tiny", 5);
  ASSERT_TRUE(board.AddStepLine(Lines(1, false)[0]).ok());
  const std::string before = board.Prometheus();
  for (const std::string bad : {"", "not json", "[1,2]", "{\"loss\":1}", "{\"step\":-1}",
                                "{\"step\":1.5}", "{\"step\":\"2\"}", "{\"step\":2"}) {
    EXPECT_FALSE(board.AddStepLine(bad).ok()) << bad;
  }
  EXPECT_EQ(board.Prometheus(), before);
}

}  // namespace
}  // namespace strata::web
