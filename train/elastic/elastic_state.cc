// ElasticState's lifecycle and the step keeping (elastic_state.h): the live version, the expert
// loads, the blobs of the model's state, a generation's start. Its copies are in copies.cc, the
// state sync of a re-form in sync.cc.
#include "train/elastic/elastic_state.h"

#include <cstring>
#include <map>
#include <string>

#include "absl/strings/str_format.h"
#include "core/common/trace.h"

namespace strata::train {

bool MovesLiveState(const config::JobConfig& config) {
  return config.parallel().experts_per_worker_size() == 0;
}

bool KeepsCopies(const config::JobConfig& config) {
  // With one expert-parallel group, an IN_MEMORY worker keeps at least its rollback copy; a TIERED
  // one keeps its copies with its buddy copies, on its SSD. With several, each expert's copies in
  // the other groups are what a generation goes on from.
  return MovesLiveState(config) && config.parallel().expert_parallel() == 0 &&
         (config.storage().mode() == config::StorageConfig::IN_MEMORY ||
          config.elastic().replicas() > 0);
}

Status CheckElastic(const config::JobConfig& cfg) {
  if (KeepsCopies(cfg)) return absl::OkStatus();
  // Every other layout re-forms from the newest checkpoint, so there must be checkpoints.
  if (cfg.checkpoint().dir().empty() || cfg.checkpoint().every() <= 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "an elastic job with %s goes back to its newest checkpoint when its workers' copies "
        "cannot make up its state; set checkpoint.dir and checkpoint.every (or train with "
        "parallel.expert_parallel: 0, no parallel.experts_per_worker and elastic.replicas of 1 "
        "or more, which keeps buddy copies)",
        cfg.parallel().expert_parallel() != 0
            ? absl::StrFormat("parallel.expert_parallel: %d", cfg.parallel().expert_parallel())
        : cfg.parallel().experts_per_worker_size() > 0
            ? std::string("parallel.experts_per_worker")
            : std::string("storage.mode: TIERED and elastic.replicas: 0")));
  }
  return absl::OkStatus();
}

StatusOr<int> GroupSize(const config::ParallelConfig& par, int workers, bool elastic) {
  const int want = par.expert_parallel();
  if (want == 0 || want >= workers) return workers;
  if (workers % want == 0) return want;
  if (!elastic) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "parallel.expert_parallel = %d does not divide the %d workers; choose a divisor of %d "
        "(or 0 for all workers)",
        want, workers, workers));
  }
  // An elastic generation whose count the configured groups do not divide takes the smallest
  // larger groups that do: no worker holds more experts than the configured layout gives it.
  int g = want + 1;
  while (workers % g != 0) ++g;
  return g;
}

ElasticState::ElasticState(const config::JobConfig& config, ElasticHost* host)
    : config_(config), host_(host) {}

void ElasticState::SetLive(int64_t version) { live_version_ = version; }

void ElasticState::HoldNothing() {
  live_version_ = -1;
  store_whole_ = false;
}

Status ElasticState::KeepBeforeUpdate() {
  // A TIERED worker's copies are of the state before the update, on its SSD, every
  // elastic.replica_every steps; an IN_MEMORY worker's rollback copy is taken every step.
  if (host_->scheduler() != nullptr) return RefreshStoredCopiesIfDue();
  TakeRollbackCopy();
  return absl::OkStatus();
}

Status ElasticState::KeepAfterUpdate() {
  if (host_->scheduler() != nullptr) return absl::OkStatus();
  TraceScope span(host_->context().tracer, "buddy copies", "comm");
  return RefreshBuddies();
}

void ElasticState::RecordLoads(const std::vector<model::MoeStats>& moe) {
  // Every worker sees the batch-wide counts.
  const int64_t E = config_.model().moe().num_experts();
  expert_load_.resize(E, 0.0);
  for (double& l : expert_load_) l *= 0.9;
  for (const model::MoeStats& m : moe) {
    for (int64_t e = 0; e < E && e < static_cast<int64_t>(m.load.size()); ++e) {
      expert_load_[e] += static_cast<double>(m.load[e]);
    }
  }
}

size_t ElasticState::DenseBlobFloats() const {
  return 3 * static_cast<size_t>(model::CountScalars(host_->model()->DenseParameters()));
}

size_t ElasticState::ExpertBlobFloats() const {
  size_t n = 0;
  for (const auto& ref : host_->model()->moe_layers()) {
    if (ref.layer->num_local_experts() == 0) return 0;
    n += 3 * static_cast<size_t>(model::CountScalars(
                 ref.layer->expert(ref.layer->first_local_expert()).Parameters()));
  }
  return n;
}

namespace {

// value, first moment, second moment of each parameter, in order; `write` copies the other way.
// The blob is host memory; the tensors are where the model is (a GPU's copies are synchronous and
// ordered after the compute queued before them).
void CopyParams(const std::vector<model::Parameter*>& ps, const model::AdamW& opt,
                const std::map<const model::Parameter*, size_t>& index, float* blob, bool write) {
  for (model::Parameter* p : ps) {
    const size_t n = static_cast<size_t>(p->value.numel());
    const size_t i = index.at(p);
    const Tensor* tensors[] = {&p->value, &opt.first_moment(i), &opt.second_moment(i)};
    for (const Tensor* t : tensors) {
      if (write) {
        t->CopyFromHost(blob);
      } else {
        t->CopyToHost(blob);
      }
      blob += n;
    }
  }
}

std::map<const model::Parameter*, size_t> IndexOf(const model::AdamW& opt) {
  std::map<const model::Parameter*, size_t> index;
  for (size_t i = 0; i < opt.params().size(); ++i) index[opt.params()[i]] = i;
  return index;
}

// An expert's blob from (write: into) a model and its optimizer.
void CopyExpert(model::MoeTransformer& model, const model::AdamW& opt, int64_t e, float* blob,
                bool write) {
  const auto index = IndexOf(opt);
  for (const auto& ref : model.moe_layers()) {
    std::vector<model::Parameter*> ps = ref.layer->expert(e).Parameters();
    CopyParams(ps, opt, index, blob, write);
    for (const model::Parameter* p : ps) blob += 3 * static_cast<size_t>(p->value.numel());
  }
}

}  // namespace

void ElasticState::ReadDense(float* out) const {
  const model::AdamW& opt = *host_->optimizer();
  CopyParams(host_->model()->DenseParameters(), opt, IndexOf(opt), out, false);
}

void ElasticState::ReadExpert(int64_t e, float* out) const {
  CopyExpert(*host_->model(), *host_->optimizer(), e, out, false);
}

Status ElasticState::ImportState(const SyncedState& s) {
  // A TIERED worker's experts are in the store it adopted already.
  const size_t S = host_->scheduler() ? 0 : ExpertBlobFloats();
  const int64_t first = host_->first_expert(), count = host_->num_experts();
  if (s.dense.size() != DenseBlobFloats() || s.experts.size() != S * count) {
    return absl::InternalError(absl::StrFormat(
        "state handed over for a different model: %d dense and %d expert floats, this model needs "
        "%d and %d",
        s.dense.size(), s.experts.size(), DenseBlobFloats(), S * count));
  }
  model::MoeTransformer& model = *host_->model();
  model::AdamW& opt = *host_->optimizer();
  CopyParams(model.DenseParameters(), opt, IndexOf(opt), const_cast<float*>(s.dense.data()), true);
  for (int64_t i = 0; S > 0 && i < count; ++i) {
    CopyExpert(model, opt, first + i, const_cast<float*>(&s.experts[i * S]), true);
  }
  opt.set_steps(s.step);
  return absl::OkStatus();
}

Status ElasticState::StartGeneration(int64_t step) {
  // The model and store were just built for the generation and filled with its state.
  live_version_ = step;
  store_whole_ = true;
  buddies_.clear();
  // A TIERED worker's copies of steps up to the one the generation starts from — its experts' and
  // its dense state's — are the job's history, whatever the placement was: they stay until the
  // generation's own copies are whole everywhere (the second refresh of the generation drops what
  // it no longer needs), so a failure during the first one still finds a whole state. Later ones
  // were of a trajectory the generation replaces. An IN_MEMORY worker's rollback copy was of its
  // old range.
  if (shelf_) {
    for (int64_t e = 0; e < config_.model().moe().num_experts(); ++e) {
      shelf_->DropNewerThan(e, step);
    }
  }
  if (host_->scheduler() == nullptr || rollback_.version > step) rollback_ = Copy();
  if (rollback_older_.version > step) rollback_older_ = Copy();
  copied_version_ = -1;
  // The new generation is protected from its first step on.
  if (!KeepsCopies(config_)) return absl::OkStatus();
  return host_->scheduler() ? RefreshStoredCopies() : RefreshBuddies();
}

Status ElasticKeeping::BeforeUpdate() {
  return options_.copies ? state_->KeepBeforeUpdate() : absl::OkStatus();
}

void ElasticKeeping::Updated(int64_t version, bool experts_updated) {
  state_->SetLive(version);
  // The experts may not have taken the update the dense state took.
  if (!experts_updated) state_->StoreUpdateFailed();
}

Status ElasticKeeping::AfterUpdate(const std::vector<model::MoeStats>& moe) {
  // Loads steer the placement of the next generation.
  if (options_.loads) state_->RecordLoads(moe);
  return options_.copies ? state_->KeepAfterUpdate() : absl::OkStatus();
}

}  // namespace strata::train
