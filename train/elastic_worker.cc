#include "train/elastic_worker.h"

#include <algorithm>
#include <mutex>
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

Status RunElasticWorker(Membership& membership, ElasticWorkerOptions opts) {
  const std::string address = membership.address();
  const coordinator::WorkerInfo& info = opts.info;
  const std::string& id = info.id();
  TrainOptions* options = &opts.train;
  const bool progress = options->progress;
  const config::ElasticConfig& elastic = options->config.elastic();
  const std::chrono::milliseconds patience(elastic.coordinator_patience_ms());
  const std::chrono::milliseconds restart_grace(elastic.restart_grace_ms());
  const std::chrono::milliseconds heartbeat_timeout(elastic.heartbeat_timeout_ms());
  // Ends before the heartbeats started (nothing to detach from).
  auto end_early = [&](ElasticWorkerEnd end) {
    if (opts.on_end) opts.on_end(end);
    return end.status;
  };

  // A job at its maximum may have a place soon: a member that died is declared failed within a
  // heartbeat timeout (a restarted coordinator's restart grace). Wait for one up to `patience`.
  // A retried Join the coordinator already recorded answers ALREADY_EXISTS: that is a success
  // (the worker is pending or a member; the wait below finds its generation).
  bool join_sent = false;
  auto join = [&]() -> StatusOr<coordinator::JoinReply> {
    auto r = membership.Join(info);
    if (join_sent && r.status().code() == absl::StatusCode::kAlreadyExists) {
      return coordinator::JoinReply();
    }
    join_sent = true;
    return r;
  };
  auto joined = RetryWhileUnreachable("joining", address, patience, join);
  for (auto [full_until, told] = std::pair(std::chrono::steady_clock::now() + patience, false);
       !joined.ok() && joined.status().code() == absl::StatusCode::kResourceExhausted &&
       std::chrono::steady_clock::now() < full_until;
       told = true) {
    if (!told) {
      STRATA_LOG(INFO) << "worker " << id << ": " << joined.status().message() << "; waiting up to "
                       << patience.count() / 1000 << " s for a place";
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    joined = RetryWhileUnreachable("joining", address, patience, join);
  }
  if (!joined.ok()) {
    // A job that finished while this worker waited has nothing to join: not a failure.
    if (auto st = membership.GetStatus(); st.ok() && st->finished()) {
      return end_early(
          Done(absl::StrFormat("the job at %s finished (step %lld) before this worker got in",
                               address, static_cast<long long>(st->step()))));
    }
    return end_early(Failed(joined.status()));
  }
  // When the coordinator last failed to answer (SteadyMs; 0: never): a restarted coordinator
  // settles for restart_grace before it declares the members that did not come back failed.
  std::atomic<int64_t> unreachable_ms{0};

  // Waits for a generation newer than `after` that holds this worker; its rank in *rank.
  // NOT_FOUND with kJobFinished when the job finishes meanwhile (a joiner still pending then).
  static constexpr char kJobFinished[] = "the job finished";
  auto wait_generation = [&](int64_t after, int* rank) -> StatusOr<coordinator::Generation> {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::minutes(10);
    auto next_status_check = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    for (bool told = false;;) {
      if (std::chrono::steady_clock::now() > next_status_check) {
        next_status_check = std::chrono::steady_clock::now() + std::chrono::seconds(1);
        if (auto st = membership.GetStatus(); st.ok() && st->finished()) {
          return absl::NotFoundError(kJobFinished);
        }
      }
      ASSIGN_OR_RETURN(coordinator::Generation g,
                       RetryWhileUnreachable(
                           "heartbeat", address, patience, [&] { return membership.Heartbeat(id); },
                           &unreachable_ms));
      *rank = -1;
      for (int i = 0; i < g.workers_size(); ++i) {
        if (g.workers(i).id() == id) *rank = i;
      }
      if (*rank >= 0 && g.number() > after) return g;
      if (std::chrono::steady_clock::now() > deadline) {
        return absl::DeadlineExceededError(
            absl::StrFormat("worker '%s' waited 10 minutes at %s for a generation to train in (%s)",
                            id, address, g.reason()));
      }
      if (!told) {
        STRATA_LOG(INFO) << "worker " << id << ": waiting at " << address << " for the job ("
                         << g.reason() << ")";
        told = true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  };

  // The coordinator watches this link: if this process dies, it knows at once.
  if (Status a = membership.Attach(id); !a.ok()) return end_early(Failed(a));
  // Heartbeats go on beside training. A newer generation aborts the collectives in flight, so the
  // step ends at once and the worker re-forms; a coordinator that went away is reattached to when
  // it is back.
  std::mutex mu;
  Trainer* active = nullptr;  // guarded by mu
  std::atomic<int64_t> training_generation{-1};
  // The newest generation the heartbeats have seen (shared: a connect left behind on its own
  // thread may still ask after this function returns).
  auto latest_generation = std::make_shared<std::atomic<int64_t>>(-1);
  // The coordinator answered that this worker is no longer part of the job (declared failed): it
  // must leave at once, not wait on peers that re-formed without it while it holds what they
  // need (the checkpoint folder's lock, a rendezvous).
  auto expelled = std::make_shared<std::atomic<bool>>(false);
  std::atomic<bool> done{false};
  std::thread heartbeats([&] {
    bool reachable = true;
    while (!done.load()) {
      auto hb = membership.Heartbeat(id);
      if (!hb.ok() && hb.status().code() == absl::StatusCode::kNotFound) {
        if (!expelled->exchange(true)) {
          STRATA_LOG(ERROR) << "worker " << id << ": the coordinator at " << address
                            << " no longer counts this worker in the job (" << hb.status().message()
                            << "); it stops";
          std::lock_guard<std::mutex> lock(mu);
          if (active != nullptr) {
            active->AbortCollectives("the coordinator declared this worker failed");
          }
        }
      } else if (!hb.ok()) {
        unreachable_ms = SteadyMs();
        if (reachable) {
          STRATA_LOG(WARNING) << "worker " << id << ": heartbeat to " << address
                              << " failed (training pauses at its next step report until it "
                                 "answers): "
                              << hb.status().message();
        }
        reachable = false;
      } else {
        if (!reachable) {
          unreachable_ms = SteadyMs();
          Status a = membership.Attach(id);
          STRATA_LOG(INFO) << "worker " << id << ": the coordinator at " << address
                           << " answers again" << (a.ok() ? "" : "; reattaching failed: ")
                           << (a.ok() ? "" : a.message());
          reachable = a.ok();
        }
        *latest_generation = std::max(latest_generation->load(), hb->number());
        std::lock_guard<std::mutex> lock(mu);
        if (active != nullptr && hb->number() > training_generation.load()) {
          active->AbortCollectives(
              absl::StrFormat("generation %d formed (%s)", hb->number(), hb->reason()),
              hb->number());
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  });
  // The end once the heartbeats run: reported, then the heartbeats stop and the worker leaves.
  auto finish = [&](ElasticWorkerEnd end) {
    if (opts.on_end) opts.on_end(end);
    done = true;
    heartbeats.join();
    // A worker that finished stays listed: the job is over, not its membership changed.
    (void)membership.Detach(/*finished=*/end.status.ok());
    return end.status;
  };

  std::unique_ptr<Trainer> trainer;
  int64_t generation = 0;
  int last_rank = -1;  // this worker's rank in `generation`
  options->on_step = [&](const StepResult& r) -> Status {
    // Rank 0 alone tells the coordinator how evenly each MoE layer routed (the whole batch: every
    // rank computed the same figures).
    const std::vector<coordinator::MoeLayerBalance> balance =
        last_rank == 0 ? MoeBalanceOf(r, trainer->model().moe_layers())
                       : std::vector<coordinator::MoeLayerBalance>{};
    auto now = RetryWhileUnreachable(
        "step report", address, patience,
        [&] {
          return membership.ReportStepWithBalance(
              id, generation, r.step, r.loss,
              r.seconds > 0 ? static_cast<double>(r.tokens) / r.seconds : 0.0, balance);
        },
        &unreachable_ms);
    if (!now.ok() && now.status().code() != absl::StatusCode::kFailedPrecondition)
      return now.status();
    if (!now.ok() || now->number() != generation) {
      return absl::AbortedError(absl::StrFormat("the membership changed after step %d", r.step));
    }
    return absl::OkStatus();
  };
  // Rank 0 keeps the coordinator's checkpoint catalog: a generation may go back to one of them.
  options->on_checkpoint = [&](int64_t step, bool committed) {
    // Retried while the coordinator is away: a commit missing from its catalog would keep a later
    // generation from going back to it.
    Status c = RetryWhileUnreachable(
                   "checkpoint report", address, patience,
                   [&]() -> StatusOr<bool> {
                     RETURN_IF_ERROR(membership.ReportCheckpoint(id, generation, step, committed));
                     return true;
                   },
                   &unreachable_ms)
                   .status();
    if (!c.ok()) {
      STRATA_LOG(WARNING) << "worker " << id << ": telling the coordinator about checkpoint "
                          << step << " failed: " << c.message();
    }
  };
  while (true) {
    int rank = -1;
    auto g = wait_generation(generation, &rank);
    last_rank = rank;
    if (!g.ok() && g.status().message() == kJobFinished) {
      return finish(
          Done(absl::StrFormat("the job at %s finished before this worker got to train", address)));
    }
    if (!g.ok()) return finish(Failed(g.status()));
    generation = g->number();
    training_generation = generation;
    WorkerOptions w;
    w.rank = rank;
    w.world_size = g->workers_size();
    // A newer generation (another failure while this one connects) ends the rendezvous and the
    // connecting at once.
    w.superseded = [latest_generation, expelled, generation] {
      return expelled->load() || latest_generation->load() > generation;
    };
    w.store = comm::MakeCancellableStore(
        comm::MakePrefixStore(membership.store(), comm::GenerationPrefix(generation)), w.superseded,
        absl::StrFormat("generation %d was superseded while its workers connected", generation));
    w.hostname = info.host();
    for (const auto& member : g->workers()) w.member_ids.push_back(member.id());
    w.elastic = true;
    w.rejoin = generation > 1;
    w.generation = generation;
    Status s;
    if (!trainer) {
      options->worker = w;
      options->progress = progress && rank == 0;
      auto created = Trainer::Create(*options);
      if (created.ok()) {
        std::lock_guard<std::mutex> lock(mu);
        trainer = std::move(*created);
        active = trainer.get();
      } else {
        s = created.status();
      }
    } else {
      STRATA_LOG(INFO) << absl::StrFormat(
          "worker %s: generation %d (%s): rank %d of %d, re-forming at step %d", id, generation,
          g->reason(), rank, w.world_size, trainer->step());
      s = trainer->Reform(w);
    }
    if (s.ok()) {
      auto started = RetryWhileUnreachable(
          "start report", address, patience,
          [&] {
            return membership.ReportStart(
                id, generation, trainer->step(),
                rank == 0 ? trainer->experts_per_worker() : std::vector<int64_t>{});
          },
          &unreachable_ms);
      s = started.status();
      if (s.ok() && started->number() != generation) {
        s = absl::AbortedError("the membership changed while re-forming");
      }
    }
    if (s.ok()) {
      s = trainer->Run();
      if (s.ok()) break;
    }
    // A newer generation explains the failure: re-form for it. A peer's death can reach this
    // worker (a broken connection) before the coordinator has formed the next generation, so a
    // communication error waits for it up to the failure detector's bound — and, when the
    // coordinator was down (a peer may have died meanwhile, unseen), until a restarted
    // coordinator has settled and declared the members that did not come back failed. Anything
    // else (and no new generation) ends the worker.
    const bool comm_error = s.code() == absl::StatusCode::kUnavailable ||
                            s.code() == absl::StatusCode::kDeadlineExceeded ||
                            s.code() == absl::StatusCode::kAborted;
    const std::chrono::milliseconds detect = 2 * heartbeat_timeout + std::chrono::seconds(1);
    const auto failed_at = std::chrono::steady_clock::now();
    auto wait_until =
        std::chrono::steady_clock::now() + (comm_error ? detect : std::chrono::milliseconds(0));
    auto settled_after_restart = [&] {
      return std::chrono::steady_clock::time_point(
                 std::chrono::milliseconds(unreachable_ms.load())) +
             restart_grace + detect;
    };
    // A worker that finished the job's last step ended it: this one's failed step is moot.
    if (auto st = membership.GetStatus(); st.ok() && st->finished()) {
      STRATA_LOG(INFO) << "worker " << id << ": the job finished on its other workers ("
                       << s.message() << ")";
      return finish(Done());
    }
    if (expelled->load()) {
      return finish(Failed(absl::NotFoundError(absl::StrFormat(
          "the coordinator at %s declared worker '%s' failed, so it left the job (%s); the others "
          "go on without it, and a worker started again joins with a new id",
          address, id, s.message()))));
    }
    bool newer = false;
    while (true) {
      auto now = RetryWhileUnreachable(
          "heartbeat", address, patience, [&] { return membership.Heartbeat(id); },
          &unreachable_ms);
      newer = now.ok() && now->number() > generation;
      if (comm_error && unreachable_ms.load() > 0) {
        // Never past patience from the failure, however the coordinator comes and goes.
        wait_until = std::min(std::max(wait_until, settled_after_restart()), failed_at + patience);
      }
      if (!now.ok()) {
        STRATA_LOG(WARNING) << "worker " << id << ": asking " << address
                            << " for the next generation failed: " << now.status();
      }
      if (newer || !now.ok() || std::chrono::steady_clock::now() >= wait_until) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    if (newer) {
      STRATA_LOG(INFO) << "worker " << id << ": generation " << generation << " ended ("
                       << s.message() << ")";
      continue;
    }
    return finish(Failed(s));
  }
  return finish(Done("", trainer.get(), last_rank));
}

}  // namespace strata::train
