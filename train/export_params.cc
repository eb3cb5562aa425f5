#include "train/export_params.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace strata::train {

Status ExportParameters(const std::string& dir, const ParameterExport& share,
                        model::MoeTransformer& model, scheduler::TieredExpertScheduler* tiered) {
  const std::string& expert_dir = share.expert_dir;
  for (const std::string& d : {dir, expert_dir}) {
    std::error_code ec;
    std::filesystem::create_directories(d, ec);
    if (ec) {
      return absl::PermissionDeniedError(
          absl::StrFormat("cannot create --export-params folder '%s': %s", d, ec.message()));
    }
  }
  auto write = [](const std::string& path, const float* data, size_t n) -> Status {
    std::FILE* f = std::fopen(path.c_str(), "wb");
    if (f == nullptr) {
      return absl::PermissionDeniedError(
          absl::StrFormat("cannot write '%s': %s", path, std::strerror(errno)));
    }
    const bool ok = std::fwrite(data, sizeof(float), n, f) == n;
    if (std::fclose(f) != 0 || !ok) {
      return absl::DataLossError(absl::StrFormat("writing '%s' failed", path));
    }
    return absl::OkStatus();
  };
  const std::vector<model::Parameter*>& dense = model.DenseParameters();
  const std::set<const model::Parameter*> is_dense(dense.begin(), dense.end());
  const bool rank0 = share.dense;
  for (const model::Parameter* p : model.Parameters()) {
    if (is_dense.count(p) && !rank0) continue;
    if (!p->value.defined()) continue;               // tiered experts live in the store: below
    const Tensor host = p->value.To(Device::Cpu());  // itself on the CPU
    RETURN_IF_ERROR(write(absl::StrCat(is_dense.count(p) ? dir : expert_dir, "/", p->name, ".f32"),
                          host.f32(), static_cast<size_t>(p->value.numel())));
  }
  if (tiered == nullptr) return absl::OkStatus();
  // The store's experts, one blob at a time, cut into their parameters by the blob's layout.
  std::vector<float> blob(tiered->expert_floats());
  for (int li = 0; li < tiered->moe_layers(); ++li) {
    model::MoeLayer& layer = *model.moe_layers()[static_cast<size_t>(li)].layer;
    for (int e = 0; e < tiered->num_experts(li); ++e) {
      RETURN_IF_ERROR(tiered->ReadExpert(li, e, storage::TensorKind::kWeights, blob.data()));
      const std::vector<model::Parameter*> params =
          layer.expert(tiered->first_expert() + e).Parameters();
      const auto& segments = tiered->layout().segments;
      for (size_t i = 0; i < params.size(); ++i) {
        RETURN_IF_ERROR(write(absl::StrCat(expert_dir, "/", params[i]->name, ".f32"),
                              blob.data() + segments[i].offset,
                              static_cast<size_t>(segments[i].shape.numel())));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace strata::train
