// The coordinator over real gRPC on loopback: joins and status through the client, the token on
// every call, the rendezvous store over the network used by two real Gloo communicators, a clear
// error when no coordinator is listening, TLS with a certificate made for the test, and the
// `strata coordinator` process killed with SIGKILL and restarted on its RocksDB record.
#include "coordinator/service.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <regex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "coordinator/membership_client.h"
#include "launcher/job_config.h"
#include "proto/config_io.h"
#include "runtime/comm/communicator.h"
#include "tests/test_util.h"

namespace strata::coordinator {
namespace {

using std::chrono::milliseconds;

constexpr char kToken[] = "s3cret-token";

coordinator::WorkerInfo Worker(const std::string& id) {
  coordinator::WorkerInfo w;
  w.set_id(id);
  w.set_host("127.0.0.1");
  return w;
}

class CoordinatorServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    CoordinatorOptions o;
    o.dir = dir_.File("coordinator");
    o.token = kToken;
    o.initial_workers = 2;
    o.min_workers = 1;
    auto s = CoordinatorState::Open(o, "name: \"job\"\n", std::chrono::steady_clock::now());
    ASSERT_TRUE(s.ok()) << s.status();
    state_ = std::move(*s);
    auto server = CoordinatorServer::Start(state_.get(), "127.0.0.1:0");
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
  }
  // Workers a and b join (generation 1 of two) and attach their streams.
  void JoinAndAttachTwo(std::unique_ptr<CoordinatorClient>* a,
                        std::unique_ptr<CoordinatorClient>* b) {
    *a = Client();
    *b = Client();
    ASSERT_TRUE((*a)->Join(Worker("a")).ok());
    auto jb = (*b)->Join(Worker("b"));
    ASSERT_TRUE(jb.ok()) << jb.status();
    ASSERT_TRUE(jb->admitted());
    ASSERT_TRUE((*a)->Attach("a").ok());
    ASSERT_TRUE((*b)->Attach("b").ok());
  }
  std::unique_ptr<CoordinatorClient> Client(const std::string& token = kToken) {
    auto c = CoordinatorClient::Connect(server_->address(), token);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }
  strata::testing::TempDir dir_;
  std::unique_ptr<CoordinatorState> state_;
  std::unique_ptr<CoordinatorServer> server_;
};

TEST(CoordinatorTlsTest, WithCertificatesOnlyTlsClientsThatTrustThemGetIn) {
  // A self-signed certificate for 127.0.0.1, made by openssl for this test.
  strata::testing::TempDir dir;
  auto made = strata::testing::RunCommand(
      absl::StrCat("openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=127.0.0.1 -addext "
                   "subjectAltName=IP:127.0.0.1 -keyout ",
                   dir.File("key.pem"), " -out ", dir.File("cert.pem"), " 2>&1"));
  ASSERT_EQ(made.exit_code, 0) << made.output;
  CoordinatorOptions o;
  o.dir = dir.File("coordinator");
  o.token = kToken;
  auto state = CoordinatorState::Open(o, "name: \"job\"\n", std::chrono::steady_clock::now());
  ASSERT_TRUE(state.ok()) << state.status();
  TlsFiles tls{dir.File("cert.pem"), dir.File("key.pem"), ""};
  auto server = CoordinatorServer::Start(state->get(), "127.0.0.1:0", tls);
  ASSERT_TRUE(server.ok()) << server.status();
  // A client trusting the certificate gets in (and still needs the token).
  auto trusted = CoordinatorClient::Connect((*server)->address(), kToken, dir.File("cert.pem"),
                                            milliseconds(5000));
  ASSERT_TRUE(trusted.ok()) << trusted.status();
  auto st = (*trusted)->GetStatus();
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->job_config(), "name: \"job\"\n");
  auto wrong_token = CoordinatorClient::Connect((*server)->address(), "nope", dir.File("cert.pem"),
                                                milliseconds(5000));
  ASSERT_TRUE(wrong_token.ok()) << wrong_token.status();
  EXPECT_EQ((*wrong_token)->GetStatus().status().code(), absl::StatusCode::kUnauthenticated);
  // A plaintext client does not get through the TLS handshake.
  auto plain = CoordinatorClient::Connect((*server)->address(), kToken, "", milliseconds(1500));
  if (plain.ok()) {
    EXPECT_FALSE((*plain)->GetStatus().ok());
  } else {
    EXPECT_EQ(plain.status().code(), absl::StatusCode::kUnavailable) << plain.status();
  }
  // A CA file that is not there is a clear error naming it.
  auto missing = CoordinatorClient::Connect((*server)->address(), kToken, dir.File("none.pem"));
  EXPECT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("none.pem"), std::string::npos) << missing.status();
}

TEST_F(CoordinatorServiceTest, WorkersJoinReportAndSeeTheirGenerationOverGrpc) {
  auto a = Client(), b = Client();
  auto ja = a->Join(Worker("a"));
  ASSERT_TRUE(ja.ok()) << ja.status();
  EXPECT_FALSE(ja->admitted());
  auto jb = b->Join(Worker("b"));
  ASSERT_TRUE(jb.ok()) << jb.status();
  EXPECT_TRUE(jb->admitted());
  EXPECT_EQ(jb->generation(), 1);
  EXPECT_EQ(jb->rank(), 1);
  auto g = a->Heartbeat("a");
  ASSERT_TRUE(g.ok()) << g.status();
  ASSERT_EQ(g->workers_size(), 2);
  EXPECT_EQ(g->workers(0).id(), "a");
  ASSERT_TRUE(a->ReportStep("a", 1, 1).ok());
  ASSERT_TRUE(b->ReportStep("b", 1, 1).ok());
  auto st = a->GetStatus();
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->step(), 1);
  // A refused request keeps its code and message across the wire.
  auto again = b->Join(Worker("b"));
  EXPECT_EQ(again.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_NE(again.status().message().find("'b' has already joined"), std::string::npos);
}

// Rank 0's load balance goes through the worker's Membership over gRPC into the status; a
// malformed one (a NaN figure, more layers than a report may hold) comes back refused with the
// field named, and the coordinator goes on serving.
TEST_F(CoordinatorServiceTest, AMoeBalanceReachesTheStatusAndAMalformedOneIsRefused) {
  std::unique_ptr<CoordinatorClient> a, b;
  ASSERT_NO_FATAL_FAILURE(JoinAndAttachTwo(&a, &b));
  MembershipClient rank0(a.get(), server_->address());
  coordinator::MoeLayerBalance layer;
  layer.set_block(3);
  layer.set_max_over_mean(1.42);
  layer.set_cv(0.31);
  layer.set_bias_min(-0.012);
  layer.set_bias_max(0.009);
  coordinator::MoeLayerBalance nan_cv = layer;
  nan_cv.set_cv(std::nan(""));
  auto bad = rank0.ReportStepWithBalance("a", 1, 1, 2.0, 0, {layer, nan_cv});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
  EXPECT_NE(bad.status().message().find(
                "worker 'a' reported step 1 with StepReport.moe_balance[1].cv = nan (it must be "
                "finite and not negative); the step is not counted"),
            std::string::npos)
      << bad.status();
  auto many = rank0.ReportStepWithBalance("a", 1, 1, 2.0, 0,
                                          std::vector<coordinator::MoeLayerBalance>(5000, layer));
  EXPECT_EQ(many.status().code(), absl::StatusCode::kInvalidArgument) << many.status();
  EXPECT_NE(many.status().message().find("StepReport.moe_balance of 5000 MoE layers, more than "
                                         "the 4096 a report may hold"),
            std::string::npos)
      << many.status();
  // Still serving; the refused reports counted nothing, so step 1 is next for "a".
  ASSERT_TRUE(rank0.ReportStepWithBalance("a", 1, 1, 2.0, 0, {layer}).ok());
  ASSERT_TRUE(b->ReportStep("b", 1, 1).ok());
  auto st = b->GetStatus();
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->step(), 1);
  EXPECT_EQ(st->moe_balance_step(), 1);
  ASSERT_EQ(st->moe_balance_size(), 1);
  EXPECT_EQ(MoeBalanceLine(st->moe_balance(0)),
            "moe layer 3: max/mean load 1.42, cv 0.31, bias [-0.012, 0.009]");
}

// A coordinator that stops (SIGTERM, a rolled pod) cuts its workers' Attach streams: that is not
// their failure. The record keeps them in their generation, so a restarted coordinator gives them
// elastic.restart_grace_ms to come back instead of re-forming without them.
TEST_F(CoordinatorServiceTest, StoppingTheServerIsNotTheFailureOfItsAttachedWorkers) {
  std::unique_ptr<CoordinatorClient> a, b;
  ASSERT_NO_FATAL_FAILURE(JoinAndAttachTwo(&a, &b));
  const coordinator::CoordinatorRecord before = state_->Snapshot();
  ASSERT_EQ(before.generation().number(), 1);
  ASSERT_EQ(before.generation().workers_size(), 2);
  server_.reset();  // as `strata coordinator` does when it stops
  const coordinator::CoordinatorRecord after = state_->Snapshot();
  EXPECT_EQ(after.generation().number(), 1) << after.generation().reason();
  EXPECT_EQ(after.generation().workers_size(), 2);
  // The streams' ends reach the clients, which may now be torn down.
  a.reset();
  b.reset();
}

// A worker whose heartbeats went unanswered while the coordinator stood still (a synced write of
// its record held up by a busy disk) attaches again when it answers: its stream is still there,
// and attaching again must not end it, or the coordinator would take that for its death.
TEST_F(CoordinatorServiceTest, AttachingAgainToACoordinatorThatOnlyStoodStillIsNoFailure) {
  std::unique_ptr<CoordinatorClient> a, b;
  ASSERT_NO_FATAL_FAILURE(JoinAndAttachTwo(&a, &b));
  ASSERT_TRUE(a->Attach("a").ok());
  ASSERT_TRUE(b->Attach("b").ok());
  // A stream's end reaches the coordinator within milliseconds on loopback; give it a second.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  while (std::chrono::steady_clock::now() < deadline) {
    const coordinator::CoordinatorRecord r = state_->Snapshot();
    ASSERT_EQ(r.generation().number(), 1) << r.generation().reason();
    ASSERT_EQ(r.generation().workers_size(), 2);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  // The streams still tell a death at once: b goes without finishing, and a new generation forms.
  ASSERT_TRUE(b->Detach(/*finished=*/false).ok());
  const auto formed = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (state_->Snapshot().generation().number() == 1) {
    ASSERT_LT(std::chrono::steady_clock::now(), formed) << "b's end was not seen";
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(state_->Snapshot().generation().workers_size(), 1);
  a.reset();
}

TEST_F(CoordinatorServiceTest, ACallWithoutTheTokenIsRefusedAndChangesNothing) {
  auto intruder = Client("not-the-token");
  const std::string before = state_->Snapshot().SerializeAsString();
  EXPECT_EQ(intruder->Join(Worker("x")).status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(intruder->GetStatus().status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(intruder->store()->Set("k", "v").code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(state_->Snapshot().SerializeAsString(), before);
  EXPECT_EQ(state_->Get(kToken, "k").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(CoordinatorServiceTest, TwoGlooRanksRendezvousThroughTheNetworkStore) {
  auto client = Client();
  // The store itself: Add, and a Wait that times out naming the key.
  auto store = client->store();
  auto v = store->Add("n", 5);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, 5);
  Status w = store->Wait({"never"}, milliseconds(150));
  EXPECT_EQ(w.code(), absl::StatusCode::kDeadlineExceeded) << w;
  EXPECT_NE(w.message().find("never"), std::string::npos);
  // Two communicators meet through it and all-reduce.
  std::vector<float> sums(2);
  std::vector<Status> results(2);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      comm::CommOptions o;
      o.rank = r;
      o.world_size = 2;
      o.timeout = milliseconds(10000);
      auto c = comm::ConnectGloo(comm::MakePrefixStore(client->store(), "gen/1/"), o);
      if (!c.ok()) {
        results[r] = c.status();
        return;
      }
      float x = static_cast<float>(r + 1);
      results[r] = (*c)->AllReduce(&x, 1);
      sums[r] = x;
    });
  }
  for (auto& t : ranks) t.join();
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(results[r].ok()) << results[r];
    EXPECT_EQ(sums[r], 3.0f);
  }
}

TEST(CoordinatorClientTest, NoCoordinatorListeningIsAClearError) {
  // A port that was just free: nothing listens there.
  CoordinatorOptions o;
  strata::testing::TempDir dir;
  o.dir = dir.File("c");
  o.token = kToken;
  auto state = CoordinatorState::Open(o, "", std::chrono::steady_clock::now());
  ASSERT_TRUE(state.ok());
  std::string address;
  {
    auto server = CoordinatorServer::Start(state->get(), "127.0.0.1:0");
    ASSERT_TRUE(server.ok());
    address = (*server)->address();
  }
  auto c = CoordinatorClient::Connect(address, kToken, "", milliseconds(500));
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(c.status().message().find("cannot reach the coordinator at " + address),
            std::string::npos)
      << c.status();
}

// `strata coordinator` as a real process: SIGKILLed and restarted on its folder, it still knows
// the job (generation, members); `strata status` shows it, and refuses without the token.
class CoordinatorProcessTest : public ::testing::Test {
 protected:
  const std::string kStrata = std::string(STRATA_BIN_DIR) + "/strata";
  // Starts the coordinator on `listen`; returns its address from its first line.
  std::string Start(const std::string& extra, const std::string& listen = "127.0.0.1:0") {
    const std::string log = dir_.File("coordinator.log");
    std::filesystem::remove(log);
    pid_ = fork();
    if (pid_ == 0) {
      const std::string cmd = "cd " + dir_.path() + " && STRATA_JOB_TOKEN=" + kToken + " exec " +
                              kStrata + " coordinator --dir record --listen " + listen + " " +
                              extra + " > " + log + " 2>&1";
      execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    std::smatch m;
    const std::regex re("listening on (127\\.0\\.0\\.1:[0-9]+)");
    std::string text;
    while (!std::regex_search(text = strata::testing::ReadFile(log), m, re)) {
      if (std::chrono::steady_clock::now() > deadline) {
        ADD_FAILURE() << "the coordinator did not start: " << text;
        return "";
      }
      std::this_thread::sleep_for(milliseconds(20));
    }
    return m[1];
  }
  void Kill() {
    ASSERT_EQ(kill(pid_, SIGKILL), 0);
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
  }
  void TearDown() override {
    if (pid_ > 0) Kill();
  }
  strata::testing::TempDir dir_;
  pid_t pid_ = -1;
};

// A coordinator restarted on its address is found by its workers' next calls at once. (A
// synchronous client's reconnecting channel notices its connection completing only while a call
// waits on it, else at gRPC's backup poll every 5 s, which a restart grace of a few seconds cannot
// wait for. The coordinator runs as its own process: one in the test's process would poll the
// client's connection with its own threads.)
TEST_F(CoordinatorProcessTest, AClientFindsItRestartedAsSoonAsItServes) {
  strata::testing::WriteFile(dir_.File("text.txt"), "hello");
  strata::testing::WriteFile(dir_.File("job.textproto"),
                             "name: \"elastic\"\ndata { path: \"text.txt\" }\n");
  const std::string address = Start("--config job.textproto --workers 2");
  ASSERT_FALSE(address.empty());
  auto c = CoordinatorClient::Connect(address, kToken);
  ASSERT_TRUE(c.ok()) << c.status();
  (*c)->rpc_timeout = milliseconds(300);
  ASSERT_TRUE((*c)->GetStatus().ok());
  Kill();
  // Down long enough for the channel to fail to reconnect a few times and back off.
  const auto down = std::chrono::steady_clock::now() + milliseconds(1500);
  while (std::chrono::steady_clock::now() < down) {
    ASSERT_FALSE((*c)->GetStatus().ok()) << "a call was answered with no coordinator";
  }
  ASSERT_EQ(Start("", address), address);
  const auto serving = std::chrono::steady_clock::now();
  for (auto r = (*c)->GetStatus(); !r.ok(); r = (*c)->GetStatus()) {
    ASSERT_LT(std::chrono::steady_clock::now() - serving, std::chrono::seconds(8))
        << "the restarted coordinator was not found: " << r.status();
  }
  // Loopback answers within milliseconds (the test sees the coordinator's first line up to 20 ms
  // late); a second leaves room for a loaded machine and is well below the backup poll's 5 s.
  EXPECT_LT(std::chrono::steady_clock::now() - serving, std::chrono::seconds(1));
}

TEST_F(CoordinatorProcessTest, KilledAndRestartedItResumesTheJobFromItsRecord) {
  strata::testing::WriteFile(dir_.File("text.txt"), "hello");
  strata::testing::WriteFile(dir_.File("job.textproto"),
                             "name: \"elastic\"\ndata { path: \"text.txt\" }\n");
  std::string address = Start("--config job.textproto --workers 2");
  ASSERT_FALSE(address.empty());
  // A worker says which config it trains with; the coordinator admits only the job's.
  auto cfg = config::LoadJobConfig(dir_.File("job.textproto"));
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  auto worker = [&](const std::string& id) {
    coordinator::WorkerInfo w = Worker(id);
    w.set_job_config(config::ToText(launcher::JobPart(*cfg)));
    return w;
  };
  {
    auto a = CoordinatorClient::Connect(address, kToken);
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_EQ((*a)->Join(Worker("w-none")).status().code(), absl::StatusCode::kInvalidArgument);
    ASSERT_TRUE((*a)->Join(worker("w-a")).ok());
    auto b = (*a)->Join(worker("w-b"));
    ASSERT_TRUE(b.ok()) << b.status();
    ASSERT_TRUE(b->admitted());
    ASSERT_TRUE((*a)->ReportStep("w-a", 1, 1).ok());
    ASSERT_TRUE((*a)->ReportStep("w-b", 1, 1).ok());
  }
  Kill();
  // No --config: the job comes from the record.
  address = Start("");
  ASSERT_FALSE(address.empty());
  auto r = strata::testing::RunCommand(kStrata + " status " + address + " --token " + kToken);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("generation 1 (start) since step 0; step 1 done"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("rank 0  w-a"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("rank 1  w-b"), std::string::npos) << r.output;
  auto bad = strata::testing::RunCommand(kStrata + " status " + address + " --token wrong");
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_NE(bad.output.find("does not carry this job's token"), std::string::npos) << bad.output;
}

// A worker's Attach stream: SIGKILL it and the coordinator forms the next generation at once
// (the heartbeat timeout here is 30 s); a worker that finishes closes it cleanly, no failure.
TEST(CoordinatorAttachTest, AKilledWorkerFailsAtOnceAFinishedOneDoesNot) {
  strata::testing::TempDir dir;
  strata::testing::WriteFile(dir.File("text.txt"), strata::testing::SyntheticText(30000));
  auto config = [&](int steps) {
    return "model { seq_len: 16 d_model: 32 n_layers: 2 n_heads: 2\n"
           "        moe { num_experts: 4 top_k: 2 d_expert: 32 } }\n"
           "data { path: \"text.txt\" }\n"
           "train { steps: " +
           std::to_string(steps) + " global_batch: 4 eval_every: 0 threads: 1 }\n";
  };
  for (const bool kill_it : {true, false}) {
    strata::testing::WriteFile(dir.File("job.textproto"), config(kill_it ? 1000000 : 3));
    CoordinatorOptions o;
    o.dir = dir.File(kill_it ? "record-kill" : "record-finish");
    o.token = kToken;
    o.heartbeat_timeout = milliseconds(30000);
    // The job's config is the coordinator's: the worker reads it from there.
    auto state =
        CoordinatorState::Open(o, config(kill_it ? 1000000 : 3), std::chrono::steady_clock::now());
    ASSERT_TRUE(state.ok()) << state.status();
    auto server = CoordinatorServer::Start(state->get(), "127.0.0.1:0");
    ASSERT_TRUE(server.ok()) << server.status();
    const std::string log = dir.File("worker.log");
    pid_t pid = fork();
    if (pid == 0) {
      const std::string cmd = "cd " + dir.path() + " && STRATA_JOB_TOKEN=" + kToken + " exec " +
                              std::string(STRATA_BIN_DIR) + "/strata worker --coordinator " +
                              (*server)->address() + " --config job.textproto --id w1 --quiet > " +
                              log + " 2>&1";
      execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while ((*state)->Snapshot().step() < (kill_it ? 2 : 3)) {
      ASSERT_LT(std::chrono::steady_clock::now(), deadline) << strata::testing::ReadFile(log);
      std::this_thread::sleep_for(milliseconds(10));
    }
    if (kill_it) {
      ASSERT_EQ(kill(pid, SIGKILL), 0);
      const auto killed = std::chrono::steady_clock::now();
      while ((*state)->Snapshot().generation().number() == 1) {
        ASSERT_LT(std::chrono::steady_clock::now() - killed, std::chrono::seconds(10))
            << "the coordinator did not notice the dead worker";
        std::this_thread::sleep_for(milliseconds(5));
      }
      const auto seen = std::chrono::steady_clock::now() - killed;
      EXPECT_LT(seen, milliseconds(2000)) << "noticed only after the heartbeat timeout";
      EXPECT_NE((*state)->Snapshot().generation().reason().find("waiting for workers"),
                std::string::npos);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    if (!kill_it) {
      EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << strata::testing::ReadFile(log);
      std::this_thread::sleep_for(milliseconds(300));
      EXPECT_EQ((*state)->Snapshot().generation().number(), 1) << "a finished worker failed";
      EXPECT_EQ((*state)->Snapshot().generation().workers_size(), 1);
    }
  }
}

}  // namespace
}  // namespace strata::coordinator
