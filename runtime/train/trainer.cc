#include "runtime/train/trainer.h"

#include <unistd.h>

#include <cmath>
#include <thread>

#include "absl/strings/str_format.h"
#include "proto/config_io.h"
#include "runtime/common/clock.h"
#include "runtime/common/json.h"
#include "runtime/common/logging.h"

namespace strata::train {

Trainer::~Trainer() = default;

double Trainer::LearningRate(const config::TrainConfig& t, int64_t s) {
  const double peak = t.lr();
  if (s < t.warmup_steps()) return peak * static_cast<double>(s + 1) / t.warmup_steps();
  if (t.schedule() == config::TrainConfig::CONSTANT) return peak;
  const double min_lr = peak * t.min_lr_ratio();
  const double span = std::max(1, t.steps() - t.warmup_steps());
  const double progress = std::min(1.0, static_cast<double>(s - t.warmup_steps()) / span);
  return min_lr + 0.5 * (1.0 + std::cos(M_PI * progress)) * (peak - min_lr);
}

StatusOr<std::unique_ptr<Trainer>> Trainer::Create(const TrainOptions& options) {
  std::unique_ptr<Trainer> tr(new Trainer);
  tr->options_ = options;
  const config::JobConfig& cfg = tr->options_.config;
  RETURN_IF_ERROR(config::ValidateJobConfig(cfg, "job config"));
  storage::Env* env = options.env ? options.env : storage::Env::Default();

  int threads = cfg.train().threads();
  if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());
  tr->pool_ = std::make_unique<ThreadPool>(threads);
  tr->ctx_.pool = tr->pool_.get();

  ASSIGN_OR_RETURN(tr->dataset_, data::TokenDataset::Open(cfg.data(), cfg.model().vocab_size(),
                                                          cfg.model().seq_len(), env));
  model::ModelOptions mo;
  mo.config = cfg.model();
  mo.seed = cfg.seed();
  mo.max_batch = cfg.train().global_batch();
  mo.expert_factory = options.expert_factory;
  ASSIGN_OR_RETURN(tr->model_, model::MoeTransformer::Create(tr->ctx_, mo));

  model::AdamWOptions ao;
  ao.beta1 = cfg.train().beta1();
  ao.beta2 = cfg.train().beta2();
  ao.eps = cfg.train().adam_eps();
  ao.weight_decay = cfg.train().weight_decay();
  tr->optimizer_ = std::make_unique<model::AdamW>(tr->model_->Parameters(), ao);

  if (!options.metrics_path.empty()) {
    ASSIGN_OR_RETURN(tr->metrics_, MetricsWriter::Open(options.metrics_path, env));
  }
  const int64_t n = static_cast<int64_t>(cfg.train().global_batch()) * cfg.model().seq_len();
  tr->inputs_.resize(n);
  tr->targets_.resize(n);
  tr->tty_ = isatty(STDERR_FILENO);
  return tr;
}

StatusOr<StepResult> Trainer::Step() {
  const config::JobConfig& cfg = options_.config;
  const int64_t B = cfg.train().global_batch();
  Stopwatch watch;
  dataset_->TrainBatch(cfg.seed(), data::TokenDataset::FirstSample(step_, B), B, inputs_.data(),
                       targets_.data());
  optimizer_->ZeroGrad(ctx_);
  model::GateCall call{true, static_cast<uint64_t>(step_)};
  StepResult r;
  r.loss = model_->Forward(ctx_, inputs_.data(), targets_.data(), B, call);
  if (!std::isfinite(r.loss)) {
    return absl::InternalError(
        absl::StrFormat("the training loss became %f at step %d; lower train.lr (now %g) or raise "
                        "train.warmup_steps, and check the data file",
                        r.loss, step_ + 1, cfg.train().lr()));
  }
  model_->Backward(ctx_);
  r.grad_norm = optimizer_->GradNorm(ctx_);
  r.lr = LearningRate(cfg.train(), step_);
  optimizer_->Step(ctx_, r.lr, cpu::ClipScale(r.grad_norm, cfg.train().grad_clip()));
  for (const auto& ref : model_->moe_layers()) {
    r.moe.push_back(ref.layer->stats());
    r.aux_loss += ref.layer->stats().aux_loss;
    r.z_loss += ref.layer->stats().z_loss;
  }
  if (!model_->moe_layers().empty()) {
    r.aux_loss /= static_cast<double>(model_->moe_layers().size());
    r.z_loss /= static_cast<double>(model_->moe_layers().size());
  }
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
  model::GateCall call{false, static_cast<uint64_t>(step_)};
  double sum = 0;
  for (int b = 0; b < cfg.train().eval_batches(); ++b) {
    dataset_->EvalBatch(b, B, inputs_.data(), targets_.data());
    sum += model_->Forward(ctx_, inputs_.data(), targets_.data(), B, call) * N;
  }
  EvalResult e;
  e.tokens = N * cfg.train().eval_batches();
  e.loss = sum / static_cast<double>(e.tokens);
  e.bits_per_byte =
      cfg.data().format() == config::DataConfig::BYTES ? e.loss / std::log(2.0) : std::nan("");
  return e;
}

Status Trainer::Run() {
  const config::JobConfig& cfg = options_.config;
  const int64_t steps = cfg.train().steps();
  started_ = NowSeconds();
  STRATA_LOG(INFO) << absl::StrFormat(
      "%s: %d parameters (%d active per token), %d MoE layers, %d train / %d held-out windows "
      "of %d tokens, %d threads",
      cfg.name(), model::CountScalars(model_->Parameters()), model_->ActiveParametersPerToken(),
      model_->moe_layers().size(), dataset_->train_windows(), dataset_->eval_windows(),
      cfg.model().seq_len(), pool_->num_threads());
  while (step_ < steps) {
    ASSIGN_OR_RETURN(StepResult r, Step());
    const int every = cfg.train().eval_every();
    const bool eval_due = r.step == steps || (every > 0 && r.step % every == 0);
    EvalResult eval;
    if (eval_due) {
      eval = Evaluate();
      evals_.emplace_back(r.step, eval);
      last_eval_loss_ = eval.loss;
      last_eval_bpb_ = eval.bits_per_byte;
    }
    if (metrics_) {
      JsonWriter j;
      j.BeginObject()
          .Field("step", r.step)
          .Field("loss", r.loss)
          .Field("aux_loss", r.aux_loss)
          .Field("z_loss", r.z_loss)
          .Field("lr", r.lr)
          .Field("grad_norm", r.grad_norm)
          .Field("tokens", r.tokens)
          .Field("tokens_per_s", r.tokens / r.seconds)
          .Field("step_ms", 1e3 * r.seconds);
      j.Key("moe").BeginArray();
      for (size_t i = 0; i < r.moe.size(); ++i) {
        const model::MoeStats& s = r.moe[i];
        j.BeginObject().Field("layer", model_->moe_layers()[i].block);
        j.Key("load").IntArray(s.load);
        j.Field("dropped", s.dropped)
            .Field("dropped_tokens", s.dropped_tokens)
            .Field("capacity", s.capacity)
            .Field("aux_loss", s.aux_loss)
            .Field("z_loss", s.z_loss)
            .EndObject();
      }
      j.EndArray();
      if (eval_due) {
        j.Field("eval_loss", eval.loss);
        if (std::isfinite(eval.bits_per_byte)) j.Field("eval_bits_per_byte", eval.bits_per_byte);
      }
      j.EndObject();
      RETURN_IF_ERROR(metrics_->Write(j.str()));
    }
    if (options_.progress) PrintProgress(r, eval_due ? &eval : nullptr, r.step == steps);
  }
  return absl::OkStatus();
}

void Trainer::PrintProgress(const StepResult& r, const EvalResult* eval, bool final_line) {
  const config::JobConfig& cfg = options_.config;
  const int64_t steps = cfg.train().steps();
  smoothed_step_seconds_ =
      smoothed_step_seconds_ == 0 ? r.seconds : 0.9 * smoothed_step_seconds_ + 0.1 * r.seconds;
  const double eta = smoothed_step_seconds_ * static_cast<double>(steps - r.step);
  std::string line =
      absl::StrFormat("[%s] step %*d/%d | loss %.4f", cfg.name(),
                      static_cast<int>(std::to_string(steps).size()), r.step, steps, r.loss);
  if (last_eval_loss_ >= 0) {
    absl::StrAppendFormat(&line, " | eval %.4f", last_eval_loss_);
    if (std::isfinite(last_eval_bpb_)) absl::StrAppendFormat(&line, " (%.3f bpb)", last_eval_bpb_);
  }
  absl::StrAppendFormat(&line, " | %.0f tok/s | %s elapsed | ETA %s", r.tokens / r.seconds,
                        FormatDuration(NowSeconds() - started_), FormatDuration(eta));
  const bool periodic = r.step % cfg.train().log_every() == 0;
  if (tty_) {
    // Overwrite in place; keep a permanent line at evaluations and at the end.
    std::fprintf(stderr, "\r\033[K%s%s", line.c_str(), (eval || final_line) ? "\n" : "");
  } else if (periodic || eval || final_line || r.step == 1) {
    std::fprintf(stderr, "%s\n", line.c_str());
  }
  std::fflush(stderr);
}

}  // namespace strata::train
