// TokenDataset: a token file split into a training part and a held-out tail, served as windows
// of seq_len + 1 tokens (inputs and next-token targets).
//
// Which windows a step trains on is a pure function of (seed, step, global batch): sample
// g = step * global_batch + i is window Permute(g mod N) of epoch g / N, where Permute is a
// keyed bijection of [0, N) (a Feistel network with cycle walking) re-keyed every epoch. So every
// window is seen exactly once per epoch, any worker can compute any sample without coordination,
// and splitting a step's samples over a different number of workers changes who reads a sample,
// never which samples a step contains.
//
// Ownership and threads: a TokenDataset owns its mapping of the file (from the Env, which is used
// only inside Open and OpenAllHeldOut) and never changes after it is opened, so every method may
// be called from any number of threads at once. The batch functions fill arrays the caller owns.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/common/status.h"
#include "proto/config.pb.h"
#include "storage/env.h"

namespace strata::data {

// A keyed pseudo-random permutation of [0, n): i -> Permute(i) is a bijection for every key. Pure.
uint64_t PermuteIndex(uint64_t i, uint64_t n, uint64_t key);

class TokenDataset {
 public:
  // Opens config.path (already resolved). Fails with a message naming the file when it is
  // missing, has the wrong length for its format (an odd size for UINT16), holds a UINT16 token
  // >= vocab_size, or is too short for one training and one held-out window. A BYTES file is not
  // checked against vocab_size: config validation requires vocab_size >= 256 for it.
  [[nodiscard]] static StatusOr<std::unique_ptr<TokenDataset>> Open(
      const config::DataConfig& config, int vocab_size, int seq_len, storage::Env* env);
  // The whole file as held-out windows (`strata eval`): train_windows() is 0, and eval window w
  // starts at token w * seq_len. The same checks of the file as Open, and at least one window.
  [[nodiscard]] static StatusOr<std::unique_ptr<TokenDataset>> OpenAllHeldOut(
      const config::DataConfig& config, int vocab_size, int seq_len, storage::Env* env);

  int64_t num_tokens() const { return num_tokens_; }
  int64_t train_tokens() const { return train_tokens_; }
  int64_t train_windows() const { return train_windows_; }
  int64_t eval_windows() const { return eval_windows_; }
  int seq_len() const { return seq_len_; }

  // The training window of global sample g (see the file comment). REQUIRES: train_windows() > 0
  // (not a dataset of OpenAllHeldOut); so do TrainBatch's.
  int64_t TrainWindow(uint64_t seed, int64_t sample) const;
  // Global sample ids of step `step`: step * global_batch + [0, global_batch).
  static int64_t FirstSample(int64_t step, int64_t global_batch) { return step * global_batch; }

  // Fills inputs/targets [count, seq_len] with samples first .. first + count - 1.
  void TrainBatch(uint64_t seed, int64_t first_sample, int64_t count, int32_t* inputs,
                  int32_t* targets) const;
  // Held-out batch `index` of `batch` sequences: eval windows index * batch + [0, batch), modulo
  // the number of eval windows.
  void EvalBatch(int64_t index, int64_t batch, int32_t* inputs, int32_t* targets) const {
    EvalBatch(index, batch, 0, batch, inputs, targets);
  }
  // Sequences [first, first + count) of that batch: a data-parallel worker's share.
  void EvalBatch(int64_t index, int64_t batch, int64_t first, int64_t count, int32_t* inputs,
                 int32_t* targets) const;

 private:
  TokenDataset() = default;
  // The file mapped and checked against its format and vocab_size; no split yet.
  [[nodiscard]] static StatusOr<std::unique_ptr<TokenDataset>> Map(const config::DataConfig& config,
                                                                   int vocab_size, int seq_len,
                                                                   storage::Env* env);
  int32_t Token(int64_t i) const;
  void Window(int64_t start, int32_t* inputs, int32_t* targets) const;

  std::unique_ptr<storage::ReadOnlyRegion> region_;
  config::DataConfig::Format format_ = config::DataConfig::BYTES;
  int seq_len_ = 0;
  int64_t num_tokens_ = 0;
  int64_t train_tokens_ = 0;
  int64_t train_windows_ = 0;
  int64_t eval_windows_ = 0;
};

}  // namespace strata::data
