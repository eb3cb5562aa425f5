#include "train/elastic_worker.h"

#include "train/heartbeat.h"

#include <algorithm>
#include <utility>

namespace strata::train {
namespace {

// An end that is not a failure; `message` says why the worker did not train (empty: it trained, or
// the job finished on the others).
ElasticWorkerEnd Done(std::string message = "", const Trainer* trainer = nullptr, int rank = -1) {
  ElasticWorkerEnd end;
  end.message = std::move(message);
  end.trainer = trainer;
  end.rank = rank;
  return end;
}

ElasticWorkerEnd Failed(Status status) {
  ElasticWorkerEnd end;
  end.status = std::move(status);
  return end;
}

}  // namespace

std::vector<coordinator::MoeLayerBalance> MoeBalanceOf(
    const StepResult& r, const std::vector<model::MoeTransformer::MoeLayerRef>& layers) {
  std::vector<coordinator::MoeLayerBalance> out;
  out.reserve(r.moe.size());
  for (size_t i = 0; i < r.moe.size(); ++i) {
    const BalanceSummary s = SummarizeBalance(r.moe[i]);
    coordinator::MoeLayerBalance& b = out.emplace_back();
    // r.moe follows moe_layers(); a layer it does not name is shown by its position.
    b.set_block(i < layers.size() ? layers[i].block : static_cast<int>(i));
    b.set_max_over_mean(s.max_over_mean);
    b.set_cv(s.cv);
    if (s.has_bias) {
      b.set_bias_min(s.bias_min);
      b.set_bias_max(s.bias_max);
    }
    // Figures the coordinator would refuse (a bias gone non-finite) are not worth a step report:
    // the display goes without them.
    const bool sane = std::isfinite(s.max_over_mean) && std::isfinite(s.cv) &&
                      s.max_over_mean >= 0 && s.cv >= 0 &&
                      (!s.has_bias || (std::isfinite(s.bias_min) && std::isfinite(s.bias_max) &&
                                       s.bias_min <= s.bias_max));
    if (!sane) return {};
  }
  return out;
}

namespace {

// One worker's life, a small state machine: joining -> waiting for a generation that holds it ->
// training that generation (created or re-formed) -> waiting for the next one, or finishing. Its
// heartbeat runs beside it from the first wait on. See RunElasticWorker.
class ElasticWorker {
 public:
  ElasticWorker(Membership& membership, ElasticWorkerOptions opts)
      : membership_(membership),
        opts_(std::move(opts)),
        address_(membership.address()),
        id_(opts_.info.id()),
        progress_(opts_.train.progress),
        patience_(opts_.train.config.elastic().coordinator_patience_ms()),
        restart_grace_(opts_.train.config.elastic().restart_grace_ms()),
        heartbeat_timeout_(opts_.train.config.elastic().heartbeat_timeout_ms()),
        heartbeat_(membership, opts_.info.id()) {}

  Status Run();

 private:
  enum class State { kJoining, kWaiting, kTraining, kFinishing };

  // Each state's work; it returns the next state, and end_ when that is kFinishing.
  State Join();
  State WaitForGeneration();
  State Train();
  // A generation that did not train to the end: the next one explains it (kWaiting), or the
  // worker ends.
  State AfterFailedGeneration(const Status& s);
  // Reports the end, then stops the heartbeats and leaves the coordinator (when it got that far).
  Status Finish();

  // A generation newer than `after` that holds this worker; its rank in *rank. NOT_FOUND with
  // kJobFinished when the job finishes meanwhile (a joiner still pending then).
  static constexpr char kJobFinished[] = "the job finished";
  StatusOr<coordinator::Generation> NextGeneration(int64_t after, int* rank);
  // This worker's options for generation g (rank `rank`).
  WorkerOptions OptionsFor(const coordinator::Generation& g, int rank) const;
  // The trainer for generation_: created for the first, re-formed for every later one; then the
  // start report.
  Status CreateOrReform(const coordinator::Generation& g, const WorkerOptions& w);
  // TrainOptions::on_step and on_checkpoint.
  Status ReportStep(const StepResult& r);
  void ReportCheckpoint(int64_t step, bool committed);
  // RetryWhileUnreachable on the coordinator, recording when it did not answer.
  template <typename Call>
  auto Retry(const char* what, Call&& call) {
    return RetryWhileUnreachable(what, address_, patience_, std::forward<Call>(call),
                                 &heartbeat_.unreachable_ms());
  }

  Membership& membership_;
  ElasticWorkerOptions opts_;
  const std::string address_;
  const std::string id_;
  const bool progress_;
  const std::chrono::milliseconds patience_, restart_grace_, heartbeat_timeout_;
  std::unique_ptr<Trainer> trainer_;
  // Declared after trainer_, so destroyed (its thread stopped) before the trainer it aborts.
  Heartbeat heartbeat_;
  coordinator::Generation next_;  // the generation kWaiting found, for kTraining
  int next_rank_ = -1;
  int64_t generation_ = 0;  // the generation trained in (0: none yet)
  int last_rank_ = -1;      // this worker's rank in generation_
  // Rank 0: the metrics line of the step it is about to report ("" when none or too long).
  std::string metrics_line_;
  bool told_line_too_long_ = false;
  ElasticWorkerEnd end_;
};

Status ElasticWorker::Run() {
  opts_.train.on_step = [this](const StepResult& r) { return ReportStep(r); };
  // Rank 0 sends each step's metrics line with its report, for the coordinator's dashboard (a
  // callback already set, the worker's own dashboard, still gets every line).
  opts_.train.on_metrics_line = [this, own = opts_.train.on_metrics_line](const std::string& line) {
    if (own) own(line);
    metrics_line_.clear();
    if (last_rank_ != 0) return;
    if (line.size() <= kMaxMetricsLineBytes) {
      metrics_line_ = line;
    } else if (!told_line_too_long_) {
      told_line_too_long_ = true;
      STRATA_LOG(WARNING) << "worker " << id_ << ": a metrics line of " << line.size()
                          << " bytes is longer than the " << kMaxMetricsLineBytes
                          << " a step report carries; the coordinator's dashboard goes without";
    }
  };
  opts_.train.on_checkpoint = [this](int64_t step, bool committed) {
    ReportCheckpoint(step, committed);
  };
  State state = State::kJoining;
  while (state != State::kFinishing) {
    switch (state) {
      case State::kJoining:
        state = Join();
        break;
      case State::kWaiting:
        state = WaitForGeneration();
        break;
      case State::kTraining:
        state = Train();
        break;
      case State::kFinishing:
        break;
    }
  }
  return Finish();
}

ElasticWorker::State ElasticWorker::Join() {
  // A job at its maximum may have a place soon: a member that died is declared failed within a
  // heartbeat timeout (a restarted coordinator's restart grace). Wait for one up to `patience`.
  // A retried Join the coordinator already recorded answers ALREADY_EXISTS: that is a success
  // (the worker is pending or a member; the wait for a generation finds it).
  bool join_sent = false;
  auto join = [&]() -> StatusOr<coordinator::JoinReply> {
    auto r = membership_.Join(opts_.info);
    if (join_sent && r.status().code() == absl::StatusCode::kAlreadyExists) {
      return coordinator::JoinReply();
    }
    join_sent = true;
    return r;
  };
  auto joined = RetryWhileUnreachable("joining", address_, patience_, join);
  for (auto [full_until, told] = std::pair(std::chrono::steady_clock::now() + patience_, false);
       !joined.ok() && joined.status().code() == absl::StatusCode::kResourceExhausted &&
       std::chrono::steady_clock::now() < full_until;
       told = true) {
    if (!told) {
      STRATA_LOG(INFO) << "worker " << id_ << ": " << joined.status().message()
                       << "; waiting up to " << patience_.count() / 1000 << " s for a place";
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    joined = RetryWhileUnreachable("joining", address_, patience_, join);
  }
  if (!joined.ok()) {
    // A job that finished while this worker waited has nothing to join: not a failure.
    if (auto st = membership_.GetStatus(); st.ok() && st->finished()) {
      end_ = Done(absl::StrFormat("the job at %s finished (step %lld) before this worker got in",
                                  address_, static_cast<long long>(st->step())));
    } else {
      end_ = Failed(joined.status());
    }
    return State::kFinishing;
  }
  // The coordinator watches this link: if this process dies, it knows at once. Heartbeats go on
  // beside training from now on.
  if (Status a = membership_.Attach(id_); !a.ok()) {
    end_ = Failed(a);
    return State::kFinishing;
  }
  heartbeat_.Start();
  return State::kWaiting;
}

StatusOr<coordinator::Generation> ElasticWorker::NextGeneration(int64_t after, int* rank) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::minutes(10);
  auto next_status_check = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  for (bool told = false;;) {
    if (std::chrono::steady_clock::now() > next_status_check) {
      next_status_check = std::chrono::steady_clock::now() + std::chrono::seconds(1);
      if (auto st = membership_.GetStatus(); st.ok() && st->finished()) {
        return absl::NotFoundError(kJobFinished);
      }
    }
    ASSIGN_OR_RETURN(coordinator::Generation g,
                     Retry("heartbeat", [&] { return membership_.Heartbeat(id_); }));
    *rank = -1;
    for (int i = 0; i < g.workers_size(); ++i) {
      if (g.workers(i).id() == id_) *rank = i;
    }
    if (*rank >= 0 && g.number() > after) return g;
    if (std::chrono::steady_clock::now() > deadline) {
      return absl::DeadlineExceededError(
          absl::StrFormat("worker '%s' waited 10 minutes at %s for a generation to train in (%s)",
                          id_, address_, g.reason()));
    }
    if (!told) {
      STRATA_LOG(INFO) << "worker " << id_ << ": waiting at " << address_ << " for the job ("
                       << g.reason() << ")";
      told = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

ElasticWorker::State ElasticWorker::WaitForGeneration() {
  StatusOr<coordinator::Generation> g = NextGeneration(generation_, &next_rank_);
  last_rank_ = next_rank_;
  if (!g.ok() && g.status().message() == kJobFinished) {
    end_ =
        Done(absl::StrFormat("the job at %s finished before this worker got to train", address_));
    return State::kFinishing;
  }
  if (!g.ok()) {
    end_ = Failed(g.status());
    return State::kFinishing;
  }
  next_ = *std::move(g);
  return State::kTraining;
}

WorkerOptions ElasticWorker::OptionsFor(const coordinator::Generation& g, int rank) const {
  const int64_t generation = g.number();
  WorkerOptions w;
  w.rank = rank;
  w.world_size = g.workers_size();
  // A newer generation (another failure while this one connects) ends the rendezvous and the
  // connecting at once.
  w.superseded = [latest = heartbeat_.latest_generation(), expelled = heartbeat_.expelled(),
                  generation] { return expelled->load() || latest->load() > generation; };
  w.store = comm::MakeCancellableStore(
      comm::MakePrefixStore(membership_.store(), comm::GenerationPrefix(generation)), w.superseded,
      absl::StrFormat("generation %d was superseded while its workers connected", generation));
  w.hostname = opts_.info.host();
  for (const auto& member : g.workers()) w.member_ids.push_back(member.id());
  w.elastic = true;
  w.rejoin = generation > 1;
  w.generation = generation;
  return w;
}

Status ElasticWorker::CreateOrReform(const coordinator::Generation& g, const WorkerOptions& w) {
  if (!trainer_) {
    opts_.train.worker = w;
    opts_.train.progress = progress_ && w.rank == 0;
    ASSIGN_OR_RETURN(trainer_, Trainer::Create(opts_.train));
    heartbeat_.set_abort([trainer = trainer_.get()](const std::string& why, int64_t newer) {
      trainer->AbortCollectives(why, newer);
    });
  } else {
    STRATA_LOG(INFO) << absl::StrFormat(
        "worker %s: generation %d (%s): rank %d of %d, re-forming at step %d", id_, generation_,
        g.reason(), w.rank, w.world_size, trainer_->step());
    RETURN_IF_ERROR(trainer_->Reform(w));
  }
  ASSIGN_OR_RETURN(coordinator::Generation now, Retry("start report", [&] {
                     return membership_.ReportStart(
                         id_, generation_, trainer_->step(),
                         w.rank == 0 ? trainer_->experts_per_worker() : std::vector<int64_t>{});
                   }));
  if (now.number() != generation_) {
    return absl::AbortedError("the membership changed while re-forming");
  }
  return absl::OkStatus();
}

ElasticWorker::State ElasticWorker::Train() {
  generation_ = next_.number();
  heartbeat_.set_training_generation(generation_);
  Status s = CreateOrReform(next_, OptionsFor(next_, next_rank_));
  if (s.ok()) s = trainer_->Run();
  if (s.ok()) {
    end_ = Done("", trainer_.get(), last_rank_);
    return State::kFinishing;
  }
  return AfterFailedGeneration(s);
}

ElasticWorker::State ElasticWorker::AfterFailedGeneration(const Status& s) {
  // A newer generation explains the failure: re-form for it. A peer's death can reach this worker
  // (a broken connection) before the coordinator has formed the next generation, so a
  // communication error waits for it up to the failure detector's bound — and, when the
  // coordinator was down (a peer may have died meanwhile, unseen), until a restarted coordinator
  // has settled and declared the members that did not come back failed. Anything else (and no
  // new generation) ends the worker.
  const bool comm_error = s.code() == absl::StatusCode::kUnavailable ||
                          s.code() == absl::StatusCode::kDeadlineExceeded ||
                          s.code() == absl::StatusCode::kAborted;
  const std::chrono::milliseconds detect = 2 * heartbeat_timeout_ + std::chrono::seconds(1);
  const auto failed_at = std::chrono::steady_clock::now();
  auto wait_until =
      std::chrono::steady_clock::now() + (comm_error ? detect : std::chrono::milliseconds(0));
  auto settled_after_restart = [&] {
    return std::chrono::steady_clock::time_point(
               std::chrono::milliseconds(heartbeat_.unreachable_ms().load())) +
           restart_grace_ + detect;
  };
  // A worker that finished the job's last step ended it: this one's failed step is moot.
  if (auto st = membership_.GetStatus(); st.ok() && st->finished()) {
    STRATA_LOG(INFO) << "worker " << id_ << ": the job finished on its other workers ("
                     << s.message() << ")";
    end_ = Done();
    return State::kFinishing;
  }
  if (heartbeat_.expelled()->load()) {
    end_ = Failed(absl::NotFoundError(absl::StrFormat(
        "the coordinator at %s declared worker '%s' failed, so it left the job (%s); the others "
        "go on without it, and a worker started again joins with a new id",
        address_, id_, s.message())));
    return State::kFinishing;
  }
  bool newer = false;
  while (true) {
    auto now = Retry("heartbeat", [&] { return membership_.Heartbeat(id_); });
    newer = now.ok() && now->number() > generation_;
    if (comm_error && heartbeat_.unreachable_ms().load() > 0) {
      // Never past patience from the failure, however the coordinator comes and goes.
      wait_until = std::min(std::max(wait_until, settled_after_restart()), failed_at + patience_);
    }
    if (!now.ok()) {
      STRATA_LOG(WARNING) << "worker " << id_ << ": asking " << address_
                          << " for the next generation failed: " << now.status();
    }
    if (newer || !now.ok() || std::chrono::steady_clock::now() >= wait_until) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (newer) {
    STRATA_LOG(INFO) << "worker " << id_ << ": generation " << generation_ << " ended ("
                     << s.message() << ")";
    return State::kWaiting;
  }
  end_ = Failed(s);
  return State::kFinishing;
}

Status ElasticWorker::ReportStep(const StepResult& r) {
  // Rank 0 alone tells the coordinator how evenly each MoE layer routed (the whole batch: every
  // rank computed the same figures).
  const std::vector<coordinator::MoeLayerBalance> balance =
      last_rank_ == 0 ? MoeBalanceOf(r, trainer_->model().moe_layers())
                      : std::vector<coordinator::MoeLayerBalance>{};
  auto now = Retry("step report", [&] {
    return membership_.ReportStepWithBalance(
        id_, generation_, r.step, r.loss,
        r.seconds > 0 ? static_cast<double>(r.tokens) / r.seconds : 0.0, balance, metrics_line_);
  });
  metrics_line_.clear();
  if (!now.ok() && now.status().code() != absl::StatusCode::kFailedPrecondition) {
    return now.status();
  }
  if (!now.ok() || now->number() != generation_) {
    return absl::AbortedError(absl::StrFormat("the membership changed after step %d", r.step));
  }
  return absl::OkStatus();
}

void ElasticWorker::ReportCheckpoint(int64_t step, bool committed) {
  // Rank 0 keeps the coordinator's checkpoint catalog: a generation may go back to one of them.
  // Retried while the coordinator is away: a commit missing from its catalog would keep a later
  // generation from going back to it.
  Status c = Retry("checkpoint report", [&]() -> StatusOr<bool> {
               RETURN_IF_ERROR(membership_.ReportCheckpoint(id_, generation_, step, committed));
               return true;
             }).status();
  if (!c.ok()) {
    STRATA_LOG(WARNING) << "worker " << id_ << ": telling the coordinator about checkpoint " << step
                        << " failed: " << c.message();
  }
}

Status ElasticWorker::Finish() {
  if (opts_.on_end) opts_.on_end(end_);
  if (heartbeat_.running()) {
    heartbeat_.Stop();
    heartbeat_.set_abort(nullptr);
    // A worker that finished stays listed: the job is over, not its membership changed.
    (void)membership_.Detach(/*finished=*/end_.status.ok());
  }
  return end_.status;
}

}  // namespace

Status RunElasticWorker(Membership& membership, ElasticWorkerOptions opts) {
  return ElasticWorker(membership, std::move(opts)).Run();
}

}  // namespace strata::train
