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

StatusOr<CheckpointEval> EvaluateCheckpoint(const CheckpointEvalOptions& o) {
  if (o.batch < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("the batch must be at least 1 window, not %d", o.batch));
  }
  ASSIGN_OR_RETURN(const checkpoint::CheckpointManager::ModelOfCheckpoint ckpt,
                   checkpoint::CheckpointManager::ReadModelConfig(o.checkpoint_dir, o.step));
  ASSIGN_OR_RETURN(const Device device, Device::Parse(o.device));
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

  const int threads = o.threads > 0
                          ? o.threads
                          : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  ThreadPool pool(threads);
  ops::Context ctx;
  ctx.pool = &pool;
  model::ModelOptions mo;
  mo.config = ckpt.model;
  mo.seed = ckpt.seed;
  mo.max_batch = batch;
  mo.batch_sequences = batch;
  mo.device = device;
  ASSIGN_OR_RETURN(std::unique_ptr<model::MoeTransformer> model,
                   model::MoeTransformer::Create(ctx, mo));
  RETURN_IF_ERROR(
      checkpoint::CheckpointManager::ReadWeights(o.checkpoint_dir, ckpt.step, ckpt.seed, *model));

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
