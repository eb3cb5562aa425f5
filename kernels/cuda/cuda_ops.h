// The CUDA backend's kernels, on raw device pointers. kernels/ops.cc calls these when an op's
// tensors live on a CUDA device; each function mirrors the CPU kernel of the same name in
// kernels/cpu (same arguments, same conventions: gradients of parameters accumulate, input
// gradients are overwritten unless stated) so that kernels/cpu is the reference it is tested
// against.
//
// Every function enqueues its work on the Backend's stream and returns without waiting, except
// those that return a host value (a loss, a sum, a dispatch plan): they wait for that value.
// Results are deterministic run to run (no float atomics on any output), so two runs on the same
// GPU give the same bits.
//
// Ownership and threads: each function takes the calling thread's Backend (ThreadBackend), which
// no other thread may use; any number of threads may call at once, and their work is ordered on
// the one stream by when it was enqueued. Device pointers are borrowed until the stream has run the
// work (later than the return); arrays marked HOST, and host results, are read or written before
// the function returns.
//
// This header includes no CUDA header, so host-only translation units (kernels/ops.cc) can
// include it; kernels/cuda/backend.h has the Backend's definition for the .cu files.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/vocabulary.h"

namespace strata::cuda {

using ops::Activation;
using ops::AdamWHyper;

// Execution resources on one GPU: the GPU's compute stream (one per GPU, shared by every thread,
// so work is ordered by when threads enqueue it), a cuBLAS handle bound to it, and grow-only
// scratch (device and pinned host) for reductions and plans. One per thread per device.
struct Backend;

// Whether cuBLAS, which the kernels call, can be loaded (kernels/cuda/cublas.h opens it on first
// use); when not, `why` (if given) names the library, the loader's error and how to make it found.
bool CublasAvailable(std::string* why);

// The calling thread's Backend for GPU `device` (created on first use, lives until the thread
// ends; only that thread may use it). Also makes `device` the calling thread's current GPU, and
// leaves it so.
Backend& ThreadBackend(int device);
// Waits for everything enqueued on the backend's stream (by any thread: the stream is the GPU's);
// CHECK-fails with the CUDA error if a kernel failed.
void Synchronize(Backend& b);

// ---- Dense layers (see the kernels/cpu headers of the same names) ------------------------------
// positions (may be null: row r % T) gives each row's position.
void EmbeddingForward(Backend& b, float* out, const int32_t* tokens, const float* wte,
                      const float* wpe, int64_t B, int64_t T, int64_t C,
                      const int32_t* positions = nullptr);
// Accumulates into dwte and dwpe (deterministically: no atomics on floats).
void EmbeddingBackward(Backend& b, float* dwte, float* dwpe, const float* dout,
                       const int32_t* tokens, int64_t B, int64_t T, int64_t C, int64_t V);

void LayerNormForward(Backend& b, float* out, float* mean, float* rstd, const float* inp,
                      const float* weight, const float* bias, int64_t N, int64_t C, float eps);
// Accumulates into dinp, dweight, dbias (dbias may be null).
void LayerNormBackward(Backend& b, float* dinp, float* dweight, float* dbias, const float* dout,
                       const float* inp, const float* weight, const float* mean, const float* rstd,
                       int64_t N, int64_t C);
void RmsNormForward(Backend& b, float* out, float* rstd, const float* inp, const float* weight,
                    int64_t N, int64_t C, float eps);
void RmsNormBackward(Backend& b, float* dinp, float* dweight, const float* dout, const float* inp,
                     const float* weight, const float* rstd, int64_t N, int64_t C);

// How a GEMM multiplies (ops::Context::bf16): fp32 throughout (no TF32); or bfloat16 operands
// with fp32 accumulation into fp32 outputs, the weight fp32 and rounded as it is used (kBf16) or
// already bfloat16, a compute copy (kBf16Weights: weight pointers are __nv_bfloat16). Activations
// and output gradients are rounded into scratch as they are used; biases and their gradients
// stay fp32.
enum class GemmMode { kFp32, kBf16, kBf16Weights };

// out [N, OC] = inp [N, IC] W^T + bias (bias may be null), through cuBLAS. `weight` is fp32, or
// bf16 with kBf16Weights.
void LinearForward(Backend& b, float* out, const float* inp, const void* weight, const float* bias,
                   int64_t N, int64_t IC, int64_t OC, GemmMode mode);
// dweight += dout^T inp, dbias += column sums of dout (either may be null); dinp (may be null)
// = dout W, or += when accumulate_dinp.
void LinearBackward(Backend& b, float* dinp, float* dweight, float* dbias, const float* dout,
                    const float* inp, const void* weight, int64_t N, int64_t IC, int64_t OC,
                    bool accumulate_dinp, GemmMode mode);
// dst[i] = src[i] rounded to the nearest bfloat16 (dst: n __nv_bfloat16).
void RoundToBf16(Backend& b, void* dst, const float* src, int64_t n);
// The same for `count` arrays (dst, src, n: HOST arrays of device pointers and sizes) in one
// kernel.
void RoundToBf16Batch(Backend& b, void* const* dst, const float* const* src, const int64_t* n,
                      int64_t count);

// out [N, C] += bias [C] on every row; dbias [C] += column sums of dout [N, C].
void AddBias(Backend& b, float* out, const float* bias, int64_t N, int64_t C);
void BiasGrad(Backend& b, float* dbias, const float* dout, int64_t N, int64_t C);

// Causal multi-head attention; att [B, NH, T, T] saves the softmax probabilities for backward.
void AttentionForward(Backend& b, float* out, float* att, const float* qkv, int64_t B, int64_t T,
                      int64_t C, int64_t NH);
void AttentionBackward(Backend& b, float* dqkv, const float* dout, const float* qkv,
                       const float* att, int64_t B, int64_t T, int64_t C, int64_t NH);
// Incremental decoding against a KV cache [S, Tmax, C] (kernels/cpu/attention.h); slots and
// positions [N] are device arrays; scores (null: the backend's scratch) N * NH * Tmax floats.
void AttentionDecode(Backend& b, float* out, const float* qkv, float* k_cache, float* v_cache,
                     const int32_t* slots, const int32_t* positions, int64_t N, int64_t Tmax,
                     int64_t C, int64_t NH, float* scores = nullptr);

void ActivationForward(Backend& b, Activation act, float* out, const float* inp, int64_t N,
                       int64_t H);
void BiasActivationForward(Backend& b, Activation act, float* out, float* pre, const float* bias,
                           int64_t N, int64_t H);
// dinp may alias inp; dbias (may be null) accumulates the column sums of dinp.
void ActivationBackward(Backend& b, Activation act, float* dinp, const float* dout,
                        const float* inp, int64_t N, int64_t H, float* dbias);

void Add(Backend& b, float* out, const float* a, const float* bb, int64_t n);
void Accumulate(Backend& b, float* out, const float* a, int64_t n);

// Returns the sum of per-row losses (accumulated in double); dlogits (may be null, may alias
// logits) gets (softmax - onehot) * grad_scale.
double CrossEntropy(Backend& b, float* dlogits, const float* logits, const int32_t* targets,
                    int64_t N, int64_t V, float grad_scale);

void AdamW(Backend& b, float* param, const float* grad, float* m, float* v, int64_t n,
           const AdamWHyper& h);
// Sum of squares accumulated in double.
double SumSquares(Backend& b, const float* x, int64_t n);

// ---- Mixture of Experts (see kernels/cpu/moe.h) ------------------------------------------------
// The fused router: scores (softmax or sigmoid), logsumexp, the group choice and top-k in one
// pass over each token's logits (ops::MoeRouterSpec); bias [E] or null.
void MoeRouterForward(Backend& b, float* scores, float* lse, int32_t* topk_expert,
                      float* topk_weight, const float* logits, const float* bias, int64_t T,
                      int64_t E, const ops::MoeRouterSpec& spec);
// Fills top1_counts [E] (host) and returns the load-balancing loss.
double MoeAuxLoss(Backend& b, const float* probs, const int32_t* topk_expert, int64_t* top1_counts,
                  int64_t T, int64_t E, int k);
double MoeZLoss(Backend& b, const float* lse, int64_t T);
// score_grad [., E] (device; row t / grad_rows for token t) or null; logits are read for sigmoid
// scores only.
void MoeRouterBackward(Backend& b, float* dlogits, const float* dweight, const float* scores,
                       const float* logits, const float* lse, const int32_t* topk_expert,
                       const float* score_grad, int64_t grad_rows, int64_t T, int64_t E,
                       const ops::MoeRouterSpec& spec, float z_coef);
// The dispatch plan on the device, in the CPU's priority order (all first choices before any
// second choice, then by token), deterministic. eligible is a HOST array [T, k] or null. Writes
// slot [T, k] and row_token [R] on the device, counts [E] and offsets [E + 1] on the host, returns
// R and sets *dropped.
int64_t MoePlanDispatch(Backend& b, const int32_t* topk_expert, const uint8_t* eligible, int64_t T,
                        int k, int64_t E, int64_t capacity, int32_t* slot, int64_t* counts,
                        int64_t* offsets, int32_t* row_token, int64_t* dropped);
void MoePermuteForward(Backend& b, float* xp, const float* x, const int32_t* row_token, int64_t R,
                       int64_t C);
void MoePermuteBackward(Backend& b, float* dx, const float* dxp, const int32_t* slot, int64_t T,
                        int k, int64_t C, bool accumulate);
void MoeCombineForward(Backend& b, float* y, const float* yp, const float* weight,
                       const int32_t* slot, int64_t T, int k, int64_t C);
// dyp may alias yp.
void MoeCombineBackward(Backend& b, float* dyp, float* dweight, const float* dy, const float* yp,
                        const float* weight, const int32_t* slot, int64_t T, int k, int64_t C);
// For R rows: row_slot[r] = t * k + j names the choice row r holds; dyp may alias yp.
// (MoeRouterBackward takes k > kMaxRouterTopK slots only as expert choice has them: softmax, not
// renormalised, and a token's k slots naming distinct experts.)
void MoeCombineBackwardRows(Backend& b, float* dyp, float* dweight, const float* dy,
                            const float* yp, const float* weight, const int32_t* row_slot,
                            int64_t R, int k, int64_t C);
// eligible is a HOST array [T, 2]; topk_weight is on the device.
void MoeRandomRouting(Backend& b, uint8_t* eligible, const float* topk_weight, uint64_t key,
                      int64_t T, int64_t first_token);
void MoeJitterForward(Backend& b, float* xj, const float* x, uint64_t key, int64_t T, int64_t C,
                      double eps, int64_t first_token);
void MoeJitterBackward(Backend& b, float* dx, const float* dxj, uint64_t key, int64_t T, int64_t C,
                       double eps, int64_t first_token);
void MoeNoisyLogitsForward(Backend& b, float* h, const float* clean, const float* raw_noise,
                           uint64_t key, int64_t T, int64_t E, int64_t first_token);
void MoeNoisyLogitsBackward(Backend& b, float* draw_noise, const float* dh, const float* raw_noise,
                            uint64_t key, int64_t T, int64_t E, int64_t first_token);

// ---- Grouped GEMM for the experts --------------------------------------------------------------
// G groups over contiguous row blocks: rows [offsets[g], offsets[g+1]) of inp [R, IC] times
// weights[g]^T ([OC, IC] each, device pointers in a HOST array) into the same rows of out [R, OC].
// fp32: one cuBLAS grouped GEMM call for all groups. bf16 modes (GemmMode): bfloat16 operands
// with fp32 accumulation (fp32 master weights stay untouched); weights are __nv_bfloat16 with
// kBf16Weights.
void GroupedLinearForward(Backend& b, float* out, const float* inp, const void* const* weights,
                          const int64_t* offsets, int64_t G, int64_t IC, int64_t OC, GemmMode mode);
// dinp (may be null) = dout W per group (=, or += when accumulate_dinp); dweights[g] (device
// pointers in a HOST array, entries may be null) += dout_g^T inp_g.
void GroupedLinearBackward(Backend& b, float* dinp, float* const* dweights, const float* dout,
                           const float* inp, const void* const* weights, const int64_t* offsets,
                           int64_t G, int64_t IC, int64_t OC, bool accumulate_dinp, GemmMode mode);

}  // namespace strata::cuda
