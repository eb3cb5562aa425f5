// `strata train --http`: a live job's /metrics, scraped while it trains, holds the figures of the
// metrics file's line of the step it reports (the JSONL the same process wrote); requests without
// the token are refused; the token comes from $STRATA_JOB_TOKEN or --http-token-file when given
// (and is then not printed); a bad address stops the command before training.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "proto/config_io.h"
#include "tests/test_util.h"
#include "tests/train/tiny_job.h"
#include "tests/web/exposition.h"
#include "tests/web/http_client.h"

namespace strata {
namespace {

using strata::testing::HttpGet;
using strata::testing::ReadFile;
using strata::testing::RunCommand;
using strata::testing::TempDir;
using strata::testing::WriteFile;

const std::string kStrata = std::string(STRATA_BIN_DIR) + "/strata";
// Jobs that train until the test stops them.
constexpr int kForever = 10'000'000;

// A `strata train` started in the background, stopped (SIGKILL) if the test ends first.
struct Child {
  pid_t pid = -1;
  ~Child() { Stop(SIGKILL); }
  void Stop(int signal = SIGTERM) {
    if (pid <= 0) return;
    kill(pid, signal);
    strata::testing::WaitExit(pid);
    pid = -1;
  }
};

// Starts `strata train ARGS` with its stderr in `log`; returns its pid.
pid_t Start(const std::string& args, const std::string& log, const std::string& env = "") {
  const pid_t pid = fork();
  if (pid == 0) {
    const std::string cmd =
        absl::StrCat(env, " exec ", kStrata, " train ", args, " > ", log, ".out 2> ", log);
    execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  return pid;
}

// The port and token the job printed ("" token when it was not printed), waiting up to 60 s.
std::pair<int, std::string> Endpoint(const std::string& log) {
  const std::regex re(
      R"re(dashboard: http://127\.0\.0\.1:([0-9]+)/\?token=TOKEN.*\((token ([0-9a-f]+)|the token of))re");
  for (int i = 0; i < 600; ++i) {
    std::smatch m;
    const std::string text = ReadFile(log);
    if (std::regex_search(text, m, re)) {
      int port = 0;
      EXPECT_TRUE(absl::SimpleAtoi(m[1].str(), &port));
      return {port, m[3].str()};
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ADD_FAILURE() << "the job printed no address: " << ReadFile(log);
  return {0, ""};
}

config::JobConfig Job(const TempDir& dir, int steps) {
  WriteFile(dir.File("text.txt"), strata::testing::SyntheticText(40000));
  return strata::testing::TinyMoeJob(
      dir.File("text.txt"), absl::StrCat("train { steps: ", steps,
                                         " global_batch: 4 eval_every: 50 threads: 1 }\n"
                                         "storage { mode: TIERED io_block_bytes: 8192 ssd_dir: \"",
                                         dir.File("ssd"), "\" }\n"));
}

TEST(HttpTest, ALiveJobsMetricsAreItsMetricsLines) {
  TempDir dir;
  WriteFile(dir.File("job.textproto"), config::ToText(Job(dir, kForever)));
  Child job;
  job.pid = Start(absl::StrCat("--quiet --config ", dir.File("job.textproto"),
                               " --http 127.0.0.1:0 --metrics-out ", dir.File("m.jsonl")),
                  dir.File("log"));
  const auto [port, token] = Endpoint(dir.File("log"));
  ASSERT_GT(port, 0);
  ASSERT_EQ(token.size(), 32u) << "a random token, printed";
  EXPECT_EQ(HttpGet(port, "/metrics").status, 401);
  EXPECT_EQ(HttpGet(port, "/metrics?token=" + std::string(32, 'f')).status, 401);

  // Scrape until the job is past a few steps and an evaluation.
  testing::Exposition e;
  for (int i = 0; i < 600; ++i) {
    auto r = HttpGet(port, "/metrics", "Authorization: Bearer " + token + "\r\n");
    ASSERT_EQ(r.status, 200) << r.head;
    EXPECT_NE(r.head.find("text/plain; version=0.0.4"), std::string::npos) << r.head;
    e = testing::ParseExposition(r.body);
    ASSERT_EQ(e.error, "") << r.body;
    if (e.samples.count("strata_step") && e.samples.at("strata_step") >= 60) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_GE(e.samples.at("strata_step"), 60) << "the job did not get past step 60 in 30 s";
  auto status = HttpGet(port, "/api/status?token=" + token);
  EXPECT_EQ(status.status, 200);
  EXPECT_NE(status.body.find("\"state\":\"training\""), std::string::npos) << status.body;
  job.Stop();

  // The metrics file's line of the scraped step, and every line up to it.
  const int64_t step = static_cast<int64_t>(e.samples.at("strata_step"));
  std::ifstream in(dir.File("m.jsonl"));
  std::string line, at, evaluated;
  double tokens = 0, ssd_reads = 0;
  for (int64_t s = 1; std::getline(in, line) && s <= step; ++s) {
    if (s == step - step % 50) evaluated = line;
    ASSERT_EQ(strata::testing::IntField(line, "step"), s);
    tokens += strata::testing::DoubleField(line, "tokens");
    const size_t ssd = line.find("\"ssd\":{");
    ASSERT_NE(ssd, std::string::npos) << line;
    ssd_reads += strata::testing::DoubleField(line.substr(ssd), "bytes_out");
    if (s == step) at = line;
  }
  ASSERT_FALSE(at.empty()) << "the metrics file has no line " << step;
  using strata::testing::DoubleField;
  EXPECT_EQ(e.samples.at("strata_loss"), DoubleField(at, "loss"));
  EXPECT_EQ(e.samples.at("strata_grad_norm"), DoubleField(at, "grad_norm"));
  EXPECT_EQ(e.samples.at("strata_learning_rate"), DoubleField(at, "lr"));
  EXPECT_EQ(e.samples.at("strata_tokens_per_second"), DoubleField(at, "tokens_per_s"));
  EXPECT_EQ(e.samples.at("strata_tokens_total"), tokens);
  EXPECT_EQ(e.samples.at("strata_tier_bytes_out_total{tier=\"ssd\"}"), ssd_reads);
  EXPECT_EQ(e.samples.at("strata_eval_step"), step - step % 50);
  EXPECT_EQ(e.samples.at("strata_eval_loss"), DoubleField(evaluated, "eval_loss"));
  EXPECT_EQ(e.samples.at("strata_moe_load_max_over_mean{layer=\"0\"}"),
            DoubleField(at, "max_over_mean"))
      << "the first MoE layer's (block 0)";
}

// Debian's chromium, or nullptr where none is installed.
const char* Browser() {
  for (const char* b : {"/usr/bin/chromium", "/usr/bin/chromium-browser"}) {
    if (access(b, X_OK) == 0) return b;
  }
  return nullptr;
}
constexpr char kNoBrowser[] =
    "no headless browser: `scripts/install-deps.sh --with-browser` installs Debian's chromium "
    "(CI does)";

// A page as the headless browser left it after its script ran: the DOM, and a screenshot in
// build/test-artifacts/<screenshot>.
struct Page {
  bool ok = false;
  std::string html;
  std::string log;  // the browser's stderr
  int count(const std::string& what) const {
    int n = 0;
    for (size_t at = html.find(what); at != std::string::npos; at = html.find(what, at + 1)) ++n;
    return n;
  }
  // The number in attribute `name` of the element with id `id` (-1 when it has none).
  int64_t attribute(const std::string& id, const std::string& name) const {
    const size_t at = html.find("id=\"" + id + "\"");
    EXPECT_NE(at, std::string::npos) << id << "\n" << html;
    const size_t tag_end = html.find('>', at);
    const size_t a = html.find(name + "=\"", at);
    if (at == std::string::npos || a == std::string::npos || a > tag_end) return int64_t{-1};
    return static_cast<int64_t>(std::stoll(html.substr(a + name.size() + 2)));
  }
};

Page Browse(const std::string& url, const TempDir& dir, const std::string& screenshot) {
  const std::string flags = absl::StrCat(
      "--headless --no-sandbox --disable-gpu --hide-scrollbars --virtual-time-budget=4000 "
      "--user-data-dir=",
      dir.File("browser-profile"));
  // (Each in a subshell whose stderr goes to the log: RunCommand adds 2>&1 to what it runs.)
  auto dom = RunCommand(absl::StrCat("(timeout 120 ", Browser(), " ", flags, " --dump-dom '", url,
                                     "' 2> ", dir.File("browser.log"), ")"));
  const std::string artifacts = std::string(STRATA_BIN_DIR) + "/../test-artifacts";
  std::filesystem::create_directories(artifacts);
  auto shot = RunCommand(absl::StrCat(
      "(timeout 120 ", Browser(), " ", flags, " --window-size=1400,1300 --screenshot=", artifacts,
      "/", screenshot, " '", url, "' 2>> ", dir.File("browser.log"), ")"));
  Page page;
  page.ok = dom.exit_code == 0 && shot.exit_code == 0 &&
            std::filesystem::exists(artifacts + "/" + screenshot);
  page.html = dom.output;
  page.log = ReadFile(dir.File("browser.log"));
  return page;
}

// The page in a real headless browser (Debian's chromium): after its script ran against the live
// job, the DOM holds a loss chart with points, one heatmap per MoE layer with columns, the tier
// chart of a TIERED job, the job's state and no error; a screenshot is kept in
// build/test-artifacts/dashboard.png.
TEST(HttpTest, TheDashboardDrawsTheLiveJobInABrowser) {
  if (Browser() == nullptr) GTEST_SKIP() << kNoBrowser;
  TempDir dir;
  WriteFile(dir.File("job.textproto"), config::ToText(Job(dir, kForever)));
  Child job;
  job.pid =
      Start(absl::StrCat("--quiet --config ", dir.File("job.textproto"), " --http 127.0.0.1:0"),
            dir.File("log"));
  const auto [port, token] = Endpoint(dir.File("log"));
  ASSERT_GT(port, 0);
  for (int i = 0; i < 300; ++i) {
    const auto r = HttpGet(port, "/api/status?token=" + token);
    if (r.body.find("\"step\":") != std::string::npos &&
        strata::testing::IntField(r.body, "step") >= 20) {
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  const Page page =
      Browse(absl::StrCat("http://127.0.0.1:", port, "/?token=", token), dir, "dashboard.png");
  job.Stop();
  ASSERT_TRUE(page.ok) << page.log;
  const std::string& html = page.html;
  EXPECT_GE(page.attribute("loss", "data-points"), 20) << "the loss chart has the steps' points";
  EXPECT_GT(page.attribute("tiers", "data-points"), 0) << "the TIERED job's tier chart";
  EXPECT_EQ(page.count("class=\"heatmap\""), 2) << "one heatmap per MoE layer\n" << html;
  EXPECT_EQ(page.count("data-columns=\"0\""), 0) << html;
  EXPECT_NE(html.find("id=\"state\">training<"), std::string::npos) << html;
  EXPECT_NE(html.find("id=\"error\"></span>"), std::string::npos) << "the page's script failed\n"
                                                                  << html;
  EXPECT_NE(html.find("id=\"timeline-panel\" hidden"), std::string::npos)
      << "one process: no membership panel\n"
      << html;
}

// Starts `sh -c cmd` in the background.
pid_t Spawn(const std::string& cmd) {
  const pid_t pid = fork();
  if (pid == 0) {
    execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  return pid;
}

// A coordinator's dashboard (`strata coordinator --http`) in a real job: two workers train, one
// is SIGKILLed, another joins. The page, in a headless browser, shows the loss, the failure and
// the join in the membership timeline, one heatmap per MoE layer and the checkpoints; /metrics
// counts the failure and the join and holds the figures of rank 0's metrics line of its step;
// requests without the job's token are refused. Screenshot: coordinator-dashboard.png.
TEST(HttpTest, TheCoordinatorsDashboardShowsTheJobThroughAFailureAndAJoin) {
  if (Browser() == nullptr) GTEST_SKIP() << kNoBrowser;
  TempDir dir;
  WriteFile(dir.File("text.txt"), strata::testing::SyntheticText(40000));
  const config::JobConfig cfg = strata::testing::TinyMoeJob(
      dir.File("text.txt"), absl::StrCat("train { steps: ", kForever,
                                         " global_batch: 4 eval_every: 0 threads: 1 }\n"
                                         "parallel { expert_parallel: 0 timeout_ms: 20000 }\n"
                                         "checkpoint { every: 10 keep: 3 dir: \"",
                                         dir.File("ckpt"), "\" }\n"));
  WriteFile(dir.File("job.textproto"), config::ToText(cfg));
  const std::string in_dir = absl::StrCat("cd ", dir.path(), " && STRATA_JOB_TOKEN=secret exec ");
  Child coordinator;
  coordinator.pid = Spawn(
      absl::StrCat(in_dir, kStrata,
                   " coordinator --dir record --config job.textproto --workers 2 --min-workers 1 "
                   "--listen 127.0.0.1:0 --http 127.0.0.1:0 > coordinator.log 2>&1"));
  const std::string clog = dir.File("coordinator.log");
  std::smatch m;
  const std::regex listening(R"(listening on (127\.0\.0\.1:[0-9]+))");
  const std::regex dashboard(
      R"(dashboard: http://127\.0\.0\.1:([0-9]+)/\?token=TOKEN.*the job's token)");
  std::string log;
  for (int i = 0; i < 600; ++i) {
    log = ReadFile(clog);
    if (std::regex_search(log, m, dashboard)) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_TRUE(std::regex_search(log, m, dashboard)) << log;
  const int port = std::stoi(m[1].str());
  ASSERT_TRUE(std::regex_search(log, m, listening)) << log;
  const std::string address = m[1].str();
  auto worker = [&](const std::string& id) {
    Child w;
    w.pid = Spawn(absl::StrCat(in_dir, kStrata, " worker --coordinator ", address, " --quiet --id ",
                               id, " --metrics-out ", id, ".jsonl > ", id, ".log 2>&1"));
    return w;
  };
  Child w0 = worker("w0"), w1 = worker("w1");
  // Polls /api/status until `pred` holds for its text, for up to 120 s.
  auto wait_status = [&](const std::string& what, auto pred) {
    std::string body;
    for (int i = 0; i < 1200; ++i) {
      body = HttpGet(port, "/api/status", "X-Strata-Token: secret\r\n").body;
      if (pred(body)) return body;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    ADD_FAILURE() << "waiting for " << what << ": " << body << "\n" << ReadFile(clog);
    return body;
  };
  auto step_of = [](const std::string& body) {
    return body.find("\"step\":") == std::string::npos ? int64_t{-1}
                                                       : strata::testing::IntField(body, "step");
  };
  auto generation_of = [](const std::string& body) {
    const size_t at = body.find("\"membership\":");
    return at == std::string::npos ? int64_t{-1}
                                   : strata::testing::IntField(body.substr(at), "generation");
  };
  wait_status("step 25", [&](const std::string& b) { return step_of(b) >= 25; });
  EXPECT_EQ(HttpGet(port, "/api/status").status, 401);
  EXPECT_EQ(HttpGet(port, "/api/status?token=secreT").status, 401);
  w1.Stop(SIGKILL);
  const std::string alone = wait_status("w0 training alone", [&](const std::string& b) {
    return generation_of(b) == 2 && b.find("\"reason\":\"failure\"") != std::string::npos;
  });
  const int64_t after_failure = step_of(alone);
  wait_status("steps after the failure",
              [&](const std::string& b) { return step_of(b) >= after_failure + 10; });
  Child w2 = worker("w2");
  const std::string joined = wait_status("w2 joined", [&](const std::string& b) {
    return generation_of(b) == 3 && b.find("\"id\":\"w2\"") != std::string::npos;
  });
  wait_status("steps after the join",
              [&](const std::string& b) { return step_of(b) >= step_of(joined) + 10; });
  // The folder is listed every 5 s: the first listing may have been before the first checkpoint.
  wait_status("a checkpoint listed", [&](const std::string& b) {
    return b.find("\"checked\":true") != std::string::npos;
  });

  auto metrics = HttpGet(port, "/metrics", "Authorization: Bearer secret\r\n");
  ASSERT_EQ(metrics.status, 200);
  const testing::Exposition e = testing::ParseExposition(metrics.body);
  ASSERT_EQ(e.error, "") << metrics.body;
  EXPECT_EQ(e.samples.at("strata_worker_failures_total"), 1);
  EXPECT_EQ(e.samples.at("strata_worker_joins_total"), 1);
  EXPECT_EQ(e.samples.at("strata_generation"), 3);
  EXPECT_EQ(e.samples.at("strata_workers"), 2);
  EXPECT_GE(e.samples.at("strata_checkpoints"), 1);
  const Page page = Browse(absl::StrCat("http://127.0.0.1:", port, "/?token=secret"), dir,
                           "coordinator-dashboard.png");
  coordinator.Stop(SIGTERM);
  w0.Stop(SIGKILL);
  w2.Stop(SIGKILL);

  // The scraped step's figures are rank 0's (w0's) line of that step: the last one it wrote, as
  // a step trained again after the failure replaces the one before.
  const int64_t step = static_cast<int64_t>(e.samples.at("strata_step"));
  std::string at;
  std::ifstream in(dir.File("w0.jsonl"));
  for (std::string line; std::getline(in, line);) {
    if (line.find("\"step\":") != std::string::npos &&
        strata::testing::IntField(line, "step") == step) {
      at = line;
    }
  }
  ASSERT_FALSE(at.empty()) << "w0 wrote no line of step " << step;
  using strata::testing::DoubleField;
  EXPECT_EQ(e.samples.at("strata_loss"), DoubleField(at, "loss"));
  EXPECT_EQ(e.samples.at("strata_grad_norm"), DoubleField(at, "grad_norm"));
  EXPECT_EQ(e.samples.at("strata_tokens_per_second"), DoubleField(at, "tokens_per_s"));

  ASSERT_TRUE(page.ok) << page.log;
  const std::string& html = page.html;
  EXPECT_NE(html.find("id=\"error\"></span>"), std::string::npos) << "the page's script failed\n"
                                                                  << html;
  EXPECT_GE(page.attribute("loss", "data-points"), 20) << html;
  EXPECT_EQ(page.count("class=\"heatmap\""), 2) << "one heatmap per MoE layer\n" << html;
  EXPECT_EQ(page.count("data-reason=\"failure\""), 1) << html;
  EXPECT_EQ(page.count("data-reason=\"join\""), 1) << html;
  EXPECT_EQ(page.count("data-reason=\"start\""), 1) << html;
  EXPECT_NE(html.find("w1 failed"), std::string::npos) << html;
  EXPECT_NE(html.find("<td>w2</td>"), std::string::npos) << "the join names w2\n" << html;
  EXPECT_EQ(html.find("id=\"timeline-panel\" hidden"), std::string::npos) << html;
  EXPECT_GE(page.count("<td>checked</td>"), 1) << "the checkpoints, each checked\n" << html;
}

TEST(HttpTest, TheTokenComesFromTheEnvironmentOrAFileAndBadAddressesStopTheCommand) {
  TempDir dir;
  WriteFile(dir.File("job.textproto"), config::ToText(Job(dir, kForever)));
  const std::string token = "feedfacefeedfacefeedfacefeedface";
  WriteFile(dir.File("token"), token + "\n");
  for (const std::string& given :
       {absl::StrCat("--http-token-file ", dir.File("token")), std::string()}) {
    const std::string log = dir.File(given.empty() ? "log.env" : "log.file");
    Child job;
    job.pid = Start(
        absl::StrCat("--quiet --config ", dir.File("job.textproto"), " --http 127.0.0.1:0 ", given),
        log, given.empty() ? "STRATA_JOB_TOKEN=" + token : "");
    const auto [port, printed] = Endpoint(log);
    EXPECT_EQ(printed, "") << "a given token is not printed";
    EXPECT_EQ(ReadFile(log).find(token), std::string::npos);
    EXPECT_EQ(HttpGet(port, "/api/status?token=" + token).status, 200) << given;
    EXPECT_EQ(HttpGet(port, "/api/status?token=" + std::string(32, '0')).status, 401);
    job.Stop();
  }
  struct Case {
    std::string flags, says;
  };
  const Case cases[] = {
      {"--http 127.0.0.1", "'127.0.0.1' is not HOST:PORT"},
      {"--http example.com:80", "'example.com:80' is not HOST:PORT"},
      {"--http 127.0.0.1:0 --http-token-file " + dir.File("none"),
       "--http-token-file '" + dir.File("none") + "' is missing"},
  };
  for (const Case& c : cases) {
    auto r = RunCommand(
        absl::StrCat(kStrata, " train --quiet --config ", dir.File("job.textproto"), " ", c.flags));
    EXPECT_EQ(r.exit_code, 1) << c.flags << "\n" << r.output;
    EXPECT_NE(r.output.find(c.says), std::string::npos) << c.flags << "\n" << r.output;
  }
}

}  // namespace
}  // namespace strata
