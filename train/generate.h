// GenerateFromCheckpoint: text from a checkpoint's model (`strata generate`)
//
// - The model is built from the checkpoint's manifest and its weights read as for
//   EvaluateCheckpoint (evaluate.h): a checkpoint of any number of workers, IN_MEMORY or TIERED.
// - Every prompt (bytes; the model must be a bytes model, vocab_size 256) is continued by up to
//   max_tokens tokens, `batch` prompts at a time, by incremental decoding (MoeTransformer::Decode):
//   a prompt's window is decoded in one pass into the KV cache, then each new token costs one
//   position. A sequence's window is the tokens it is predicted from: the prompt's last seq_len
//   tokens at first; when a new token would make it longer than seq_len, it restarts with its
//   last seq_len / 2 tokens (the new one included), decoded again from position 0. So once a
//   text is that long, each token is predicted from between seq_len / 2 and seq_len tokens, and
//   a restart costs seq_len / 2 positions every seq_len / 2 tokens.
// - Sampling: logits / temperature, then the top_k most likely (0: all), then the smallest set
//   whose probability reaches top_p (1: all), then a draw keyed by (seed, the prompt's bytes,
//   position):
//   a seed gives a prompt the same text wherever it sits in a batch (on the CPU, bit for bit; a
//   GPU's GEMMs may round a row differently with the batch's shape, which a near tie can show).
//   temperature 0 takes the most likely token (greedy).
// - Routing: with a dropless gate every token's route is its own, so batching and the rows a
//   Decode happens to hold change nothing; a gate with capacity at evaluation
//   (capacity_factor_eval > 0) or expert-choice routing lets tokens compete, and is refused.
//
// Threads: runs on the caller's thread, the ops fanned out over a pool of its own (Generate: over
// ctx's, the caller being the one thread using that model and context); on_token is called on the
// caller's thread for every token as it is chosen.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/common/status.h"
#include "train/evaluate.h"

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
  OffloadOptions offload;  // evaluate.h: the experts in a tiered store
  // A token chosen for prompt `prompt` (its index), as it is chosen.
  std::function<void(int prompt, uint8_t token)> on_token;
};

struct Generation {
  int64_t step = 0;                      // of the checkpoint
  std::vector<std::string> completions;  // one per prompt, without the prompt
  int64_t tokens = 0;                    // tokens generated over all prompts
  int64_t passes = 0;                    // Decode calls
  double seconds = 0;
  OffloadReport offload;  // with options.offload
};

[[nodiscard]] StatusOr<Generation> GenerateFromCheckpoint(const GenerateOptions& options);

// The same with a model already loaded (LoadCheckpointModel's, or one a caller built and gave
// its weights): checkpoint_dir, step, threads, device and offload of `options` are not read;
// prompts go min(batch, model max_batch) at a time; model.checkpoint.step is reported as the
// Generation's and model.name names it in errors. The model's KV cache stays allocated.
[[nodiscard]] StatusOr<Generation> Generate(CheckpointModel& model, const GenerateOptions& options);

// The sampling rule above, for one position: the token drawn from `logits` [vocab] with draw
// counter `counter` of stream `key`. Pure.
int SampleToken(const float* logits, int vocab, double temperature, int64_t top_k, double top_p,
                uint64_t key, uint64_t counter);
// The draw stream of a prompt under `seed` (a function of the prompt's bytes, not of its place in
// a batch): the token at index i of the text (prompt included) is drawn with counter i.
uint64_t PromptKey(uint64_t seed, const std::string& prompt);

}  // namespace strata::train
