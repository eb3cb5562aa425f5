// DataParallel's gradient buckets in one process, with a recording Communicator standing in for a
// twin worker (its all-reduce triples every element): the bucket plan (size limit, reverse block
// order, every gradient exactly once), that reduction starts while backward is still running, and
// that every gradient written back is the model run alone's, tripled and averaged, bit for bit. The
// same with the model on a GPU (skipped without one): the buckets are page-locked host memory,
// filled and emptied by copies ordered after the backward kernels.
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <random>
#include <set>

#include "core/common/thread_pool.h"
#include "runtime/comm/communicator.h"
#include "runtime/model/transformer.h"
#include "scheduler/data_parallel.h"

namespace strata::scheduler {
namespace {

// A world of two whose all-reduce triples the gradients (not doubles: x * 2 * 1/2 would be x again,
// and a result never written back would pass); the double sums (gate statistics, the loss) double,
// as a peer with the same data would make them. The rest is trivial.
class TwinCommunicator : public comm::Communicator {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 2; }
  std::string backend() const override { return "twin"; }
  Status AllReduce(float* data, size_t n) override {
    for (size_t i = 0; i < n; ++i) data[i] *= 3.0f;
    std::lock_guard<std::mutex> lock(mu);
    sizes.push_back(n);
    cv.notify_all();
    return absl::OkStatus();
  }
  Status AllReduce(double* data, size_t n) override {
    for (size_t i = 0; i < n; ++i) data[i] *= 2.0;
    return absl::OkStatus();
  }
  Status AllToAllV(const void*, const std::vector<int64_t>&, void*, const std::vector<int64_t>&,
                   size_t) override {
    return absl::UnimplementedError("not used");
  }
  Status AllGather(const void*, size_t, void*) override { return absl::UnimplementedError(""); }
  Status Broadcast(void*, size_t, int) override { return absl::UnimplementedError(""); }
  Status Barrier() override { return absl::OkStatus(); }
  void Abort(const std::string&) override {}

  std::mutex mu;
  std::condition_variable cv;
  std::vector<size_t> sizes;  // floats per all-reduce, in call order
};

// Forwards to DataParallel; at the end of backward, before passing it on, waits (up to 10 s)
// until the twin saw a first all-reduce: one launched by an earlier block, while backward ran.
class Watcher : public model::GradientReadyListener {
 public:
  Watcher(DataParallel* dp, TwinCommunicator* twin) : dp_(dp), twin_(twin) {}
  void BlockReady(int block) override {
    order.push_back(block);
    if (block == -1) {
      // Before the last blocks' buckets are launched: only earlier ones can have started.
      std::unique_lock<std::mutex> lock(twin_->mu);
      reduced_before_end =
          twin_->cv.wait_for(lock, std::chrono::seconds(10), [&] { return !twin_->sizes.empty(); });
    }
    dp_->BlockReady(block);
  }
  std::vector<int> order;
  bool reduced_before_end = false;

 private:
  DataParallel* dp_;
  TwinCommunicator* twin_;
};

config::ModelConfig Model() {
  config::ModelConfig m;
  m.set_vocab_size(19);
  m.set_seq_len(8);
  m.set_d_model(16);
  m.set_n_layers(3);
  m.set_n_heads(2);
  m.set_d_ff(24);
  m.set_moe_every(2);  // blocks 1 is MoE, 0 and 2 dense
  m.mutable_moe()->set_num_experts(4);
  m.mutable_moe()->set_top_k(2);
  m.mutable_moe()->set_d_expert(12);
  return m;
}

void BucketsAveragedToTheSingleProcessGradient(Device device) {
  ThreadPool pool(2);
  ops::Context ctx{&pool};
  model::ModelOptions mo;
  mo.config = Model();
  mo.seed = 3;
  mo.max_batch = 2;
  mo.device = device;
  auto solo = model::MoeTransformer::Create(ctx, mo);
  auto twin_model = model::MoeTransformer::Create(ctx, mo);
  ASSERT_TRUE(solo.ok() && twin_model.ok());
  std::mt19937 g(5);
  std::vector<int32_t> tokens(16), targets(16);
  for (int i = 0; i < 16; ++i) {
    tokens[i] = static_cast<int32_t>(g() % 19);
    targets[i] = static_cast<int32_t>(g() % 19);
  }
  const model::GateCall call{true, 0};
  (*solo)->ZeroGrad();
  (*solo)->Forward(ctx, tokens.data(), targets.data(), 2, call);
  (*solo)->Backward(ctx);

  TwinCommunicator twin;
  DataParallelOptions o;
  o.bucket_bytes = 2048;  // 512 floats: several buckets, and parameters larger than one
  DataParallel dp(**twin_model, &twin, &twin, o);
  Watcher watcher(&dp, &twin);
  (*twin_model)->AttachParallel(nullptr, nullptr, &watcher);
  (*twin_model)->ZeroGrad();
  (*twin_model)->Forward(ctx, tokens.data(), targets.data(), 2, call);
  (*twin_model)->Backward(ctx);
  ASSERT_TRUE(dp.FinishGradients().ok());

  EXPECT_EQ(watcher.order, (std::vector<int>{2, 1, 0, -1}));
  EXPECT_TRUE(watcher.reduced_before_end) << "no all-reduce had started when backward ended";
  // One all-reduce per bucket; each within the size unless it is a single larger parameter.
  ASSERT_EQ(static_cast<int>(twin.sizes.size()), dp.num_buckets());
  EXPECT_GE(dp.num_buckets(), 6);
  std::set<int64_t> sizes_of_params;
  for (const model::Parameter* p : (*twin_model)->Parameters()) {
    sizes_of_params.insert(p->grad.numel());
  }
  for (size_t n : twin.sizes) {
    EXPECT_TRUE(n <= 512 || sizes_of_params.count(static_cast<int64_t>(n)))
        << "a bucket of " << n << " floats is over the size and not a single parameter";
  }
  // The buckets hold every gradient once, in total.
  size_t total = 0;
  for (size_t n : twin.sizes) total += n;
  size_t params = 0;
  for (const model::Parameter* p : (*twin_model)->Parameters()) params += p->grad.numel();
  EXPECT_EQ(total, params);
  // Every gradient is the model alone's x, tripled by the twin and averaged over its 2 workers:
  // (x * 3) * 1/2 in float, bit for bit.
  const auto& a = (*solo)->Parameters();
  const auto& b = (*twin_model)->Parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i]->name, b[i]->name);
    ASSERT_EQ(b[i]->grad.device(), device) << b[i]->name;
    const Tensor ga = a[i]->grad.To(Device::Cpu()), gb = b[i]->grad.To(Device::Cpu());
    for (int64_t j = 0; j < ga.numel(); ++j) {
      const float want = (ga.f32()[j] * 3.0f) * 0.5f;
      ASSERT_EQ(want, gb.f32()[j]) << a[i]->name << "[" << j << "]";
    }
  }
}

TEST(DataParallelTest, BucketsInReverseBlockOrderAveragedToTheSingleProcessGradient) {
  BucketsAveragedToTheSingleProcessGradient(Device::Cpu());
}

TEST(DataParallelGpuTest, BucketsThroughPinnedHostMemoryAveragedToTheSingleProcessGradient) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no GPU";
  BucketsAveragedToTheSingleProcessGradient(Device::Cuda(0));
}

}  // namespace
}  // namespace strata::scheduler
