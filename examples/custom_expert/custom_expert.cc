// A custom expert through strata's C++ API.
//
// strata's MoE layer accepts any model::Expert: a function of a block of token rows with its own
// parameters. This example defines ScaledLinearExpert, y = g * (x W^T) with a learned per-channel
// gain g, checks its gradients against finite differences (the way to validate any new expert),
// and trains the example config with it in place of the default FFN experts.
//
//   build/bin/custom_expert_example [--config FILE] [--data FILE] [--steps N]
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>

#include "absl/strings/numbers.h"
#include "kernels/blas_kernel.h"
#include "proto/config_io.h"
#include "runtime/model/expert.h"
#include "train/trainer.h"

namespace {

using strata::Tensor;
using strata::model::Init;
using strata::model::MakeParameter;
using strata::model::Parameter;

class ScaledLinearExpert : public strata::model::Expert {
 public:
  ScaledLinearExpert(const std::string& prefix, int64_t d_model)
      : C_(d_model),
        w_(MakeParameter(prefix + ".w", {d_model, d_model}, Init::kNormal, 0.02f, true)),
        gain_(MakeParameter(prefix + ".gain", {d_model}, Init::kOnes, 0, false)) {}

  // Backward needs u = x W^T for the gain's gradient.
  int64_t SavedPerRow() const override { return C_; }

  void Forward(strata::ops::Context& ctx, const Tensor& x, const Tensor& y,
               const Tensor& saved) override {
    const int64_t n = x.dim(0);
    Tensor u = saved.View(0, {n, C_});
    strata::ops::LinearForward(ctx, u, x, w_->value, Tensor());
    const float* g = gain_->value.f32();
    for (int64_t r = 0; r < n; ++r)
      for (int64_t c = 0; c < C_; ++c) y.f32()[r * C_ + c] = g[c] * u.f32()[r * C_ + c];
  }

  void Backward(strata::ops::Context& ctx, const Tensor& x, const Tensor& dy, const Tensor& dx,
                const Tensor& saved) override {
    const int64_t n = x.dim(0);
    Tensor u = saved.View(0, {n, C_});
    const float* g = gain_->value.f32();
    float* dg = gain_->grad.f32();
    // dgain += sum_rows dy * u; then u's storage is reused for du = dy * gain.
    for (int64_t r = 0; r < n; ++r)
      for (int64_t c = 0; c < C_; ++c) {
        const int64_t i = r * C_ + c;
        dg[c] += dy.f32()[i] * u.f32()[i];
        u.f32()[i] = dy.f32()[i] * g[c];
      }
    strata::ops::LinearBackward(ctx, dx, w_->grad, Tensor(), u, x, w_->value, false);
  }

  std::vector<Parameter*> Parameters() override { return {w_.get(), gain_.get()}; }

 private:
  int64_t C_;
  std::unique_ptr<Parameter> w_, gain_;
};

// Central differences of L = <r, expert(x)> against the expert's Backward, in float.
bool CheckGradients() {
  strata::ThreadPool pool(1);
  strata::ops::Context ctx{&pool};
  const int64_t n = 3, C = 5;
  ScaledLinearExpert e("check", C);
  std::mt19937 gen(1);
  std::normal_distribution<float> nd(0, 1);
  for (Parameter* p : e.Parameters()) {
    for (int64_t i = 0; i < p->value.numel(); ++i) p->value.f32()[i] = nd(gen);
  }
  Tensor x = Tensor::Empty({n, C}), r = Tensor::Empty({n, C}), y = Tensor::Empty({n, C});
  Tensor dx = Tensor::Empty({n, C}), saved = Tensor::Empty({n, C});
  for (int64_t i = 0; i < n * C; ++i) x.f32()[i] = nd(gen), r.f32()[i] = nd(gen);
  auto loss = [&] {
    e.Forward(ctx, x, y, saved);
    double l = 0;
    for (int64_t i = 0; i < n * C; ++i) l += double(r.f32()[i]) * y.f32()[i];
    return l;
  };
  loss();
  e.Backward(ctx, x, r, dx, saved);
  double worst = 0;
  auto check = [&](float* v, const float* g, int64_t count) {
    for (int64_t i = 0; i < count; ++i) {
      const float saved_v = v[i], h = 1e-2f;
      v[i] = saved_v + h;
      const double lp = loss();
      v[i] = saved_v - h;
      const double lm = loss();
      v[i] = saved_v;
      const double numeric = (lp - lm) / (2 * h);
      worst = std::max(worst, std::abs(numeric - g[i]) / (1e-3 + std::abs(numeric)));
    }
  };
  check(x.f32(), dx.f32(), n * C);
  for (Parameter* p : e.Parameters()) check(p->value.f32(), p->grad.f32(), p->value.numel());
  std::printf("gradient check of ScaledLinearExpert: max relative error %.2e\n", worst);
  return worst < 1e-2;
}

}  // namespace

int main(int argc, char** argv) {
  // As `strata` does: the CPU GEMMs on the best OpenBLAS kernel this CPU runs (this may execute
  // the program again, once, before anything else happens).
  if (strata::Status s = strata::blas::ChooseKernelAtStart(argv); !s.ok()) {
    std::fprintf(stderr, "custom_expert_example: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  std::string config_path =
      std::string(STRATA_SOURCE_DIR) + "/examples/custom_expert/config.textproto";
  std::string data_path;
  int64_t steps = -1;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--config") && i + 1 < argc) {
      config_path = argv[++i];
    } else if (!std::strcmp(argv[i], "--data") && i + 1 < argc) {
      data_path = argv[++i];
    } else if (!std::strcmp(argv[i], "--steps") && i + 1 < argc &&
               absl::SimpleAtoi(argv[i + 1], &steps) && steps > 0) {
      ++i;
    } else {
      std::fprintf(stderr,
                   "usage: custom_expert_example [--config FILE] [--data FILE] [--steps N]\n");
      return 2;
    }
  }
  if (!CheckGradients()) {
    std::fprintf(stderr, "custom_expert_example: the expert's gradients are wrong\n");
    return 1;
  }
  auto cfg = strata::config::LoadJobConfig(config_path);
  if (!cfg.ok()) {
    std::fprintf(stderr, "%s\n", std::string(cfg.status().message()).c_str());
    return 1;
  }
  if (!data_path.empty()) cfg->mutable_data()->set_path(data_path);
  if (steps > 0) cfg->mutable_train()->set_steps(static_cast<int>(steps));

  strata::train::TrainOptions options;
  options.config = *cfg;
  const int64_t d_model = cfg->model().d_model();
  options.expert_factory = [d_model](int, int, const std::string& prefix) {
    return std::make_unique<ScaledLinearExpert>(prefix, d_model);
  };
  auto trainer = strata::train::Trainer::Create(options);
  if (!trainer.ok()) {
    std::fprintf(stderr, "%s\n", std::string(trainer.status().message()).c_str());
    return 1;
  }
  if (auto s = (*trainer)->Run(); !s.ok()) {
    std::fprintf(stderr, "%s\n", std::string(s.message()).c_str());
    return 1;
  }
  const auto& h = (*trainer)->history();
  std::printf("trained %zu steps with ScaledLinearExpert experts: loss %.3f -> %.3f\n", h.size(),
              h.front().loss, h.back().loss);
  return h.back().loss < h.front().loss ? 0 : 1;
}
