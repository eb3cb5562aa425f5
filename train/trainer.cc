#include "train/trainer.h"

#include <cmath>
#include <optional>
#include <set>
#include <thread>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "checkpoint/safetensors.h"
#include "core/common/clock.h"
#include "core/common/fault_point.h"
#include "core/common/logging.h"
#include "proto/config_io.h"
#include "runtime/model/memory_estimate.h"
#include "train/export_params.h"

namespace strata::train {

// The ElasticHost over this trainer: the model, store and communicators of its generation, and the
// two things a TIERED re-form asks of it.
class Trainer::Host final : public ElasticHost {
 public:
  explicit Host(Trainer& t) : t_(t) {}
  int rank() const override { return t_.options_.worker.rank; }
  int world_size() const override { return t_.options_.worker.world_size; }
  ops::Context& context() override { return t_.ctx_; }
  int64_t step() const override { return t_.step_; }
  model::MoeTransformer* model() const override { return t_.model_.get(); }
  model::AdamW* optimizer() const override { return t_.optimizer_.get(); }
  scheduler::TieredExpertScheduler* scheduler() const override { return t_.scheduler_.get(); }
  comm::Communicator* world() const override { return t_.comms_.world(); }
  const std::vector<int64_t>& experts_per_worker() const override { return t_.experts_per_worker_; }
  int64_t first_expert() const override { return t_.first_expert_; }
  int64_t num_experts() const override { return t_.num_experts_; }

  std::unique_ptr<storage::TieredExpertStore> ReleaseStore() override {
    if (t_.model_) t_.model_->AttachResidency(nullptr);
    t_.experts_.reset();
    std::unique_ptr<storage::TieredExpertStore> store = t_.scheduler_->ReleaseStore();
    t_.scheduler_.reset();
    return store;
  }

  StatusOr<StoreMover> MakeStoreMover(std::unique_ptr<storage::TieredExpertStore> store) override {
    StoreMover m;
    model::ModelOptions mo = t_.ModelOptionsOf(0, -1, /*unbound_experts=*/true);
    mo.max_batch = 1;
    mo.bf16 = false;  // it moves experts between stores and multiplies nothing: no bf16 copies
    ASSIGN_OR_RETURN(m.model, model::MoeTransformer::Create(t_.ctx_, mo));
    RETURN_IF_ERROR(t_.tiers_.EnsureBudgets(t_.options_.config.storage(), *m.model));
    ASSIGN_OR_RETURN(const scheduler::TieredOptions to, t_.TieredOptionsOf());
    const bool fresh = store == nullptr;
    ASSIGN_OR_RETURN(m.scheduler,
                     scheduler::TieredExpertScheduler::Create(*m.model, to, std::move(store)));
    // A store made here may sit beside checkpoints of this worker's shard (an id it had before).
    if (fresh && t_.checkpoints_) t_.checkpoints_->AdoptStore(m.scheduler.get());
    return m;
  }

 private:
  Trainer& t_;
};

Trainer::Trainer(const TrainOptions& options)
    : options_(options),
      progress_(options.config.name(), options.config.train().steps(),
                options.config.train().log_every()) {}

Trainer::~Trainer() {
  if (checkpoints_) {
    // A Run that finished waited for its checkpoints; one that did not (an error, a superseded
    // generation) gives up a commit still waiting for other workers' shards, which may never come.
    checkpoints_->Abandon();
    Status s = checkpoints_->Wait();
    if (!s.ok()) STRATA_LOG(ERROR) << s.message();
  }
  if (model_) model_->AttachResidency(nullptr);
  experts_.reset();
  scheduler_.reset();  // closes the SSD tier's files before its temporary folder goes
  checkpoints_.reset();
}

StatusOr<scheduler::TieredOptions> Trainer::TieredOptionsOf() {
  // Workers on one machine keep their experts apart. On a GPU the MoE layer runs the store's
  // experts from one thread (one stream), so the store needs slots for that one thread only.
  const int expert_threads = device_.is_cpu() ? pool_->num_threads() : 1;
  return tiers_.OptionsFor(options_.config, expert_threads, options_.wrap_io, checkpoints_.get(),
                           distributed() ? absl::StrCat("rank-", options_.worker.rank) : "");
}

Status Trainer::SetUpTiered(std::unique_ptr<storage::TieredExpertStore> store) {
  RETURN_IF_ERROR(tiers_.EnsureBudgets(options_.config.storage(), *model_));
  ASSIGN_OR_RETURN(const scheduler::TieredOptions to, TieredOptionsOf());
  ASSIGN_OR_RETURN(scheduler_,
                   scheduler::TieredExpertScheduler::Create(*model_, to, std::move(store)));
  model_->AttachResidency(scheduler_.get());
  // The checkpoints' references to versions in the store are reached through this scheduler now.
  if (checkpoints_) checkpoints_->RebindStore(scheduler_.get());
  return absl::OkStatus();
}

Status Trainer::SetUpWorkers() {
  const config::JobConfig& cfg = options_.config;
  const WorkerOptions& w = options_.worker;
  const int W = w.world_size;
  const config::ParallelConfig& par = cfg.parallel();
  ASSIGN_OR_RETURN(const int ep, GroupSize(par, W, w.elastic));
  RETURN_IF_ERROR(CheckWorkerLayout(cfg, w, ep));
  if (w.rank == 0 && par.expert_parallel() != 0 && ep != par.expert_parallel()) {
    STRATA_LOG(WARNING) << absl::StrFormat(
        "parallel.expert_parallel = %d does not divide this generation's %d workers: its "
        "expert-parallel groups have %d workers",
        par.expert_parallel(), W, ep);
  }
  comm::CommOptions co;
  co.timeout = std::chrono::milliseconds(par.timeout_ms());
  co.hostname = w.hostname;
  RETURN_IF_ERROR(comms_.Connect(w.store, co, {w.rank, W, ep, par.local_size()}, w.superseded));
  // Every worker has connected every group once all pass this barrier.
  Status b = comms_.world()->Barrier();
  if (!b.ok()) {
    return Status(b.code(), absl::StrCat("waiting for every worker to connect: ", b.message()));
  }
  if (w.rank == 0 && w.after_rendezvous) w.after_rendezvous();
  STRATA_LOG(INFO) << absl::StrFormat(
      "worker %d of %d: expert-parallel groups of %d%s, %d copies of each expert, %d of the %d "
      "sequences of every step, %d dispatch chunks",
      w.rank, W, ep,
      par.local_size() > 0 && par.local_size() < ep
          ? absl::StrFormat(" (two-level all-to-all, %d per node)", par.local_size())
          : "",
      W / ep, BatchShare(cfg.train().global_batch(), W, w.rank).second, cfg.train().global_batch(),
      par.dispatch_chunks());
  return absl::OkStatus();
}

namespace {

Status CheckLossFinite(double loss, int64_t step, double lr) {
  if (std::isfinite(loss)) return absl::OkStatus();
  return absl::InternalError(
      absl::StrFormat("the training loss became %f at step %d; lower train.lr (now %g) or raise "
                      "train.warmup_steps, and check the data file",
                      loss, step, lr));
}

}  // namespace

double Trainer::LearningRate(const config::TrainConfig& t, int64_t s) {
  const double peak = t.lr();
  if (s < t.warmup_steps()) return peak * static_cast<double>(s + 1) / t.warmup_steps();
  if (t.schedule() == config::TrainConfig::CONSTANT) return peak;
  const double min_lr = peak * t.min_lr_ratio();
  const double span = std::max(1, t.steps() - t.warmup_steps());
  const double progress = std::min(1.0, static_cast<double>(s - t.warmup_steps()) / span);
  return min_lr + 0.5 * (1.0 + std::cos(M_PI * progress)) * (peak - min_lr);
}

Status Trainer::OpenCheckpoints(bool continuing) {
  const config::JobConfig& cfg = options_.config;
  const bool resume = options_.resume;
  checkpoint::CheckpointOptions co = checkpoint::CheckpointOptionsOf(cfg);
  co.wrap_io = options_.wrap_io;
  co.start_over = options_.start_over && !continuing;
  co.abandoned = comms_.CheckpointAbandonFlag();
  if (distributed()) {
    // Each worker writes its own shard; rank 0 also commits every checkpoint.
    co.shard = shard_names_.at(static_cast<size_t>(options_.worker.rank));
    co.committer = options_.worker.rank == 0;
    co.generation = options_.worker.generation;
  } else if (!options_.worker.member_ids.empty()) {
    // A coordinator's worker alone keeps the shard named by its id: the one a TIERED store shares
    // across generations of any size.
    ASSIGN_OR_RETURN(co.shard, checkpoint::ShardNameOfWorker(options_.worker.member_ids[0]));
    co.generation = options_.worker.generation;
  }
  ASSIGN_OR_RETURN(checkpoints_, checkpoint::CheckpointManager::Open(co, resume && !continuing));
  if (resume || continuing) RETURN_IF_ERROR(checkpoints_->CheckCompatible(cfg));
  if (!resume && !continuing && checkpoints_->committer() && !checkpoints_->Steps().empty()) {
    return absl::AlreadyExistsError(absl::StrFormat(
        "checkpoint folder '%s' already holds checkpoints (the newest of step %d); pass "
        "--resume to continue from it, or choose an empty folder",
        co.dir, checkpoints_->Steps().back()));
  }
  return absl::OkStatus();
}

Status Trainer::OpenWorkerCheckpoints(bool continuing) {
  if (options_.config.checkpoint().dir().empty()) return absl::OkStatus();
  const WorkerOptions& w = options_.worker;
  ASSIGN_OR_RETURN(shard_names_,
                   checkpoint::ShardNamesOf(w.member_ids, w.world_size, w.generation));
  // Rank 0 (the committer) first: it moves a folder aside (--start-over) and clears reports of
  // checkpoints no longer in flight before any other worker opens its shard. Every worker learns
  // whether the others could open theirs, so that none waits on a collective for one that failed.
  // A worker that keeps its shard open across a re-form (a TIERED worker's store shares its SSD
  // tier) continues in it; the others open theirs. Every worker takes part in the three rounds,
  // whichever it does: the previous committer first gives up its role (it may not be rank 0 now),
  // then rank 0 takes it, lists what is committed and clears old reports, then the others.
  const bool first = options_.worker.rank == 0;
  const bool keep = checkpoints_ != nullptr;
  const bool was_committer = keep && checkpoints_->committer();
  const std::string& mine = shard_names_.at(static_cast<size_t>(options_.worker.rank));
  auto take = [&]() -> Status {
    if (!keep) return OpenCheckpoints(continuing);
    if (checkpoints_->shard_name() != mine) {
      return absl::InternalError(absl::StrFormat(
          "this worker's checkpoint shard was '%s' and is now '%s': a shard kept open across a "
          "re-form must keep its name (the worker's id)",
          checkpoints_->shard_name(), mine));
    }
    return ContinueCheckpoints();
  };
  const std::string folder =
      absl::StrFormat("the checkpoint folder '%s'", options_.config.checkpoint().dir());
  comm::Communicator& world = *comms_.world();
  RETURN_IF_ERROR(AllWorkersOk(world, was_committer && !first ? take() : Status(),
                               "the previous committer could not give up " + folder));
  RETURN_IF_ERROR(
      AllWorkersOk(world, first ? take() : Status(), "rank 0 could not open " + folder));
  return AllWorkersOk(world, !first && !was_committer ? take() : Status(),
                      "another worker could not open " + folder);
}

model::ModelOptions Trainer::ModelOptionsOf(int64_t first, int64_t count,
                                            bool unbound_experts) const {
  const config::JobConfig& cfg = options_.config;
  model::ModelOptions mo;
  mo.config = cfg.model();
  mo.seed = cfg.seed();
  mo.max_batch = local_batch_;
  mo.batch_sequences = cfg.train().global_batch();
  mo.expert_factory = options_.expert_factory;
  mo.unbound_experts = unbound_experts;
  mo.first_local_expert = first;
  mo.num_local_experts = count;
  mo.device = device_;
  mo.bf16 = config::Bf16Gemms(cfg.train().precision(), !device_.is_cpu());
  return mo;
}

Status Trainer::BuildModel(int64_t first, int64_t count) {
  // The seams point into the model, optimizer and reducers about to be replaced: they go first
  // and are chosen anew below.
  gradients_.reset();
  keeping_.reset();
  const config::JobConfig& cfg = options_.config;
  const bool tiered = cfg.storage().mode() == config::StorageConfig::TIERED;
  ASSIGN_OR_RETURN(model_,
                   model::MoeTransformer::Create(ctx_, ModelOptionsOf(first, count, tiered)));
  const int64_t E = cfg.model().moe().num_experts();
  first_expert_ = first;
  num_experts_ = count < 0 ? E : count;
  optimizer_ = std::make_unique<model::AdamW>(
      tiered ? model_->DenseParameters() : model_->Parameters(), AdamWOptionsOf(cfg.train()));
  // The step's seams for this model and these communicators: a worker's reducers around the
  // model and its data-parallel gradient sync, or one process's.
  if (distributed()) {
    if (comms_.ep()) {
      ASSIGN_OR_RETURN(scheduler::ExpertPlacement placement,
                       scheduler::ExpertPlacement::FromCounts(experts_per_worker_));
      scheduler::ExpertParallelOptions eo;
      // The tiered store already overlaps loading with compute by handing experts to threads as
      // they become resident; one pass per layer keeps its prefetch plan whole.
      eo.chunks = tiered ? 1 : cfg.parallel().dispatch_chunks();
      exchange_ = std::make_unique<scheduler::ExpertParallel>(comms_.ep(), placement, eo);
    }
    scheduler::DataParallelOptions dpo;
    dpo.bucket_bytes = cfg.parallel().bucket_bytes();
    comm::Communicator* replicas = comms_.ep() ? comms_.replicas() : comms_.world();
    data_parallel_ =
        std::make_unique<scheduler::DataParallel>(*model_, comms_.world(), replicas, dpo);
    model_->AttachParallel(exchange_.get(), data_parallel_.get(), data_parallel_.get());
    dense_slices_ = std::make_unique<model::ParameterSlices>(model_->DenseParameters());
    if (tracer_) {
      data_parallel_->set_tracer(tracer_.get());
      if (exchange_) exchange_->set_tracer(tracer_.get());
    }
    DataParallelGradients::Options go;
    go.ctx = &ctx_;
    go.data_parallel = data_parallel_.get();
    go.exchange = exchange_.get();
    go.dense_slices = dense_slices_.get();
    if (expert_replica_leader_) {
      const std::vector<model::Parameter*>& dense = model_->DenseParameters();
      const std::set<const model::Parameter*> is_dense(dense.begin(), dense.end());
      for (const model::Parameter* p : optimizer_->params()) {
        if (!is_dense.count(p)) go.counted_experts.push_back(p);
      }
    }
    go.workers = options_.worker.world_size;
    go.local_batch = local_batch_;
    go.global_batch = cfg.train().global_batch();
    gradients_ = std::make_unique<DataParallelGradients>(std::move(go));
  } else {
    gradients_ = std::make_unique<LocalGradients>(&ctx_, optimizer_.get());
  }
  if (elastic_) {
    // A worker alone keeps only its live version; one of several its loads, and its copies when
    // the layout keeps them.
    keeping_ = std::make_unique<ElasticKeeping>(
        elastic_.get(), ElasticKeeping::Options{distributed() && KeepsCopies(cfg), distributed()});
  } else {
    keeping_ = std::make_unique<NoKeeping>();
  }
  const int64_t n = local_batch_ * cfg.model().seq_len();
  inputs_.resize(n);
  targets_.resize(n);
  return absl::OkStatus();
}

Status Trainer::SetUpExpertState(std::unique_ptr<storage::TieredExpertStore> store) {
  if (options_.config.storage().mode() != config::StorageConfig::TIERED) {
    experts_ = std::make_unique<InMemoryExperts>();
    return absl::OkStatus();
  }
  RETURN_IF_ERROR(SetUpTiered(std::move(store)));
  scheduler_->set_tracer(tracer_.get());
  // With expert replicas every copy holds its experts in its own store; their gradients are
  // summed over the copies (the expert-parallel groups, or every worker without expert
  // parallelism) and the leader counts them in the norm.
  TieredExperts::Options to;
  to.workers = std::max(1, options_.worker.world_size);
  if (distributed()) to.replicas = comms_.ep() ? comms_.replicas() : comms_.world();
  to.counts_norm = expert_replica_leader_;
  experts_ =
      std::make_unique<TieredExperts>(scheduler_.get(), options_.config.train(), to, ctx_.tracer);
  return absl::OkStatus();
}

StatusOr<std::unique_ptr<Trainer>> Trainer::Create(const TrainOptions& options) {
  std::unique_ptr<Trainer> tr(new Trainer(options));
  tr->comms_.Reset(options.worker.generation);
  const config::JobConfig& cfg = tr->options_.config;
  RETURN_IF_ERROR(CheckTrainOptions(options));
  // The SSD tier's temporary folder, if it needs one, is made first: its sweep frees the room
  // that the folders of killed runs take, which the disk check would count against this job.
  if (TierResources::NeedsTempSsdFolder(cfg)) RETURN_IF_ERROR(tr->tiers_.EnsureTempSsdFolder());
  RETURN_IF_ERROR(config::CheckDiskHere(
      cfg,
      config::EstimateDisk(cfg, std::max(1, options.worker.world_size), options.worker.elastic),
      "job config"));
  if (options.worker.elastic) {
    tr->host_ = std::make_unique<Host>(*tr);
    tr->elastic_ = std::make_unique<ElasticState>(cfg, tr->host_.get());
  }
  storage::Env* env = options.env ? options.env : storage::Env::Default();
  ASSIGN_OR_RETURN(tr->device_, TrainingDevice(options));
  int threads = cfg.train().threads();
  if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());
  tr->pool_ = std::make_unique<ThreadPool>(threads);
  tr->ctx_.pool = tr->pool_.get();
  if (!tr->device_.is_cpu()) {
    // Every thread of the step on this process's GPU (a worker's may be another than GPU 0).
    UseDevice(tr->device_);
    tr->pool_->Run([device = tr->device_](int, int) { UseDevice(device); });
  }
  if (!options.trace_path.empty()) {
    tr->tracer_ = std::make_unique<Tracer>();
    tr->ctx_.tracer = tr->tracer_.get();
    tr->pool_->Run([&](int tid, int) {
      tr->tracer_->NameThisThread(tid == 0 ? std::string("compute 0 (main)")
                                           : absl::StrCat("compute ", tid));
    });
  }

  ASSIGN_OR_RETURN(tr->dataset_, data::TokenDataset::Open(cfg.data(), cfg.model().vocab_size(),
                                                          cfg.model().seq_len(), env));
  tr->local_batch_ = cfg.train().global_batch();
  int64_t first = 0, count = -1;
  std::optional<SyncedState> synced;
  if (tr->distributed()) {
    RETURN_IF_ERROR(tr->SetUpWorkers());
    const int W = options.worker.world_size, rank = options.worker.rank;
    std::tie(tr->first_sequence_, tr->local_batch_) =
        BatchShare(cfg.train().global_batch(), W, rank);
    const int ep = tr->comms_.ep() ? tr->comms_.ep()->world_size() : 1;
    const int64_t E = cfg.model().moe().num_experts();
    RETURN_IF_ERROR(tr->OpenWorkerCheckpoints(/*continuing=*/options.worker.rejoin));
    if (options.worker.rejoin) {
      // Joining a running job: the others hand over the state (or all go back to a checkpoint).
      ASSIGN_OR_RETURN(synced, tr->elastic_->SyncState());
      if (synced->from_checkpoint) RETURN_IF_ERROR(tr->ReopenForCheckpoint());
      tr->experts_per_worker_ = synced->counts;
    } else if (cfg.parallel().experts_per_worker_size() > 0 && ep > 1) {
      tr->experts_per_worker_.assign(cfg.parallel().experts_per_worker().begin(),
                                     cfg.parallel().experts_per_worker().end());
    } else {
      ASSIGN_OR_RETURN(scheduler::ExpertPlacement even, scheduler::ExpertPlacement::Even(E, ep));
      for (int g = 0; g < ep; ++g) tr->experts_per_worker_.push_back(even.count(g));
    }
    ASSIGN_OR_RETURN(scheduler::ExpertPlacement placement,
                     scheduler::ExpertPlacement::FromCounts(tr->experts_per_worker_));
    first = placement.first(rank % ep);
    count = placement.count(rank % ep);
    tr->expert_replica_leader_ = rank < ep;
  } else if (options.worker.rejoin) {
    // Joining a running job alone: its only source is the latest checkpoint.
    ASSIGN_OR_RETURN(synced, tr->elastic_->SyncState());
    tr->experts_per_worker_ = synced->counts;
  }
  RETURN_IF_ERROR(tr->BuildModel(first, count));
  // Workers opened their shards above; a worker joining a running job alone may have opened the
  // folder already, to go back to a checkpoint.
  if (cfg.checkpoint().dir().empty() && options.resume) {
    return absl::InvalidArgumentError(
        "--resume needs a checkpoint folder: pass --checkpoint-dir or set checkpoint.dir");
  }
  if (!tr->checkpoints_ && !tr->distributed() && !cfg.checkpoint().dir().empty()) {
    RETURN_IF_ERROR(tr->OpenCheckpoints(/*continuing=*/options.worker.rejoin));
  }
  RETURN_IF_ERROR(tr->SetUpExpertState(synced ? std::move(synced->store) : nullptr));

  if (!options.metrics_path.empty()) {
    ASSIGN_OR_RETURN(tr->metrics_, MetricsWriter::Open(options.metrics_path, env));
  }
  if (synced) {
    RETURN_IF_ERROR(tr->StartFrom(*synced));
  } else if (options.resume) {
    RETURN_IF_ERROR(tr->Resume());
  } else if (!options.init_from.empty() || tr->distributed()) {
    RETURN_IF_ERROR(tr->InitFrom());
  }
  if (tr->distributed() || options.worker.elastic) {
    tr->worker_fields_ =
        WorkerStepFields{options.worker.rank, options.worker.world_size, options.worker.generation};
    tr->worker_fields_->device = tr->device_.ToString();
  }
  if (tr->elastic_) {
    tr->elastic_->SetLive(tr->step_);
    // An elastic TIERED worker's copies exist from the first step on (a failure during it goes on
    // from them), and a shelf that cannot be made fails the job here, not at its first step.
    if (!synced && tr->scheduler_ && KeepsCopies(cfg)) {
      RETURN_IF_ERROR(tr->elastic_->RefreshStoredCopies());
    }
  }
  return tr;
}

StatusOr<StepResult> Trainer::Step() {
  const config::JobConfig& cfg = options_.config;
  const int64_t B = cfg.train().global_batch();
  Stopwatch watch;
  TraceScope step_span(ctx_.tracer, "step", "step", static_cast<int>(step_ + 1));
  StepResult r;
  // 1. Data: this worker's share of the step's samples.
  dataset_->TrainBatch(cfg.seed(), data::TokenDataset::FirstSample(step_, B) + first_sequence_,
                       local_batch_, inputs_.data(), targets_.data());
  optimizer_->ZeroGrad(ctx_);
  // 2. Forward with the loss.
  model::GateCall call{true, static_cast<uint64_t>(step_), first_sequence_ * cfg.model().seq_len()};
  call.loss_scale = gradients_->loss_scale();
  call.sequence_length = cfg.model().seq_len();
  call.batch_tokens = B * cfg.model().seq_len();
  {
    TraceScope span(ctx_.tracer, "forward", "compute");
    r.loss = model_->Forward(ctx_, inputs_.data(), targets_.data(), local_batch_, call);
  }
  RETURN_IF_ERROR(experts_->status());
  RETURN_IF_ERROR(gradients_->status(step_ + 1));
  // A loss that is the batch's already is checked before backward spends time on it.
  if (const std::optional<double> loss = gradients_->BatchLossBeforeBackward(r.loss)) {
    RETURN_IF_ERROR(CheckLossFinite(*loss, step_ + 1, cfg.train().lr()));
  }
  // 3. Backward (a worker's dense gradients all-reduce in buckets as they fill).
  {
    TraceScope span(ctx_.tracer, "backward", "compute");
    model_->Backward(ctx_);
  }
  // 4. Gradient sync: the whole batch's loss, z-loss and gradient norm.
  ASSIGN_OR_RETURN(const BatchFigures batch,
                   gradients_->Finish(step_ + 1, r.loss, ZLossSum(*model_), *experts_));
  RETURN_IF_ERROR(CheckLossFinite(batch.loss, step_ + 1, cfg.train().lr()));
  RETURN_IF_ERROR(experts_->status());
  // 5. Update: clipped to train.grad_clip, AdamW at the scheduled rate, the experts where they
  // live; what a later generation needs is kept around it.
  r.loss = batch.loss;
  r.grad_norm = std::sqrt(batch.grad_sum_squares);
  r.lr = LearningRate(cfg.train(), step_);
  const double scale = ops::ClipScale(r.grad_norm, cfg.train().grad_clip());
  // A checkpoint saved after the last step copies the state while forward and backward ran.
  if (checkpoints_) checkpoints_->FinishSnapshot(ctx_.tracer);
  RETURN_IF_ERROR(keeping_->BeforeUpdate());
  {
    TraceScope span(ctx_.tracer, "dense optimizer", "optimizer");
    optimizer_->Step(ctx_, r.lr, scale);
    // Loss-free balancing: each selection bias moves by the step's batch-wide loads.
    for (const auto& ref : model_->moe_layers()) ref.layer->gate().UpdateBias(ctx_);
  }
  const Status updated = experts_->Update(r.lr, scale, optimizer_->steps());
  keeping_->Updated(step_ + 1, updated.ok());
  RETURN_IF_ERROR(updated);
  r.tiered = experts_->TakeStats(&r.store);
  // 6. Step boundary: the step's figures.
  RecordMoeStats(*model_, batch.z_loss, &r);
  RETURN_IF_ERROR(keeping_->AfterUpdate(r.moe));
  r.comm_seconds = gradients_->TakeCommSeconds();
  r.seconds = watch.Seconds();
  r.tokens = B * cfg.model().seq_len();
  r.step = ++step_;
  history_.push_back(r);
  return r;
}

EvalResult Trainer::Evaluate() {
  const config::JobConfig& cfg = options_.config;
  const int64_t B = cfg.train().global_batch();
  const int64_t N = B * cfg.model().seq_len();
  const int64_t n = local_batch_ * cfg.model().seq_len();
  model::GateCall call{false, static_cast<uint64_t>(step_),
                       first_sequence_ * cfg.model().seq_len()};
  call.batch_tokens = N;
  double sum = 0;
  for (int b = 0; b < cfg.train().eval_batches(); ++b) {
    dataset_->EvalBatch(b, B, first_sequence_, local_batch_, inputs_.data(), targets_.data());
    sum += model_->Forward(ctx_, inputs_.data(), targets_.data(), local_batch_, call) *
           static_cast<double>(n);
  }
  Status s = gradients_->status(step_ + 1);
  if (s.ok()) s = gradients_->SumOverWorkers(step_ + 1, &sum, 1);
  for (const Status& failed : {s, experts_->status()}) {
    if (!failed.ok()) {
      STRATA_LOG(ERROR) << "evaluation: " << failed;
      sum = std::nan("");
    }
  }
  EvalResult e;
  e.tokens = N * cfg.train().eval_batches();
  e.loss = sum / static_cast<double>(e.tokens);
  e.bits_per_byte =
      cfg.data().format() == config::DataConfig::BYTES ? e.loss / std::log(2.0) : std::nan("");
  return e;
}

Status Trainer::Run() {
  Status s = RunLoop();
  if (s.ok() && !options_.export_params_dir.empty()) {
    // Rank 0 writes the dense parameters, the leader of each expert's copies the expert into DIR;
    // copy g of an expert (its g-th expert-parallel group) into DIR/copy<g>/, to be compared.
    const std::string& dir = options_.export_params_dir;
    const int ep = comms_.ep() ? comms_.ep()->world_size() : 1;
    const ParameterExport share{
        options_.worker.rank == 0,
        expert_replica_leader_ ? dir : absl::StrCat(dir, "/copy", options_.worker.rank / ep)};
    s = ExportParameters(dir, share, *model_, scheduler_.get());
  }
  experts_->Quiesce();
  if (tracer_) {
    // Also after a failure: the trace shows what led up to it.
    Status w = tracer_->Write(options_.trace_path);
    if (w.ok()) {
      STRATA_LOG(INFO) << "trace: " << tracer_->size() << " spans written to "
                       << options_.trace_path << " (open it in ui.perfetto.dev)";
    } else if (s.ok()) {
      s = w;
    }
  }
  return s;
}

Status Trainer::RunLoop() {
  const config::JobConfig& cfg = options_.config;
  const int64_t steps = cfg.train().steps();
  progress_.Start();
  STRATA_LOG(INFO) << absl::StrFormat(
      "%s: %d parameters (%d active per token), %d MoE layers, %d train / %d held-out windows "
      "of %d tokens, %d threads",
      cfg.name(), model::CountScalars(model_->Parameters()), model_->ActiveParametersPerToken(),
      model_->moe_layers().size(), dataset_->train_windows(), dataset_->eval_windows(),
      cfg.model().seq_len(), pool_->num_threads());
  if (checkpoints_ && cfg.checkpoint().every() > 0) {
    checkpoints_->Reserve(*model_, CheckpointShareOfThisWorker(), scheduler_ != nullptr);
  }
  while (step_ < steps) {
    ASSIGN_OR_RETURN(StepResult r, Step());
    const int every = cfg.train().eval_every();
    const bool eval_due = r.step == steps || (every > 0 && r.step % every == 0);
    EvalResult eval;
    if (eval_due) {
      eval = Evaluate();
      evals_.emplace_back(r.step, eval);
    }
    if (metrics_ || options_.on_metrics_line) {
      // A worker's line names it and the samples it trained on.
      std::optional<WorkerStepFields> worker = worker_fields_;
      if (worker) {
        worker->first_sample =
            data::TokenDataset::FirstSample(r.step - 1, cfg.train().global_batch()) +
            first_sequence_;
        worker->samples = local_batch_;
      }
      std::vector<int> blocks;
      for (const auto& ref : model_->moe_layers()) blocks.push_back(ref.block);
      const std::string line =
          StepMetricsLine(r, blocks, cfg.model().moe().gate().sequence_aux_loss_coef() > 0, worker,
                          eval_due ? &eval : nullptr);
      if (metrics_) RETURN_IF_ERROR(metrics_->Write(line));
      if (options_.on_metrics_line) options_.on_metrics_line(line);
    }
    if (options_.progress) progress_.Print(r, eval_due ? &eval : nullptr);
    STRATA_FAULT_POINT("train.after_step", &r.step);
    if (options_.on_step) RETURN_IF_ERROR(options_.on_step(r));
    const int ckpt_every = static_cast<int>(cfg.checkpoint().every());
    const bool checkpoint_due =
        !cfg.checkpoint().dir().empty() && ckpt_every > 0 && r.step % ckpt_every == 0;
    if (checkpoints_) RETURN_IF_ERROR(checkpoints_->PollError());
    ReportCommittedCheckpoint();
    if (checkpoint_due && checkpoints_ && checkpoints_->committer() && options_.on_checkpoint) {
      options_.on_checkpoint(r.step, false);
    }
    if (checkpoint_due) {
      RETURN_IF_ERROR(checkpoints_->Save(r.step, cfg, *model_, *optimizer_, scheduler_.get(), ctx_,
                                         CheckpointShareOfThisWorker()));
    }
  }
  RETURN_IF_ERROR(experts_->Finish());
  if (checkpoints_) RETURN_IF_ERROR(checkpoints_->Wait());
  ReportCommittedCheckpoint();
  return absl::OkStatus();
}

void Trainer::ReportCommittedCheckpoint() {
  if (!checkpoints_ || !checkpoints_->committer() || !options_.on_checkpoint) return;
  const int64_t newest = checkpoints_->NewestCommitted();
  // It may also go down: a generation that went back behind checkpoints saves them again.
  if (newest != reported_checkpoint_) {
    reported_checkpoint_ = newest;
    if (newest > 0) options_.on_checkpoint(newest, true);
  }
}

checkpoint::CheckpointShare Trainer::CheckpointShareOfThisWorker() const {
  checkpoint::CheckpointShare share;
  if (!distributed()) return share;
  const int W = options_.worker.world_size, rank = options_.worker.rank;
  // Every worker writes a shard: the leader of each expert replica group its experts, and every
  // worker its share of the dense state.
  share.experts = expert_replica_leader_;
  share.dense = checkpoint::DealDenseParameters(*model_, W)[static_cast<size_t>(rank)];
  share.shards = shard_names_;
  share.workers = W;
  return share;
}

void Trainer::ResetParallel(int64_t generation) {
  if (model_) model_->AttachParallel(nullptr, nullptr, nullptr);
  // The seams built over this generation's reducers go with them; BuildModel makes new ones.
  gradients_.reset();
  keeping_.reset();
  exchange_.reset();
  data_parallel_.reset();
  comms_.Reset(generation);
}

Status Trainer::Reform(const WorkerOptions& w) {
  if (!elastic_) {
    return absl::FailedPreconditionError(
        "Reform re-forms elastic workers only; create the trainer with "
        "TrainOptions::worker.elastic set (strata worker --coordinator does)");
  }
  RETURN_IF_ERROR(CheckElastic(options_.config));
  // The previous generation's communicators are finished (aborted or failed); their threads stop.
  AbortCollectives("a new generation forms");
  // A TIERED worker whose last re-form failed after handing its store on has none left.
  const bool tiered = scheduler_ != nullptr;
  if (tiered) {
    // A TIERED worker's store shares its checkpoint shard's SSD tier, so the shard stays open
    // (ContinueCheckpoints). The old generation's checkpoint in flight ends first: its writer
    // reads the scheduler that is about to hand its store on. The expert update in flight needs
    // no collective; once it is done the store holds the live state — unless it failed, and then
    // no whole state.
    if (checkpoints_) {
      checkpoints_->Abandon();
      if (Status c = checkpoints_->Wait(); !c.ok()) {
        STRATA_LOG(WARNING) << "the checkpoint in flight when generation " << w.generation
                            << " formed is given up: " << c.message();
      }
    }
    if (elastic_->store_whole() && !scheduler_->FinishExpertStep().ok()) {
      elastic_->StoreUpdateFailed();
    }
  } else {
    // Each worker writes the shard of its rank, which may change: the shards are opened again once
    // every worker has let go of its old one (a checkpoint being written is abandoned: the new
    // generation saves again at its own schedule).
    checkpoints_.reset();
  }
  ResetParallel(w.generation);
  options_.worker = w;
  options_.worker.rejoin = true;
  worker_fields_ = WorkerStepFields{w.rank, w.world_size, w.generation};
  worker_fields_->device = device_.ToString();
  if (distributed()) RETURN_IF_ERROR(SetUpWorkers());
  RETURN_IF_ERROR(OpenCheckpointsOfGeneration());
  // A TIERED worker whose store was handed on and then lost (a move or the new model failed)
  // lets go of its shard too: its manager's references were the store's.
  auto lost_store = [&](Status s) {
    if (tiered && scheduler_ == nullptr) checkpoints_.reset();
    return s;
  };
  StatusOr<SyncedState> synced = elastic_->SyncState();
  if (!synced.ok()) return lost_store(synced.status());
  SyncedState& s = *synced;
  if (s.from_checkpoint) RETURN_IF_ERROR(ReopenForCheckpoint());
  std::tie(first_sequence_, local_batch_) =
      BatchShare(options_.config.train().global_batch(), w.world_size, w.rank);
  if (Status a = AdoptState(s); !a.ok()) return lost_store(a);
  // A checkpoint whose commit the previous generation never got to report (its step was cut
  // short) may be the one this generation went back to: the coordinator hears of it before the
  // generation says where it starts (again, if a report to the previous generation was refused).
  reported_checkpoint_ = 0;
  ReportCommittedCheckpoint();
  return absl::OkStatus();
}

Status Trainer::OpenCheckpointsOfGeneration() {
  // The lowest surviving rank becomes rank 0, the committer (the folder's lock went with the
  // process that held it, or the previous committer gives it up).
  if (distributed()) return OpenWorkerCheckpoints(/*continuing=*/true);
  if (checkpoints_) return ContinueCheckpoints();
  if (options_.config.checkpoint().dir().empty()) return absl::OkStatus();
  return OpenCheckpoints(/*continuing=*/true);
}

Status Trainer::ReopenForCheckpoint() {
  if (options_.config.storage().mode() != config::StorageConfig::TIERED) return absl::OkStatus();
  // The shard's space that no checkpoint lists (the live store's) is free again once it is opened
  // afresh; the store goes first.
  if (model_ && scheduler_) model_->AttachResidency(nullptr);
  experts_.reset();
  scheduler_.reset();
  checkpoints_.reset();
  RETURN_IF_ERROR(comms_.Barrier());
  return OpenCheckpointsOfGeneration();
}

Status Trainer::ContinueCheckpoints() {
  return checkpoints_->Continue(options_.worker.generation, options_.worker.rank == 0,
                                comms_.CheckpointAbandonFlag(), scheduler_.get());
}

Status Trainer::AdoptState(SyncedState& s) {
  // Until the state is in, this worker holds none (a failure below leaves it holding nothing).
  elastic_->HoldNothing();
  experts_per_worker_ = s.counts;
  ASSIGN_OR_RETURN(scheduler::ExpertPlacement placement,
                   scheduler::ExpertPlacement::FromCounts(experts_per_worker_));
  const int rank = options_.worker.rank, G = static_cast<int>(s.counts.size());
  expert_replica_leader_ = rank < G;
  // The seams point into what goes next; BuildModel chooses new ones.
  gradients_.reset();
  keeping_.reset();
  optimizer_.reset();
  dense_slices_.reset();
  if (model_) model_->AttachParallel(nullptr, nullptr, nullptr);
  if (model_ && scheduler_) model_->AttachResidency(nullptr);
  experts_.reset();
  scheduler_.reset();
  exchange_.reset();
  data_parallel_.reset();
  model_.reset();
  RETURN_IF_ERROR(BuildModel(placement.first(rank % G), placement.count(rank % G)));
  RETURN_IF_ERROR(SetUpExpertState(std::move(s.store)));
  return StartFrom(s);
}

Status Trainer::GoBackToCheckpoint() {
  // Every worker decides alike: all resume, or all start over (no checkpoint committed yet).
  const std::string& dir = options_.config.checkpoint().dir();
  RETURN_IF_ERROR(checkpoints_->Wait());  // a checkpoint being written counts once committed
  double empty = checkpoints_->Steps().empty() ? 1.0 : 0.0;
  RETURN_IF_ERROR(comms_.SumOverWorkers(&empty, 1));
  if (empty == options_.worker.world_size) {
    // No checkpoint yet: the job goes back to its beginning, which every run shares — the model
    // as the seed initialises it (just built) or as --init-from gives it, with fresh optimizer
    // state.
    if (options_.worker.rank == 0) {
      STRATA_LOG(WARNING) << "no checkpoint is committed in " << dir
                          << " yet; the job goes back to step 0";
    }
    step_ = 0;
    return InitFrom();
  }
  if (empty > 0) {
    return absl::InternalError(absl::StrFormat(
        "the workers of generation %d do not see the same checkpoints in %s (%d see none)",
        options_.worker.generation, dir, static_cast<int>(empty)));
  }
  return Resume();
}

Status Trainer::InitFrom() {
  const Stopwatch clock;
  StatusOr<uint32_t> crc = uint32_t{0};
  if (!options_.init_from.empty()) {
    crc = checkpoint::ImportSafetensors(
        options_.init_from, *model_, [this](int moe_layer, int expert, const float* blob) {
          return scheduler_->WriteExpert(moe_layer, expert, storage::TensorKind::kWeights, blob);
        });
  }
  if (distributed()) {
    // Every worker takes part, given --init-from or not, so that workers that read different
    // files (or one and none) are told apart instead of training different models. The file's
    // CRC (0 for none) in four bytes: the workers agree when W * sum(b^2) == sum(b)^2 for each.
    double sums[9] = {crc.ok() ? 0.0 : 1.0};
    for (int i = 0; i < 4; ++i) {
      const double b = crc.ok() ? static_cast<double>((*crc >> (8 * i)) & 0xff) : 0.0;
      sums[1 + i] = b;
      sums[5 + i] = b * b;
    }
    RETURN_IF_ERROR(comms_.SumOverWorkers(sums, 9));
    if (!crc.ok()) return crc.status();
    if (sums[0] > 0) {
      return absl::AbortedError(absl::StrFormat(
          "%d of the %d workers could not read their --init-from file (their logs say why)",
          static_cast<int>(sums[0]), options_.worker.world_size));
    }
    const double W = options_.worker.world_size;
    for (int i = 0; i < 4; ++i) {
      if (W * sums[5 + i] != sums[1 + i] * sums[1 + i]) {
        return absl::FailedPreconditionError(absl::StrFormat(
            "the workers did not start from the same weights: this worker (rank %d) %s, and "
            "another worker read another file or none; give every worker the same --init-from "
            "file (strata launch --init-from passes it to all), or none",
            options_.worker.rank,
            options_.init_from.empty()
                ? std::string("has no --init-from")
                : absl::StrFormat("read %s (CRC-32C %08x of its header and dense tensors)",
                                  options_.init_from, *crc)));
      }
    }
  }
  if (!crc.ok()) return crc.status();
  if (!options_.init_from.empty()) {
    STRATA_LOG(INFO) << "weights from " << options_.init_from << " (" << clock.Seconds() << " s)";
  }
  return absl::OkStatus();
}

Status Trainer::Resume() {
  // Every worker reads what it holds from the shards that have it; all take the newest
  // checkpoint that every worker found intact (one process agrees with itself).
  const checkpoint::ResumeAgreement agree = [this](bool ok_here) -> StatusOr<bool> {
    double ok = ok_here ? 1.0 : 0.0;
    RETURN_IF_ERROR(comms_.SumOverWorkers(&ok, 1));
    return ok == options_.worker.world_size;
  };
  ASSIGN_OR_RETURN(step_, checkpoints_->Resume(options_.config, *model_, *optimizer_,
                                               scheduler_.get(), ctx_, agree));
  resumed_from_ = step_;
  return absl::OkStatus();
}

Status Trainer::StartFrom(const SyncedState& s) {
  if (s.from_checkpoint) {
    RETURN_IF_ERROR(GoBackToCheckpoint());
  } else {
    RETURN_IF_ERROR(elastic_->ImportState(s));
    step_ = s.step;
  }
  while (!history_.empty() && history_.back().step > step_) history_.pop_back();
  return elastic_->StartGeneration(step_);
}

}  // namespace strata::train
