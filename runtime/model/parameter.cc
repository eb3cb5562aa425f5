#include "runtime/model/parameter.h"

#include "runtime/common/rng.h"

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
                                         bool decay) {
  auto p = std::make_unique<Parameter>();
  p->name = std::move(name);
  p->value = Tensor::Empty(shape);
  p->grad = Tensor::Zeros(shape);
  p->init = init;
  p->init_std = init_std;
  p->decay = decay;
  return p;
}

void Initialize(ops::Context& ctx, Parameter& p, uint64_t seed) {
  float* v = p.value.f32();
  const int64_t n = p.value.numel();
  const uint64_t key = rng::Key(seed, NameHash(p.name));
  const double std = p.init_std;
  const Init init = p.init;
  ctx.pool->ParallelFor(n, 4096, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      switch (init) {
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
  });
}

ParameterSlices::ParameterSlices(std::vector<Parameter*> params) : params_(std::move(params)) {
  offsets_.assign(1, 0);
  for (Parameter* p : params_) offsets_.push_back(offsets_.back() + p->value.numel());
}

int64_t CountScalars(const std::vector<Parameter*>& params) {
  int64_t n = 0;
  for (const Parameter* p : params) n += p->value.numel();
  return n;
}

}  // namespace strata::model
