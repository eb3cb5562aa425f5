#include "train/evaluate.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/str_format.h"
#include "checkpoint/manager.h"
#include "core/common/clock.h"
#include "core/common/thread_pool.h"
#include "core/device/device.h"
#include "proto/config_io.h"
#include "runtime/data/dataset.h"
#include "runtime/model/transformer.h"
#include "storage/env.h"
#include "storage/private_folder.h"

namespace strata::train {

// In destruction order: the scheduler (with its store), the budgets it charged, the folder.
struct CheckpointModel::Offload {
  std::unique_ptr<storage::PrivateFolder> folder;
  std::unique_ptr<MemoryBudget> device_budget, host_budget;
  std::unique_ptr<scheduler::TieredExpertScheduler> scheduler;
  storage::StoreStats stats;  // summed over the passes so far
  double load_seconds = 0;
  uint64_t expert_bytes = 0;
};

CheckpointModel::CheckpointModel() = default;
CheckpointModel::~CheckpointModel() = default;

Status CheckpointModel::EndPass() {
  if (!offload) return absl::OkStatus();
  const Status s = offload->scheduler->status();
  offload->scheduler->EndStep();
  const storage::StoreStats st = offload->scheduler->store().TakeStats();
  offload->stats.ssd.bytes_out += st.ssd.bytes_out;
  offload->stats.device.bytes_in += st.device.bytes_in;
  offload->stats.stall_seconds += st.stall_seconds;
  if (!s.ok()) {
    return Status(s.code(), absl::StrFormat("the offloaded experts of %s: %s", name, s.message()));
  }
  return absl::OkStatus();
}

OffloadReport CheckpointModel::offload_report() const {
  OffloadReport r;
  if (!offload) return r;
  r.ssd_bytes_read = offload->stats.ssd.bytes_out;
  r.device_bytes_in = offload->stats.device.bytes_in;
  r.stall_seconds = offload->stats.stall_seconds;
  const scheduler::ForwardPrefetchCounts c = offload->scheduler->forward_prefetch();
  r.routed = c.routed;
  r.guessed = c.guessed;
  r.resident = c.resident;
  r.load_seconds = offload->load_seconds;
  r.expert_bytes = offload->expert_bytes;
  return r;
}

namespace {

// The offloaded store of `m` (built with unbound experts), attached to its model.
Status SetUpOffload(CheckpointModel& m, int threads, const OffloadOptions& o) {
  if (m.model->moe_layers().empty()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s has no MoE layer: there are no experts to offload", m.name));
  }
  auto off = std::make_unique<CheckpointModel::Offload>();
  // A folder of this process's own (locked, removed at the end): two runs never share files.
  const char* base = std::getenv("TMPDIR");
  ASSIGN_OR_RETURN(off->folder,
                   storage::PrivateFolder::Create(!o.ssd_dir.empty() ? o.ssd_dir
                                                  : base && *base    ? base
                                                                     : "/tmp",
                                                  "strata-offload-", "the offloaded experts"));
  const std::string ssd_dir = off->folder->path();
  off->device_budget = std::make_unique<MemoryBudget>("offload device", o.device_bytes);
  off->host_budget = std::make_unique<MemoryBudget>("offload host", o.host_bytes);
  scheduler::TieredOptions to;
  config::StorageConfig& st = to.storage;
  st.set_mode(config::StorageConfig::TIERED);
  st.set_device_budget_bytes(o.device_bytes);
  st.set_host_budget_bytes(o.host_bytes);
  st.set_ssd_dir(ssd_dir);
  st.set_history_prefetch(o.history_prefetch);
  st.set_io_block_bytes(o.io_block_bytes);
  st.set_overlap_optimizer(false);
  st.set_backward_prefetch(0);
  to.ssd_dir = ssd_dir;
  to.seed = m.checkpoint.seed;
  to.threads = threads;
  to.device_budget = off->device_budget.get();
  to.device_slot_bytes = o.device_bytes;
  to.host_budget = off->host_budget.get();
  to.ring = true;
  auto scheduler = scheduler::TieredExpertScheduler::Create(*m.model, to);
  if (!scheduler.ok()) {
    const Status& s = scheduler.status();
    return Status(s.code(),
                  absl::StrFormat("cannot offload the experts of %s: %s (here the device and host "
                                  "budgets are --offload-device and --offload-host, and the SSD "
                                  "tier's folder goes under --offload-dir, else $TMPDIR or /tmp: a "
                                  "disk that supports O_DIRECT, not tmpfs)",
                                  m.name, s.message()));
  }
  off->scheduler = *std::move(scheduler);
  off->expert_bytes = off->scheduler->expert_floats() * sizeof(float) *
                      m.model->moe_layers().size() *
                      static_cast<uint64_t>(m.model->moe_layers()[0].layer->num_experts());
  m.model->AttachResidency(off->scheduler.get());
  m.offload = std::move(off);
  return absl::OkStatus();
}

}  // namespace

StatusOr<std::unique_ptr<CheckpointModel>> LoadCheckpointModel(const std::string& dir, int64_t step,
                                                               int64_t max_batch, int threads,
                                                               const std::string& device_name,
                                                               const OffloadOptions& offload) {
  auto m = std::make_unique<CheckpointModel>();
  ASSIGN_OR_RETURN(m->checkpoint, checkpoint::CheckpointManager::ReadModelConfig(dir, step));
  m->name = absl::StrFormat("checkpoint %d in '%s'", m->checkpoint.step, dir);
  ASSIGN_OR_RETURN(const Device device, Device::Parse(device_name));
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  m->pool = std::make_unique<ThreadPool>(threads);
  m->ctx.pool = m->pool.get();
  model::ModelOptions mo;
  mo.config = m->checkpoint.model;
  mo.seed = m->checkpoint.seed;
  mo.max_batch = max_batch;
  mo.batch_sequences = max_batch;
  mo.device = device;
  // As a job trains on this device by default (train.precision AUTO): bf16 GEMMs on a GPU.
  mo.bf16 = config::Bf16Gemms(config::TrainConfig::AUTO, !device.is_cpu());
  mo.unbound_experts = offload.enabled;
  ASSIGN_OR_RETURN(m->model, model::MoeTransformer::Create(m->ctx, mo));
  if (!offload.enabled) {
    RETURN_IF_ERROR(checkpoint::CheckpointManager::ReadWeights(dir, m->checkpoint.step,
                                                               m->checkpoint.seed, *m->model));
    return m;
  }
  RETURN_IF_ERROR(SetUpOffload(*m, threads, offload));
  // The experts into the store one at a time (each through a host slot; the host tier spills to
  // the SSD tier as it fills).
  const Stopwatch clock;
  scheduler::TieredExpertScheduler& s = *m->offload->scheduler;
  RETURN_IF_ERROR(checkpoint::CheckpointManager::ReadWeights(
      dir, m->checkpoint.step, m->checkpoint.seed, *m->model,
      [&](int moe_layer, int expert, const float* blob) {
        return s.WriteExpert(moe_layer, expert, storage::TensorKind::kWeights, blob);
      }));
  RETURN_IF_ERROR(s.store().DrainWriteBacks());
  m->offload->load_seconds = clock.Seconds();
  (void)s.store().TakeStats();  // the passes' figures start here
  return m;
}

StatusOr<CheckpointEval> EvaluateCheckpoint(const CheckpointEvalOptions& o) {
  if (o.batch < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("the batch must be at least 1 window, not %d", o.batch));
  }
  ASSIGN_OR_RETURN(const checkpoint::CheckpointManager::ModelOfCheckpoint ckpt,
                   checkpoint::CheckpointManager::ReadModelConfig(o.checkpoint_dir, o.step));
  const int seq_len = ckpt.model.seq_len();
  if (!std::filesystem::exists(o.data.path())) {
    return absl::NotFoundError(absl::StrFormat("the data file '%s' does not exist", o.data.path()));
  }
  if (o.data.format() == config::DataConfig::BYTES && ckpt.model.vocab_size() < 256) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "checkpoint %d in '%s' has a vocabulary of %d tokens, fewer than a byte's 256 values: it "
        "was trained on 16-bit tokens; evaluate a file of those (--format uint16)",
        ckpt.step, o.checkpoint_dir, ckpt.model.vocab_size()));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<data::TokenDataset> file,
                   data::TokenDataset::OpenAllHeldOut(o.data, ckpt.model.vocab_size(), seq_len,
                                                      storage::Env::Default()));
  const int64_t windows =
      o.max_windows > 0 ? std::min(o.max_windows, file->eval_windows()) : file->eval_windows();
  const int64_t batch = std::min(o.batch, windows);

  ASSIGN_OR_RETURN(
      std::unique_ptr<CheckpointModel> loaded,
      LoadCheckpointModel(o.checkpoint_dir, ckpt.step, batch, o.threads, o.device, o.offload));
  model::MoeTransformer* model = loaded->model.get();
  ops::Context& ctx = loaded->ctx;

  CheckpointEval out;
  out.step = ckpt.step;
  out.workers = ckpt.workers;
  for (const model::Parameter* p : model->Parameters()) out.parameters += p->shape.numel();
  out.windows = windows;
  out.tokens = windows * seq_len;
  std::vector<int32_t> inputs(static_cast<size_t>(batch * seq_len));
  std::vector<int32_t> targets(inputs.size());
  const Stopwatch clock;
  double sum = 0;
  for (int64_t b = 0; b * batch < windows; ++b) {
    const int64_t count = std::min(batch, windows - b * batch);
    file->EvalBatch(b, batch, 0, count, inputs.data(), targets.data());
    const int64_t n = count * seq_len;
    model::GateCall call{false, static_cast<uint64_t>(ckpt.step), 0};
    call.batch_tokens = n;
    sum += model->Forward(ctx, inputs.data(), targets.data(), count, call) * static_cast<double>(n);
    RETURN_IF_ERROR(loaded->EndPass());
    if (o.progress) o.progress(b * batch + count, windows);
  }
  out.seconds = clock.Seconds();
  out.offload = loaded->offload_report();
  out.loss = sum / static_cast<double>(out.tokens);
  if (!std::isfinite(out.loss)) {
    return absl::DataLossError(absl::StrFormat(
        "checkpoint %d in '%s' gives a loss of %g on '%s': its weights are not finite", ckpt.step,
        o.checkpoint_dir, out.loss, o.data.path()));
  }
  if (o.data.format() == config::DataConfig::BYTES) out.bits_per_byte = out.loss / std::log(2.0);
  return out;
}

}  // namespace strata::train
