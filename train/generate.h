// GenerateFromCheckpoint: text from a checkpoint's model (`strata generate`)
//
// - The model is built from the checkpoint's manifest and its weights read as for
// EvaluateCheckpoint
//   (evaluate.h): a checkpoint of any number of workers, IN_MEMORY or TIERED.
// - Every prompt (bytes; the model must be a bytes model, vocab_size 256) is continued by up to
//   max_tokens tokens, `batch` prompts at a time. Each new token is predicted from the last
//   seq_len tokens of its sequence by a full forward pass over them (the sequence padded to
//   seq_len at its end: causal attention keeps the padding out of the positions before it). Each
//   new token costs a pass over the window, not one position: a KV cache is not used.
// - Sampling: logits / temperature, then the top_k most likely (0: all), then the smallest set
// whose
//   probability reaches top_p (1: all), then a draw keyed by (seed, the prompt's bytes, position):
//   a seed gives a prompt the same text wherever it sits in a batch (on the CPU, bit for bit; a
//   GPU's GEMMs may round a row differently with the batch's shape, which a near tie can show).
//   Beyond seq_len tokens the window slides and its positions start again at 0. temperature 0 takes
//   the most likely token (greedy).
// - Routing of the padding: with a dropless gate every token's route is its own, so padding and
//   batching change nothing; a gate with capacity at evaluation (capacity_factor_eval > 0) or
//   expert-choice routing lets tokens compete, and is refused.
//
// Threads: runs on the caller's thread, the ops fanned out over a pool of its own; on_token is
// called on the caller's thread for every token as it is chosen.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/common/status.h"

namespace strata::train {

struct GenerateOptions {
  std::string checkpoint_dir;
  int64_t step = -1;  // the checkpoint of this step; -1: the newest
  std::vector<std::string> prompts;
  int64_t max_tokens = 64;
  double temperature = 1.0;  // 0: greedy
  int64_t top_k = 0;         // 0: every token
  double top_p = 1.0;        // (0, 1]
  uint64_t seed = 0;
  int64_t batch = 16;  // prompts generated together, at least 1
  int threads = 0;     // CPU threads; 0: every core
  std::string device = "cpu";
  // A token chosen for prompt `prompt` (its index), as it is chosen.
  std::function<void(int prompt, uint8_t token)> on_token;
};

struct Generation {
  int64_t step = 0;                      // of the checkpoint
  std::vector<std::string> completions;  // one per prompt, without the prompt
  int64_t tokens = 0;                    // tokens generated over all prompts
  double seconds = 0;
};

[[nodiscard]] StatusOr<Generation> GenerateFromCheckpoint(const GenerateOptions& options);

// The sampling rule above, for one position: the token drawn from `logits` [vocab] with draw
// counter `counter` of stream `key`. Pure.
int SampleToken(const float* logits, int vocab, double temperature, int64_t top_k, double top_p,
                uint64_t key, uint64_t counter);

}  // namespace strata::train
