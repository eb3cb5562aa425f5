#include "runtime/model/parameter.h"

#include "core/common/rng.h"

namespace strata::model {

uint64_t NameHash(const std::string& name) {
  uint64_t h = 1469598103934665603ULL;
  for (unsigned char c : name) {
    h ^= c;
    h *= 1099511628211ULL;
  }
  return h;
}

std::unique_ptr<Parameter> MakeParameter(std::string name, Shape shape, Init init, float init_std,
                                         bool decay, Device device) {
  auto p = std::make_unique<Parameter>();
  p->name = std::move(name);
  p->shape = shape;
  p->value = Tensor::Empty(shape, DType::kF32, device);
  p->grad = Tensor::Zeros(shape, DType::kF32, device);
  p->init = init;
  p->init_std = init_std;
  p->decay = decay;
  return p;
}

namespace {
void InitRange(const Parameter& p, uint64_t key, float* v, int64_t i0, int64_t i1) {
  const double std = p.init_std;
  for (int64_t i = i0; i < i1; ++i) {
    switch (p.init) {
      case Init::kNormal:
        v[i] = static_cast<float>(std * rng::Normal(key, i));
        break;
      case Init::kZeros:
        v[i] = 0.0f;
        break;
      case Init::kOnes:
        v[i] = 1.0f;
        break;
    }
  }
}
}  // namespace

void Initialize(ops::Context& ctx, Parameter& p, uint64_t seed) {
  if (!p.value.defined()) return;  // unbound: its store generates the values when first used
  // On a GPU the values are drawn on the host and copied: the same values on every device.
  Tensor host = p.value.device().is_cpu() ? p.value : Tensor::Empty(p.value.shape());
  float* v = host.f32();
  const uint64_t key = rng::Key(seed, NameHash(p.name));
  ctx.pool->ParallelFor(p.value.numel(), 4096,
                        [&](int64_t i0, int64_t i1) { InitRange(p, key, v, i0, i1); });
  if (!p.value.device().is_cpu()) p.value.CopyFrom(host);
}

void InitialValues(const Parameter& p, uint64_t seed, float* dst) {
  InitRange(p, rng::Key(seed, NameHash(p.name)), dst, 0, p.shape.numel());
}

void Unbind(Parameter& p) {
  p.value = Tensor();
  p.grad = Tensor();
  p.compute = Tensor();
}

ParameterSlices::ParameterSlices(std::vector<Parameter*> params) : params_(std::move(params)) {
  offsets_.assign(1, 0);
  for (Parameter* p : params_) offsets_.push_back(offsets_.back() + p->value.numel());
}

int64_t CountScalars(const std::vector<Parameter*>& params) {
  int64_t n = 0;
  for (const Parameter* p : params) n += p->shape.numel();
  return n;
}

double GradSumSquares(ops::Context& ctx, const ParameterSlices& slices,
                      std::vector<double>* partials) {
  std::vector<double>& partial = *partials;
  partial.assign(ctx.pool->num_threads(), 0.0);
  slices.Run(ctx, [&](int tid, size_t i, int64_t begin, int64_t n) {
    partial[tid] += ops::SumSquares(ctx, slices.params()[i]->grad.View(begin, {n}));
  });
  double s = 0;
  for (double v : partial) s += v;
  return s;
}

}  // namespace strata::model
