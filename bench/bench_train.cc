// bench_train: end-to-end training throughput of strata's trainer and its model FLOP utilization
// (MFU), against the device's own dense GEMM rate measured in the same run.
//
// For each --config (default: the default example, examples/moe_lm), one process trains
// --warmup + --steps steps with the Trainer, on --device (default: the config's train.device) in
// --precision (default: the config's train.precision; AUTO is bf16 GEMMs on a GPU), with
// checkpoints off and one held-out batch after the last step (not timed). The data is the
// config's file when it exists, else synthetic text (throughput does not depend on it). Printed
// per config:
//   tokens_per_s     global_batch * seq_len over the median time of the timed steps;
//   model TFLOP/s    tokens_per_s * FLOP per token, where (PaLM's count, its appendix B)
//                      FLOP per token = 6 * N + 12 * n_layers * seq_len * d_model,
//                    N the weights one token multiplies in forward (attention's projections, the
//                    router, its top_k routed experts, shared experts, dense FFNs, the output
//                    head; biases and norms; not the embedding lookups), 6 * N their forward and
//                    backward GEMMs, the second term attention's scores and weighted sums;
//   dense TFLOP/s    one square GEMM of --gemm-size (8192 on a GPU, 1024 on the CPU) of random
//                    operands, measured before the model is built, the median of 10 timed after
//                    3: on a GPU cublasGemmEx with bf16 A and B, fp32 C and
//                    CUBLAS_COMPUTE_32F (fp32 A and B, no TF32, when the run is fp32); on the CPU
//                    strata's fp32 GEMM (OpenBLAS, through ops::LinearForward, as the model's);
//   mfu              model TFLOP/s over dense TFLOP/s: the share of the device's GEMM rate that
//                    training turns into model FLOPs.
// Goals on one H100/H200: examples/gpu_moe at least 35% MFU in bf16; the default example at least
// 3x the 87k tokens/s it trained at in fp32 (an H200, 2026-11-27).
//
//   build/bin/bench_train [--config FILE]... [--device D] [--precision auto|fp32|bf16]
//                         [--steps N (10)] [--warmup N (3)] [--gemm-size S] [--json]
//
// Exit status 0; 1 when a config does not train or the dense rate cannot be measured (printed,
// with the tokens/s it trained at); 2 on bad arguments.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/bench_util.h"
#include "bench/blas_report.h"
#include "core/common/json.h"
#include "core/common/thread_pool.h"
#include "core/device/device.h"
#include "kernels/bf16.h"
#include "kernels/ops.h"
#include "proto/config_io.h"
#include "train/trainer.h"

#ifdef STRATA_WITH_CUDA
#include <cublas_v2.h>
#include <cuda_runtime.h>
#endif

namespace strata::bench {
namespace {

struct Options {
  std::vector<std::string> configs;
  std::string device;     // empty: each config's train.device
  std::string precision;  // empty: each config's train.precision
  int steps = 10;
  int warmup = 3;
  int64_t gemm_size = 0;  // 0: 8192 on a GPU, 1024 on the CPU
  bool json = false;
};

int Usage() {
  std::fprintf(stderr,
               "usage: bench_train [--config FILE]... [--device D] [--precision auto|fp32|bf16] "
               "[--steps N] [--warmup N] [--gemm-size S] [--json]\n");
  return 2;
}

// 2.43M, 2.29G.
std::string Count(double n) {
  return n >= 1e9 ? absl::StrFormat("%.2fG", n / 1e9) : absl::StrFormat("%.2fM", n / 1e6);
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

// FLOP of one token's forward and backward (see the top of this file).
double FlopPerToken(const model::MoeTransformer& m, const config::ModelConfig& cfg) {
  int64_t n = m.ActiveParametersPerToken();
  // The embedding lookups multiply nothing: the position table always, the token table when the
  // output head is its own matrix (tied, the token table is the head's GEMM weight).
  n -= static_cast<int64_t>(cfg.seq_len()) * cfg.d_model();
  if (!cfg.tie_embeddings()) n -= static_cast<int64_t>(cfg.vocab_size()) * cfg.d_model();
  return 6.0 * static_cast<double>(n) +
         12.0 * cfg.n_layers() * static_cast<double>(cfg.seq_len()) * cfg.d_model();
}

// Uniform values in [-1, 1) from a 64-bit LCG: the dense GEMM's operands (random, not zeros:
// a GPU under its power limit runs zeros at higher clocks than real data).
void FillUniform(float* v, int64_t n, uint64_t seed) {
  uint64_t x = seed * 6364136223846793005ull + 1442695040888963407ull;
  for (int64_t i = 0; i < n; ++i) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    v[i] = static_cast<float>(static_cast<double>(x >> 11) * 0x1p-52 - 1.0);
  }
}

#ifdef STRATA_WITH_CUDA
// A GPU's dense GEMM: its buffers and cuBLAS handle, released however the measurement ends.
class GpuGemm {
 public:
  ~GpuGemm() {
    if (handle_ != nullptr) cublasDestroy(handle_);
    for (void* p : {a_, b_, c_}) {
      if (p != nullptr) cudaFree(p);
    }
    for (cudaEvent_t e : {e0_, e1_}) {
      if (e != nullptr) cudaEventDestroy(e);
    }
    cudaGetLastError();  // a failure here must not surface in a later, unrelated kernel launch
  }

  StatusOr<double> Tflops(Device device, bool bf16, int64_t S) {
    const size_t elem = bf16 ? 2 : 4, n = static_cast<size_t>(S * S);
    RETURN_IF_ERROR(Cuda(cudaSetDevice(device.index), "cudaSetDevice"));
    RETURN_IF_ERROR(Cuda(cudaMalloc(&a_, n * elem), "cudaMalloc"));
    RETURN_IF_ERROR(Cuda(cudaMalloc(&b_, n * elem), "cudaMalloc"));
    RETURN_IF_ERROR(Cuda(cudaMalloc(&c_, n * 4), "cudaMalloc"));
    for (void* dst : {a_, b_}) {
      std::vector<float> f(n);
      FillUniform(f.data(), static_cast<int64_t>(n), dst == a_ ? 1 : 2);
      std::vector<uint16_t> h(bf16 ? n : 0);
      for (size_t i = 0; i < h.size(); ++i) h[i] = ops::Bf16Bits(f[i]);
      const void* src = bf16 ? static_cast<const void*>(h.data()) : f.data();
      RETURN_IF_ERROR(Cuda(cudaMemcpy(dst, src, n * elem, cudaMemcpyHostToDevice), "cudaMemcpy"));
    }
    if (cublasCreate(&handle_) != CUBLAS_STATUS_SUCCESS) {
      handle_ = nullptr;
      return absl::InternalError("dense GEMM: cublasCreate failed");
    }
    if (cublasSetMathMode(handle_, CUBLAS_DEFAULT_MATH) != CUBLAS_STATUS_SUCCESS) {  // no TF32
      return absl::InternalError("dense GEMM: cublasSetMathMode failed");
    }
    RETURN_IF_ERROR(Cuda(cudaEventCreate(&e0_), "cudaEventCreate"));
    RETURN_IF_ERROR(Cuda(cudaEventCreate(&e1_), "cudaEventCreate"));
    const float one = 1.f, zero = 0.f;
    const cudaDataType t = bf16 ? CUDA_R_16BF : CUDA_R_32F;
    const int s = static_cast<int>(S);
    auto gemm = [&]() -> Status {
      const cublasStatus_t st =
          cublasGemmEx(handle_, CUBLAS_OP_N, CUBLAS_OP_N, s, s, s, &one, a_, t, s, b_, t, s, &zero,
                       c_, CUDA_R_32F, s, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
      return st == CUBLAS_STATUS_SUCCESS
                 ? absl::OkStatus()
                 : absl::InternalError(absl::StrCat("dense GEMM: cublasGemmEx failed: ",
                                                    cublasGetStatusString(st)));
    };
    for (int i = 0; i < 3; ++i) RETURN_IF_ERROR(gemm());
    std::vector<double> ms;
    for (int i = 0; i < 10; ++i) {
      RETURN_IF_ERROR(Cuda(cudaEventRecord(e0_), "cudaEventRecord"));
      RETURN_IF_ERROR(gemm());
      RETURN_IF_ERROR(Cuda(cudaEventRecord(e1_), "cudaEventRecord"));
      RETURN_IF_ERROR(Cuda(cudaEventSynchronize(e1_), "cudaEventSynchronize"));
      float m = 0;
      RETURN_IF_ERROR(Cuda(cudaEventElapsedTime(&m, e0_, e1_), "cudaEventElapsedTime"));
      ms.push_back(m);
    }
    return 2.0 * static_cast<double>(S) * S * S / (Median(ms) * 1e-3) / 1e12;
  }

 private:
  static Status Cuda(cudaError_t err, const char* what) {
    if (err == cudaSuccess) return absl::OkStatus();
    cudaGetLastError();  // clear it: strata's own launch checks read the last error
    return absl::InternalError(
        absl::StrCat("dense GEMM: ", what, " failed: ", cudaGetErrorString(err)));
  }

  void *a_ = nullptr, *b_ = nullptr, *c_ = nullptr;
  cublasHandle_t handle_ = nullptr;
  cudaEvent_t e0_ = nullptr, e1_ = nullptr;
};
#endif

// The device's dense GEMM rate in TFLOP/s: S x S x S, median of 10 after 3.
StatusOr<double> DenseTflops(Device device, bool bf16, int64_t S, int threads) {
  if (device.is_cpu()) {
    ThreadPool pool(threads);
    ops::Context ctx{&pool, nullptr};
    Tensor a = Tensor::Empty({S, S}), w = Tensor::Empty({S, S}), out = Tensor::Empty({S, S});
    FillUniform(a.f32(), S * S, 1);
    FillUniform(w.f32(), S * S, 2);
    for (int i = 0; i < 3; ++i) ops::LinearForward(ctx, out, a, w, Tensor());
    const double ms = MedianMs(10, [&] { ops::LinearForward(ctx, out, a, w, Tensor()); });
    return 2.0 * static_cast<double>(S) * S * S / (ms * 1e-3) / 1e12;
  }
#ifdef STRATA_WITH_CUDA
  GpuGemm g;
  return g.Tflops(device, bf16, S);
#else
  (void)bf16;
  return absl::FailedPreconditionError("strata was built without CUDA");
#endif
}

struct Row {
  std::string name, device, precision, error, dense_error;
  int64_t tokens_per_step = 0;
  double step_s = 0, tokens_per_s = 0, flop_per_token = 0, model_tflops = 0, dense_tflops = 0;
  double parameters = 0, active = 0;
};

Row Measure(const std::string& path, const Options& o, const std::string& scratch) {
  Row row;
  auto loaded = config::LoadJobConfig(path);
  if (!loaded.ok()) {
    row.name = path;
    row.error = std::string(loaded.status().message());
    return row;
  }
  config::JobConfig cfg = *loaded;
  row.name = cfg.name().empty() ? path : cfg.name();
  if (!o.device.empty()) cfg.mutable_train()->set_device(o.device);
  if (!o.precision.empty()) {
    config::TrainConfig::Precision p = config::TrainConfig::AUTO;
    if (config::TrainConfig::Precision_Parse(absl::AsciiStrToUpper(o.precision), &p)) {
      cfg.mutable_train()->set_precision(p);
    }
  }
  cfg.clear_checkpoint();
  cfg.mutable_train()->set_steps(o.warmup + o.steps);
  cfg.mutable_train()->set_eval_every(0);
  cfg.mutable_train()->set_eval_batches(1);
  if (!std::filesystem::exists(cfg.data().path())) {
    const std::string text = scratch + "/text.txt";
    if (!std::filesystem::exists(text)) WriteSyntheticText(text, 4 << 20);
    cfg.mutable_data()->set_path(text);
    cfg.mutable_data()->set_format(config::DataConfig::BYTES);
  }
  auto device = Device::Parse(cfg.train().device());
  if (!device.ok()) {
    row.error = std::string(device.status().message());
    return row;
  }
  row.device = device->ToString();
  const bool bf16 = config::Bf16Gemms(cfg.train().precision(), !device->is_cpu());
  row.precision = bf16 ? "bf16" : "fp32";
  // The dense rate first, so its buffers are gone before the model takes the device's memory.
  const int64_t S = o.gemm_size > 0 ? o.gemm_size : device->is_cpu() ? 1024 : 8192;
  const int threads = cfg.train().threads() > 0
                          ? cfg.train().threads()
                          : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (auto dense = DenseTflops(*device, bf16, S, threads); dense.ok()) {
    row.dense_tflops = *dense;
  } else {
    row.dense_error = std::string(dense.status().message());
  }
  train::TrainOptions to;
  to.config = cfg;
  to.progress = false;
  auto trainer = train::Trainer::Create(to);
  Status s = trainer.ok() ? (*trainer)->Run() : trainer.status();
  if (!s.ok()) {
    row.error = std::string(s.message());
    return row;
  }
  train::Trainer& t = **trainer;
  std::vector<double> seconds;
  for (size_t i = static_cast<size_t>(o.warmup); i < t.history().size(); ++i) {
    seconds.push_back(t.history()[i].seconds);
  }
  row.tokens_per_step = static_cast<int64_t>(cfg.train().global_batch()) * cfg.model().seq_len();
  row.step_s = Median(seconds);
  row.tokens_per_s = row.step_s > 0 ? row.tokens_per_step / row.step_s : 0;
  row.flop_per_token = FlopPerToken(t.model(), cfg.model());
  row.model_tflops = row.tokens_per_s * row.flop_per_token / 1e12;
  row.parameters = static_cast<double>(model::CountScalars(t.model().Parameters()));
  row.active = static_cast<double>(t.model().ActiveParametersPerToken());
  return row;
}

int Main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has = i + 1 < argc;
    if (a == "--config" && has) {
      o.configs.push_back(argv[++i]);
    } else if (a == "--device" && has) {
      o.device = argv[++i];
      if (!Device::Parse(o.device).ok()) return Usage();
    } else if (a == "--precision" && has) {
      o.precision = absl::AsciiStrToLower(argv[++i]);
      if (o.precision != "auto" && o.precision != "fp32" && o.precision != "bf16") return Usage();
    } else if (a == "--steps" && has && absl::SimpleAtoi(argv[i + 1], &o.steps) && o.steps > 0) {
      ++i;
    } else if (a == "--warmup" && has && absl::SimpleAtoi(argv[i + 1], &o.warmup) &&
               o.warmup >= 0) {
      ++i;
    } else if (a == "--gemm-size" && has && absl::SimpleAtoi(argv[i + 1], &o.gemm_size) &&
               o.gemm_size > 0 && o.gemm_size <= 32768) {
      ++i;
    } else if (a == "--json") {
      o.json = true;
    } else {
      std::fprintf(stderr, "bench_train: bad argument '%s'\n", a.c_str());
      return Usage();
    }
  }
  if (o.configs.empty()) {
    // From $STRATA_SOURCE_DIR (a package's share/strata) or this source tree.
    const char* e = std::getenv("STRATA_SOURCE_DIR");
    o.configs.push_back(std::string(e != nullptr && *e != '\0' ? e : STRATA_SOURCE_DIR) +
                        "/examples/moe_lm/config.textproto");
  }
  const std::string scratch =
      (std::filesystem::temp_directory_path() / absl::StrCat("bench_train.", getpid())).string();
  std::filesystem::create_directories(scratch);
  if (!o.json) {
    std::printf("# bench_train: %d timed steps after %d warm-up steps per config\n", o.steps,
                o.warmup);
    std::printf("# blas: %s\n", blas::Current().describe.c_str());
    std::printf("%-12s %-7s %-5s %15s %9s %11s %9s %9s %9s %7s\n", "config", "device", "prec",
                "params/active", "step_ms", "tokens/s", "GFLOP/tok", "model_TF", "dense_TF", "mfu");
    std::fflush(stdout);
  }
  int rc = 0;
  for (const std::string& path : o.configs) {
    const Row r = Measure(path, o, scratch);
    if (!r.error.empty()) {
      std::fprintf(stderr, "bench_train: %s: %s\n", r.name.c_str(), r.error.c_str());
      rc = 1;
      continue;
    }
    // NaN (JSON null) when the dense rate could not be measured.
    const double mfu = r.dense_tflops > 0 ? r.model_tflops / r.dense_tflops : NAN;
    if (!r.dense_error.empty()) {
      std::fprintf(stderr, "bench_train: %s: no dense rate, so no MFU: %s\n", r.name.c_str(),
                   r.dense_error.c_str());
      rc = 1;
    }
    if (o.json) {
      JsonWriter j;
      j.BeginObject()
          .Field("config", r.name)
          .Field("device", r.device)
          .Field("precision", r.precision)
          .Field("parameters", r.parameters)
          .Field("active_parameters", r.active)
          .Field("tokens_per_step", r.tokens_per_step)
          .Field("step_s", r.step_s)
          .Field("tokens_per_s", r.tokens_per_s)
          .Field("flop_per_token", r.flop_per_token)
          .Field("model_tflops", r.model_tflops)
          .Field("dense_tflops", r.dense_tflops)
          .Field("mfu", mfu)
          .EndObject();
      std::printf("%s\n", j.str().c_str());
    } else {
      std::printf("%-12s %-7s %-5s %15s %9.2f %11.0f %9.4f %9.4f %9.4f %6.1f%%\n", r.name.c_str(),
                  r.device.c_str(), r.precision.c_str(),
                  (Count(r.parameters) + "/" + Count(r.active)).c_str(), r.step_s * 1e3,
                  r.tokens_per_s, r.flop_per_token / 1e9, r.model_tflops, r.dense_tflops,
                  100 * mfu);
    }
    std::fflush(stdout);
  }
  std::error_code ec;
  std::filesystem::remove_all(scratch, ec);
  return rc;
}

}  // namespace
}  // namespace strata::bench

int main(int argc, char** argv) {
  strata::bench::ChooseBlasKernelAtStart("bench_train", argv);
  return strata::bench::Main(argc, argv);
}
