// One MoE layer on a GPU against the same layer on the CPU (the reference), for every gate, with
// and without capacity drops: routing, drops and plan must be identical; the output, the input
// gradient and every parameter gradient must agree within the bound below.
//
// Bound: max |gpu - cpu| / max |cpu| <= 1e-4 per tensor. Both sides compute in fp32; the GPU's
// GEMMs (cuBLAS, no TF32) and reductions add in another order, which moves results by a few ulp
// of the largest term. The router is peaked (init_std 0.8) so those differences cannot flip a
// top-k choice; a flipped choice would show up as a routing mismatch, not as a tolerance miss.
//
// Skips where no CUDA device is present (every machine without an NVIDIA GPU, and builds without
// CUDA).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "absl/strings/str_cat.h"
#include "core/common/rng.h"
#include "runtime/model/moe_layer.h"
#include "tests/runtime/moe_test_util.h"

namespace strata::model {
namespace {

using config::GateConfig;

struct Case {
  std::string name;
  GateConfig::Type type;
  int k;
  double capacity_factor;
  bool training = true;
  ops::Activation activation = ops::Activation::kGelu;
};

std::string CaseName(const ::testing::TestParamInfo<Case>& info) { return info.param.name; }
void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

constexpr int kTokens = 96, kC = 32, kE = 8, kH = 48, kLayer = 2;
constexpr uint64_t kSeed = 11, kStep = 5;
constexpr double kBound = 1e-4;

std::vector<float> Host(const Tensor& t) {
  Tensor h = t.To(Device::Cpu());
  return std::vector<float>(h.f32(), h.f32() + h.numel());
}

void ExpectClose(const Tensor& gpu, const Tensor& cpu, const std::string& what) {
  const std::vector<float> g = Host(gpu), c = Host(cpu);
  ASSERT_EQ(g.size(), c.size()) << what;
  double scale = 0, worst = 0;
  size_t at = 0;
  for (float v : c) scale = std::max(scale, std::abs(static_cast<double>(v)));
  for (size_t i = 0; i < g.size(); ++i) {
    const double d = std::abs(static_cast<double>(g[i]) - c[i]);
    if (d > worst) worst = d, at = i;
  }
  const double err = worst / std::max(scale, 1e-30);
  EXPECT_LE(err, kBound) << what << ": worst at " << at << " gpu " << g[at] << " cpu " << c[at]
                         << " (normalized error " << err << ")";
}

std::unique_ptr<MoeLayer> MakeLayer(const Case& c, Device device) {
  SoftmaxGateOptions g;
  g.d_model = kC;
  g.num_experts = kE;
  g.k = c.k;
  g.max_tokens = kTokens;
  g.config.set_type(c.type);
  g.config.set_capacity_factor_train(c.capacity_factor);
  g.config.set_capacity_factor_eval(c.capacity_factor);
  g.config.set_aux_loss_coef(0.05f);
  g.config.set_z_loss_coef(0.02f);
  g.config.set_jitter_eps(0.1f);
  g.config.set_renormalize(true);
  g.seed = kSeed;
  g.layer = kLayer;
  g.init_std = 0.8f;
  g.device = device;
  std::vector<std::unique_ptr<Expert>> experts;
  for (int e = 0; e < kE; ++e) {
    FfnOptions f{kC, kH, c.activation, true, 0.3f, 0.3f};
    f.device = device;
    experts.push_back(std::make_unique<FfnExpert>(absl::StrCat("experts.", e), f));
  }
  return std::make_unique<MoeLayer>(kC, kTokens, MakeGate("gate", g), std::move(experts), 0,
                                    device);
}

class MoeLayerGpuTest : public ::testing::TestWithParam<Case> {};

TEST_P(MoeLayerGpuTest, MatchesTheCpuLayer) {
  if (CudaDeviceCount() == 0) {
    GTEST_SKIP() << "no CUDA device: this test runs on a machine with an NVIDIA GPU";
  }
  const Case& c = GetParam();
  const Device gpu = Device::Cuda(0);
  ThreadPool pool(2);
  ops::Context ctx{&pool, nullptr};
  auto cpu_layer = MakeLayer(c, Device::Cpu());
  auto gpu_layer = MakeLayer(c, gpu);
  auto cp = cpu_layer->Parameters(), gp = gpu_layer->Parameters();
  ASSERT_EQ(cp.size(), gp.size());
  for (size_t i = 0; i < cp.size(); ++i) {
    InitializeWithBiases(ctx, *cp[i], kSeed);
    gp[i]->value.CopyFrom(cp[i]->value);
  }
  std::mt19937 gen(3);
  std::normal_distribution<float> nd(0, 1);
  Tensor x = Tensor::Empty({kTokens, kC}), dy = Tensor::Empty({kTokens, kC});
  for (int64_t i = 0; i < x.numel(); ++i) x.f32()[i] = nd(gen);
  for (int64_t i = 0; i < dy.numel(); ++i) dy.f32()[i] = nd(gen);
  Tensor gx = x.To(gpu), gdy = dy.To(gpu);
  Tensor y = Tensor::Empty({kTokens, kC}), dx = Tensor::Empty({kTokens, kC});
  Tensor gy = Tensor::Empty({kTokens, kC}, DType::kF32, gpu);
  Tensor gdx = Tensor::Empty({kTokens, kC}, DType::kF32, gpu);

  const GateCall call{c.training, kStep};
  cpu_layer->Forward(ctx, x, y, call);
  gpu_layer->Forward(ctx, gx, gy, call);
  const MoeStats &cs = cpu_layer->stats(), &gs = gpu_layer->stats();
  EXPECT_EQ(gs.load, cs.load);
  EXPECT_EQ(gs.dropped, cs.dropped);
  EXPECT_EQ(gs.dropped_tokens, cs.dropped_tokens);
  EXPECT_NEAR(gs.aux_loss, cs.aux_loss, 1e-6 * (1 + std::abs(cs.aux_loss)));
  EXPECT_NEAR(gs.z_loss, cs.z_loss, 1e-6 * (1 + std::abs(cs.z_loss)));
  {
    const Tensor ce = cpu_layer->routing().expert.To(Device::Cpu());
    const Tensor ge = gpu_layer->routing().expert.To(Device::Cpu());
    ASSERT_EQ(ce.numel(), ge.numel());
    for (int64_t i = 0; i < ce.numel(); ++i) ASSERT_EQ(ge.i32()[i], ce.i32()[i]) << "choice " << i;
  }
  ExpectClose(gy, y, "y");
  ExpectClose(gpu_layer->routing().weight, cpu_layer->routing().weight, "combine weights");

  if (!c.training) return;
  cpu_layer->Backward(ctx, x, dy, dx);
  gpu_layer->Backward(ctx, gx, gdy, gdx);
  ExpectClose(gdx, dx, "dx");
  for (size_t i = 0; i < cp.size(); ++i) ExpectClose(gp[i]->grad, cp[i]->grad, cp[i]->name);
}

INSTANTIATE_TEST_SUITE_P(
    Gates, MoeLayerGpuTest,
    ::testing::Values(Case{"TopK1_Dropless", GateConfig::TOP_K, 1, 0.0},
                      Case{"TopK2_Dropless", GateConfig::TOP_K, 2, 0.0},
                      Case{"TopK2_Capacity", GateConfig::TOP_K, 2, 0.5},
                      Case{"TopK2_SwiGLU", GateConfig::TOP_K, 2, 0.0, true,
                           ops::Activation::kSwiglu},
                      Case{"Switch_Capacity", GateConfig::SWITCH, 1, 0.5},
                      Case{"GShard_Capacity", GateConfig::GSHARD, 2, 0.5},
                      Case{"Noisy2_Capacity", GateConfig::NOISY_TOP_K, 2, 0.5},
                      Case{"Noisy2_Eval", GateConfig::NOISY_TOP_K, 2, 0.5, false},
                      Case{"ExpertChoice", GateConfig::EXPERT_CHOICE, 2, 1.0},
                      Case{"ExpertChoice_Eval", GateConfig::EXPERT_CHOICE, 2, 1.5, false}),
    CaseName);

}  // namespace
}  // namespace strata::model
