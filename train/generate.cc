#include "train/generate.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "absl/strings/str_format.h"
#include "checkpoint/manager.h"
#include "core/common/clock.h"
#include "core/common/rng.h"
#include "train/evaluate.h"

namespace strata::train {

int SampleToken(const float* logits, int vocab, double temperature, int64_t top_k, double top_p,
                uint64_t key, uint64_t counter) {
  if (temperature == 0) {
    return static_cast<int>(std::max_element(logits, logits + vocab) - logits);
  }
  // Most likely first; ties by the lower token, so the order is a function of the logits alone.
  std::vector<int> order(static_cast<size_t>(vocab));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return logits[a] > logits[b]; });
  const size_t k =
      top_k > 0 ? std::min<size_t>(static_cast<size_t>(top_k), order.size()) : order.size();
  std::vector<double> p(k);
  double sum = 0;
  for (size_t i = 0; i < k; ++i) {
    // Relative to the most likely first: a tiny temperature cannot make inf - inf.
    p[i] = std::exp((static_cast<double>(logits[order[i]]) - logits[order[0]]) / temperature);
    sum += p[i];
  }
  // The smallest prefix whose probability reaches top_p.
  size_t keep = k;
  double mass = 0;
  for (size_t i = 0; i < k; ++i) {
    mass += p[i] / sum;
    if (mass >= top_p) {
      keep = i + 1;
      break;
    }
  }
  const double kept =
      std::accumulate(p.begin(), p.begin() + static_cast<std::ptrdiff_t>(keep), 0.0);
  const double u = rng::Uniform(key, counter) * kept;
  double acc = 0;
  for (size_t i = 0; i < keep; ++i) {
    acc += p[i];
    if (u < acc) return order[i];
  }
  return order[keep - 1];
}

namespace {

// FNV-1a of a prompt's bytes: its draws' key, so a prompt draws the same wherever it sits in a
// batch.
uint64_t PromptHash(const std::string& prompt) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : prompt) h = (h ^ c) * 0x100000001b3ULL;
  return h;
}

}  // namespace

StatusOr<Generation> GenerateFromCheckpoint(const GenerateOptions& o) {
  if (o.prompts.empty()) return absl::InvalidArgumentError("no prompt to continue");
  for (size_t i = 0; i < o.prompts.size(); ++i) {
    if (o.prompts[i].empty()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "prompt %d is empty; a prompt needs at least one byte to continue", i + 1));
    }
  }
  if (o.max_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("max_tokens must be at least 1, not %d", o.max_tokens));
  }
  if (!(o.temperature >= 0) || !std::isfinite(o.temperature)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("the temperature must be 0 (greedy) or more, not %g", o.temperature));
  }
  if (o.top_k < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("top_k must be 0 (every token) or more, not %d", o.top_k));
  }
  if (!(o.top_p > 0 && o.top_p <= 1)) {
    return absl::InvalidArgumentError(absl::StrFormat("top_p must be in (0, 1], not %g", o.top_p));
  }
  if (o.batch < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("the batch must be at least 1 prompt, not %d", o.batch));
  }
  // The model's kind first, before its weights are read.
  ASSIGN_OR_RETURN(const checkpoint::CheckpointManager::ModelOfCheckpoint ckpt,
                   checkpoint::CheckpointManager::ReadModelConfig(o.checkpoint_dir, o.step));
  const config::ModelConfig& cfg = ckpt.model;
  if (cfg.vocab_size() != 256) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "checkpoint %d in '%s' is a model of %d tokens, not of bytes (vocab_size 256): its "
        "prompts and outputs are not text",
        ckpt.step, o.checkpoint_dir, cfg.vocab_size()));
  }
  const config::GateConfig& gate = cfg.moe().gate();
  if (gate.type() == config::GateConfig::EXPERT_CHOICE || gate.capacity_factor_eval() > 0) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "checkpoint %d in '%s' routes with %s: the tokens of a batch compete for experts, so the "
        "padding of a generation window would change what a prompt's tokens get",
        ckpt.step, o.checkpoint_dir,
        gate.type() == config::GateConfig::EXPERT_CHOICE ? "expert choice"
                                                         : "capacity_factor_eval > 0"));
  }
  const int64_t P = static_cast<int64_t>(o.prompts.size());
  const int64_t batch = std::min(o.batch, P);
  ASSIGN_OR_RETURN(std::unique_ptr<CheckpointModel> m,
                   LoadCheckpointModel(o.checkpoint_dir, ckpt.step, batch, o.threads, o.device));

  const int64_t T = cfg.seq_len(), V = cfg.vocab_size();
  Generation out;
  out.step = ckpt.step;
  out.completions.resize(static_cast<size_t>(P));
  std::vector<int32_t> tokens(static_cast<size_t>(batch * T)), targets(tokens.size(), 0);
  std::vector<float> logits(static_cast<size_t>(batch * T * V));
  const Stopwatch clock;
  // The prompts in batches of `batch`: a prompt's text does not depend on its batch.
  for (int64_t first = 0; first < P; first += batch) {
    const int64_t B = std::min(batch, P - first);
    std::vector<std::vector<int32_t>> seqs(static_cast<size_t>(B));
    for (int64_t b = 0; b < B; ++b) {
      for (unsigned char c : o.prompts[first + b]) seqs[b].push_back(c);
    }
    for (int64_t t = 0; t < o.max_tokens; ++t) {
      // Each sequence's last T tokens at the start of its row, padding (token 0) after them.
      std::vector<int64_t> last(static_cast<size_t>(B));
      for (int64_t b = 0; b < B; ++b) {
        const std::vector<int32_t>& s = seqs[b];
        const int64_t n = std::min<int64_t>(T, static_cast<int64_t>(s.size()));
        std::fill(tokens.begin() + b * T, tokens.begin() + (b + 1) * T, 0);
        std::copy(s.end() - n, s.end(), tokens.begin() + b * T);
        last[b] = n - 1;
      }
      model::GateCall call{false, static_cast<uint64_t>(out.step), 0};
      call.batch_tokens = B * T;
      m->model->Forward(m->ctx, tokens.data(), targets.data(), B, call);
      m->model->logits().CopyToHost(logits.data());
      for (int64_t b = 0; b < B; ++b) {
        const float* row = logits.data() + (b * T + last[b]) * V;
        if (!std::all_of(row, row + V, [](float x) { return std::isfinite(x); })) {
          return absl::DataLossError(absl::StrFormat(
              "checkpoint %d in '%s' gives logits that are not finite: its weights are damaged "
              "or training diverged",
              out.step, o.checkpoint_dir));
        }
        const int64_t prompt = first + b;
        const int token =
            SampleToken(row, static_cast<int>(V), o.temperature, o.top_k, o.top_p,
                        rng::Key(o.seed, PromptHash(o.prompts[prompt]), 0x67656e), seqs[b].size());
        seqs[b].push_back(token);
        out.completions[prompt].push_back(static_cast<char>(token));
        ++out.tokens;
        if (o.on_token) o.on_token(static_cast<int>(prompt), static_cast<uint8_t>(token));
      }
    }
  }
  out.seconds = clock.Seconds();
  return out;
}

}  // namespace strata::train
