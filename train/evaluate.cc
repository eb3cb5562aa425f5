#include "train/evaluate.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/str_format.h"
#include "checkpoint/manager.h"
#include "core/common/clock.h"
#include "core/common/thread_pool.h"
#include "core/device/device.h"
#include "runtime/data/dataset.h"
#include "runtime/model/transformer.h"
#include "storage/env.h"

namespace strata::train {

StatusOr<std::unique_ptr<CheckpointModel>> LoadCheckpointModel(const std::string& dir, int64_t step,
                                                               int64_t max_batch, int threads,
                                                               const std::string& device_name) {
  auto m = std::make_unique<CheckpointModel>();
  ASSIGN_OR_RETURN(m->checkpoint, checkpoint::CheckpointManager::ReadModelConfig(dir, step));
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
  ASSIGN_OR_RETURN(m->model, model::MoeTransformer::Create(m->ctx, mo));
  RETURN_IF_ERROR(checkpoint::CheckpointManager::ReadWeights(dir, m->checkpoint.step,
                                                             m->checkpoint.seed, *m->model));
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

  ASSIGN_OR_RETURN(std::unique_ptr<CheckpointModel> loaded,
                   LoadCheckpointModel(o.checkpoint_dir, ckpt.step, batch, o.threads, o.device));
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
    if (o.progress) o.progress(b * batch + count, windows);
  }
  out.seconds = clock.Seconds();
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
