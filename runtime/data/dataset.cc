#include "runtime/data/dataset.h"

#include <cmath>

#include "absl/strings/str_format.h"
#include "core/common/rng.h"

namespace strata::data {

uint64_t PermuteIndex(uint64_t i, uint64_t n, uint64_t key) {
  if (n <= 1) return 0;
  // Smallest even bit width 2h with 2^(2h) >= n; a 4-round Feistel network on two h-bit halves is
  // a bijection of [0, 2^(2h)), and walking the cycle until the value lands below n restricts it
  // to a bijection of [0, n) (expected < 4 rounds of walking).
  int bits = 0;
  while ((uint64_t{1} << bits) < n) ++bits;
  const int half = (bits + 1) / 2;
  const uint64_t mask = (uint64_t{1} << half) - 1;
  uint64_t x = i;
  do {
    uint64_t left = x >> half, right = x & mask;
    for (uint64_t round = 0; round < 4; ++round) {
      uint64_t f = rng::Bits(key, (round << 58) ^ right) & mask;
      uint64_t next = left ^ f;
      left = right;
      right = next;
    }
    x = (left << half) | right;
  } while (x >= n);
  return x;
}

StatusOr<std::unique_ptr<TokenDataset>> TokenDataset::Open(const config::DataConfig& config,
                                                           int vocab_size, int seq_len,
                                                           storage::Env* env) {
  ASSIGN_OR_RETURN(std::unique_ptr<TokenDataset> d, Map(config, vocab_size, seq_len, env));
  const int64_t eval_tokens = static_cast<int64_t>(
      std::floor(static_cast<double>(d->num_tokens_) * config.eval_fraction()));
  d->train_tokens_ = d->num_tokens_ - eval_tokens;
  d->train_windows_ = (d->train_tokens_ - 1) / seq_len;
  d->eval_windows_ = (eval_tokens - 1) / seq_len;
  if (d->train_windows_ < 1 || d->eval_windows_ < 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "data file '%s' has %d tokens: too few for one training and one held-out window of "
        "seq_len + 1 = %d tokens with eval_fraction %g; use more data, a shorter seq_len or a "
        "larger eval_fraction",
        config.path(), d->num_tokens_, seq_len + 1, config.eval_fraction()));
  }
  return d;
}

StatusOr<std::unique_ptr<TokenDataset>> TokenDataset::OpenAllHeldOut(
    const config::DataConfig& config, int vocab_size, int seq_len, storage::Env* env) {
  ASSIGN_OR_RETURN(std::unique_ptr<TokenDataset> d, Map(config, vocab_size, seq_len, env));
  d->train_tokens_ = 0;
  d->train_windows_ = 0;
  d->eval_windows_ = (d->num_tokens_ - 1) / seq_len;
  if (d->eval_windows_ < 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "data file '%s' has %d tokens: too few for one window of seq_len + 1 = %d tokens",
        config.path(), d->num_tokens_, seq_len + 1));
  }
  return d;
}

StatusOr<std::unique_ptr<TokenDataset>> TokenDataset::Map(const config::DataConfig& config,
                                                          int vocab_size, int seq_len,
                                                          storage::Env* env) {
  auto region = env->MapReadOnly(config.path());
  if (!region.ok()) {
    return absl::Status(
        region.status().code(),
        absl::StrCat("cannot open the data file (data.path): ", region.status().message(),
                     "; the example configs' prepare scripts create theirs"));
  }
  std::unique_ptr<TokenDataset> d(new TokenDataset);
  d->region_ = *std::move(region);
  d->format_ = config.format();
  d->seq_len_ = seq_len;
  const size_t bytes = d->region_->size();
  if (d->format_ == config::DataConfig::UINT16) {
    if (bytes % 2 != 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "data file '%s' has %d bytes, not a whole number of 16-bit tokens (data.format UINT16); "
          "is it a BYTES file?",
          config.path(), bytes));
    }
    d->num_tokens_ = static_cast<int64_t>(bytes / 2);
    for (int64_t i = 0; i < d->num_tokens_; ++i) {
      if (d->Token(i) >= vocab_size) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "data file '%s': token %d at byte offset %d is >= model.vocab_size %d; raise "
            "vocab_size or re-tokenise",
            config.path(), d->Token(i), 2 * i, vocab_size));
      }
    }
  } else {
    d->num_tokens_ = static_cast<int64_t>(bytes);
  }
  return d;
}

int32_t TokenDataset::Token(int64_t i) const {
  const uint8_t* p = region_->data();
  if (format_ == config::DataConfig::UINT16) {
    return static_cast<int32_t>(p[2 * i]) | (static_cast<int32_t>(p[2 * i + 1]) << 8);
  }
  return p[i];
}

void TokenDataset::Window(int64_t start, int32_t* inputs, int32_t* targets) const {
  for (int j = 0; j < seq_len_; ++j) {
    inputs[j] = Token(start + j);
    targets[j] = Token(start + j + 1);
  }
}

int64_t TokenDataset::TrainWindow(uint64_t seed, int64_t sample) const {
  const uint64_t n = static_cast<uint64_t>(train_windows_);
  const uint64_t epoch = static_cast<uint64_t>(sample) / n;
  const uint64_t index = static_cast<uint64_t>(sample) % n;
  return static_cast<int64_t>(PermuteIndex(index, n, rng::Key(seed, epoch, 0x64617461)));
}

void TokenDataset::TrainBatch(uint64_t seed, int64_t first_sample, int64_t count, int32_t* inputs,
                              int32_t* targets) const {
  for (int64_t i = 0; i < count; ++i) {
    const int64_t w = TrainWindow(seed, first_sample + i);
    Window(w * seq_len_, inputs + i * seq_len_, targets + i * seq_len_);
  }
}

void TokenDataset::EvalBatch(int64_t index, int64_t batch, int64_t first, int64_t count,
                             int32_t* inputs, int32_t* targets) const {
  for (int64_t i = 0; i < count; ++i) {
    const int64_t w = (index * batch + first + i) % eval_windows_;
    Window(train_tokens_ + w * seq_len_, inputs + i * seq_len_, targets + i * seq_len_);
  }
}

}  // namespace strata::data
