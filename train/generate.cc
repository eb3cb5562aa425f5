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

uint64_t PromptKey(uint64_t seed, const std::string& prompt) {
  // FNV-1a of the prompt's bytes.
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : prompt) h = (h ^ c) * 0x100000001b3ULL;
  return rng::Key(seed, h, 0x67656e);
}

namespace {

Status CheckOptions(const GenerateOptions& o) {
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
  return absl::OkStatus();
}

// A bytes model whose gate routes each token on its own; `what` names it ("checkpoint 30 in
// 'ckpt'").
Status CheckModel(const config::ModelConfig& cfg, const std::string& what) {
  if (cfg.vocab_size() != 256) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s is a model of %d tokens, not of bytes (vocab_size 256): its prompts and outputs are "
        "not text",
        what, cfg.vocab_size()));
  }
  const config::GateConfig& gate = cfg.moe().gate();
  if (gate.type() == config::GateConfig::EXPERT_CHOICE || gate.capacity_factor_eval() > 0) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s routes with %s: the tokens of a batch compete for experts, so a token's route would "
        "depend on what is decoded beside it; generation needs a gate that routes each token on "
        "its own",
        what,
        gate.type() == config::GateConfig::EXPERT_CHOICE ? "expert choice"
                                                         : "capacity_factor_eval > 0"));
  }
  return absl::OkStatus();
}

}  // namespace

StatusOr<Generation> GenerateFromCheckpoint(const GenerateOptions& o) {
  RETURN_IF_ERROR(CheckOptions(o));
  // The model's kind first, before its weights are read.
  ASSIGN_OR_RETURN(const checkpoint::CheckpointManager::ModelOfCheckpoint ckpt,
                   checkpoint::CheckpointManager::ReadModelConfig(o.checkpoint_dir, o.step));
  RETURN_IF_ERROR(CheckModel(
      ckpt.model, absl::StrFormat("checkpoint %d in '%s'", ckpt.step, o.checkpoint_dir)));
  const int64_t batch = std::min<int64_t>(o.batch, static_cast<int64_t>(o.prompts.size()));
  ASSIGN_OR_RETURN(
      std::unique_ptr<CheckpointModel> m,
      LoadCheckpointModel(o.checkpoint_dir, ckpt.step, batch, o.threads, o.device, o.offload));
  return Generate(*m, o);
}

StatusOr<Generation> Generate(CheckpointModel& m, const GenerateOptions& o) {
  RETURN_IF_ERROR(CheckOptions(o));
  model::MoeTransformer& model = *m.model;
  const std::string& what = m.name;
  const int64_t step = m.checkpoint.step;
  const config::ModelConfig& cfg = model.config();
  RETURN_IF_ERROR(CheckModel(cfg, what));
  const int64_t P = static_cast<int64_t>(o.prompts.size());
  const int64_t batch = std::min({o.batch, P, model.max_batch()});
  const int64_t T = cfg.seq_len(), V = cfg.vocab_size();
  const int64_t restart = std::max<int64_t>(1, T / 2);
  Generation out;
  out.step = step;
  out.completions.resize(static_cast<size_t>(P));
  std::vector<int32_t> tokens, slots, positions;
  std::vector<float> logits;
  const Stopwatch clock;
  // The prompts in batches of `batch`, prompt b of a batch in cache slot b: a prompt's text does
  // not depend on its batch.
  for (int64_t first = 0; first < P; first += batch) {
    const int64_t B = std::min(batch, P - first);
    struct Sequence {
      std::vector<int32_t> tokens;  // the prompt and what follows it
      int64_t window = 0;           // index of the window's first token (at position 0)
      int64_t decoded = 0;          // tokens of the sequence in the KV cache
    };
    std::vector<Sequence> seqs(static_cast<size_t>(B));
    for (int64_t b = 0; b < B; ++b) {
      for (unsigned char c : o.prompts[first + b]) seqs[b].tokens.push_back(c);
      seqs[b].window = std::max<int64_t>(0, static_cast<int64_t>(seqs[b].tokens.size()) - T);
      seqs[b].decoded = seqs[b].window;
    }
    for (int64_t t = 0; t < o.max_tokens; ++t) {
      // Every sequence's tokens not yet in the cache, as rows of one Decode: a whole window
      // (a prompt, or a restart) or one new token.
      tokens.clear();
      slots.clear();
      positions.clear();
      std::vector<int64_t> last(static_cast<size_t>(B));
      for (int64_t b = 0; b < B; ++b) {
        Sequence& s = seqs[b];
        for (int64_t i = s.decoded; i < static_cast<int64_t>(s.tokens.size()); ++i) {
          tokens.push_back(s.tokens[i]);
          slots.push_back(static_cast<int32_t>(b));
          positions.push_back(static_cast<int32_t>(i - s.window));
        }
        s.decoded = static_cast<int64_t>(s.tokens.size());
        last[b] = static_cast<int64_t>(tokens.size()) - 1;
      }
      const int64_t n = static_cast<int64_t>(tokens.size());
      logits.resize(static_cast<size_t>(n * V));
      model.Decode(m.ctx, tokens.data(), slots.data(), positions.data(), n)
          .CopyToHost(logits.data());
      RETURN_IF_ERROR(m.EndPass());
      ++out.passes;
      for (int64_t b = 0; b < B; ++b) {
        const float* row = logits.data() + last[b] * V;
        if (!std::all_of(row, row + V, [](float x) { return std::isfinite(x); })) {
          return absl::DataLossError(absl::StrFormat(
              "%s gives logits that are not finite: its weights are damaged or training diverged",
              what));
        }
        const int64_t prompt = first + b;
        Sequence& s = seqs[b];
        const int token = SampleToken(row, static_cast<int>(V), o.temperature, o.top_k, o.top_p,
                                      PromptKey(o.seed, o.prompts[prompt]), s.tokens.size());
        s.tokens.push_back(token);
        // A full window restarts with its last T / 2 tokens, decoded again from position 0.
        if (static_cast<int64_t>(s.tokens.size()) - s.window > T) {
          s.window = static_cast<int64_t>(s.tokens.size()) - restart;
          s.decoded = s.window;
        }
        out.completions[prompt].push_back(static_cast<char>(token));
        ++out.tokens;
        if (o.on_token) o.on_token(static_cast<int>(prompt), static_cast<uint8_t>(token));
      }
    }
  }
  out.seconds = clock.Seconds();
  out.offload = m.offload_report();
  return out;
}

}  // namespace strata::train
