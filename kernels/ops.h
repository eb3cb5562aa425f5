// strata's op interface: every op the model uses, on Tensors, chosen by the tensors' device.
//
// The layers in runtime/model call only these functions. Each checks shapes, dtypes and devices
// (a mismatch is a bug in the caller and CHECK-fails with the shapes printed) and dispatches to a
// backend: kernels/cpu (always built; the reference) or kernels/cuda (when built with CUDA). The
// CPU kernels are templates over float and double; the double versions exist so tests can compare
// gradients against finite differences without rounding noise.
//
// Conventions: activations are row-major [rows, channels]; parameter gradients are accumulated
// (+=); input gradients are overwritten unless the function says "accumulates".
//
// Ownership: an op borrows its tensors, host arrays and ctx for the call and keeps no pointer to
// them. On a GPU the work it enqueues runs after it returns, so device memory must stay allocated
// until the stream reaches it (freeing a Buffer's cudaMalloc memory waits for the device, so
// dropping the last Tensor is safe); host results (returned values, DispatchPlan, top1_counts,
// eligible) are complete when the op returns.
//
// Threads: a CPU op runs on ctx.pool, so the rules of ThreadPool apply: one thread at a time per
// pool, or any pool task, where the op runs inline on that thread alone (MoE layers run experts
// that way, one per pool thread, sharing one Context). On a GPU any thread may call an op: each
// thread has its own cuBLAS handle and scratch (kernels/cuda/cuda_ops.h), and the ops of every
// thread go onto the GPU's one compute stream, in the order they are called; the call makes that
// GPU current for the calling thread.
#pragma once

#include <cstdint>
#include <vector>

#include "core/common/thread_pool.h"
#include "core/device/device.h"
#include "kernels/vocabulary.h"

namespace strata {
class Tracer;
}  // namespace strata

namespace strata::ops {

// Where and with what an op runs. One per trainer. CPU ops run on `pool`; ops on CUDA tensors run
// on that GPU's compute stream (kernels/cuda/cuda_ops.h) and return without waiting for it, except
// those that return a host value (losses, sums, dispatch plans). The Context borrows `pool` and
// `tracer` (both may be shared by many ops at once; the tracer is thread-safe); ops only read it.
struct Context {
  ThreadPool* pool = nullptr;
  Tracer* tracer = nullptr;  // spans of compute for --trace; null when not tracing
  // Mixed precision (train.precision BF16): every GEMM of Linear* and GroupedLinear* multiplies
  // bfloat16 operands — its input, its weight and, in backward, the output gradient, rounded to
  // the nearest bfloat16 (kernels/bf16.h) — with fp32 accumulation into fp32 outputs and
  // gradients. Everything else (biases, norms, softmax, losses, reductions, the optimizer) stays
  // fp32, and so do GEMMs run with a Context where this is off (the MoE router's). A weight may
  // come as a bf16 tensor (its compute copy, made by RoundToBf16 once per update) or as fp32, then
  // rounded as it is used: the two give the same bits. Off by default (the fp32 reference); the
  // CPU emulates the rounding, so both backends compute the same products.
  bool bf16 = false;
};

enum class NormKind { kLayerNorm = 0, kRmsNorm = 1 };

// Whether ops can run on `device`: OK for the CPU; for a GPU, FAILED_PRECONDITION naming why not
// (strata built without CUDA, or the cuBLAS library the GPU kernels call cannot be loaded: it is
// opened on first use, this call included). Whether the GPU exists is CudaDeviceCount's question.
[[nodiscard]] Status CheckDeviceKernels(Device device);

// ---- Dense layers ----------------------------------------------------------------------------
// out [B*T, C] from tokens [B*T] (i32), wte [V, C], wpe [>=T, C].
void EmbeddingForward(Context& ctx, const Tensor& out, const Tensor& tokens, const Tensor& wte,
                      const Tensor& wpe, int64_t B, int64_t T);
void EmbeddingBackward(Context& ctx, const Tensor& dwte, const Tensor& dwpe, const Tensor& dout,
                       const Tensor& tokens, int64_t B, int64_t T);
// out [N, C] from tokens [N] and positions [N] (i32, each < wpe's rows): any rows at any
// positions (incremental decoding).
void EmbeddingForwardAt(Context& ctx, const Tensor& out, const Tensor& tokens,
                        const Tensor& positions, const Tensor& wte, const Tensor& wpe);

// out, inp [N, C]; weight [C]; bias [C] (undefined for RMSNorm or no bias); mean (LayerNorm only)
// and rstd [N] are saved for backward.
void NormForward(Context& ctx, NormKind kind, const Tensor& out, const Tensor& mean,
                 const Tensor& rstd, const Tensor& inp, const Tensor& weight, const Tensor& bias,
                 float eps);
// Accumulates into dinp.
void NormBackward(Context& ctx, NormKind kind, const Tensor& dinp, const Tensor& dweight,
                  const Tensor& dbias, const Tensor& dout, const Tensor& inp, const Tensor& weight,
                  const Tensor& mean, const Tensor& rstd);

// out [N, OC] = inp [N, IC] W^T + b, W [OC, IC], b [OC] or undefined. W may be bf16 (a compute
// copy) only with ctx.bf16 (see Context).
void LinearForward(Context& ctx, const Tensor& out, const Tensor& inp, const Tensor& weight,
                   const Tensor& bias);
// dinp may be undefined; accumulates into dinp when accumulate_dinp. With ctx.bf16 the GEMMs take
// dout rounded to bf16; dbias sums the fp32 dout.
void LinearBackward(Context& ctx, const Tensor& dinp, const Tensor& dweight, const Tensor& dbias,
                    const Tensor& dout, const Tensor& inp, const Tensor& weight,
                    bool accumulate_dinp);

// qkv [B*T, 3C] -> out [B*T, C]; att [B, NH, T, T] saved.
void AttentionForward(Context& ctx, const Tensor& out, const Tensor& att, const Tensor& qkv,
                      int64_t B, int64_t T, int64_t NH);
void AttentionBackward(Context& ctx, const Tensor& dqkv, const Tensor& dout, const Tensor& qkv,
                       const Tensor& att, int64_t B, int64_t T, int64_t NH);
// Incremental decoding: qkv [N, 3C] -> out [N, C] against k_cache and v_cache [S, Tmax, C]. Row i
// is the token of cache slot slots[i] at position positions[i] (i32 [N]); its key and value enter
// the cache there first, then it attends to positions [0, positions[i]] of its slot (which may
// include earlier rows of the same call). See kernels/cpu/attention.h. `scores` (optional, at
// least N * NH * Tmax floats; a training Forward's att buffer serves) holds the GPU's attention
// scores; without it they go to the thread's grow-only scratch (the CPU uses per-thread scratch
// of Tmax floats).
void AttentionDecode(Context& ctx, const Tensor& out, const Tensor& qkv, const Tensor& k_cache,
                     const Tensor& v_cache, const Tensor& slots, const Tensor& positions,
                     int64_t NH, const Tensor& scores = Tensor());

// out [N, H] from inp [N, ActivationInputWidth(act, H)]; backward may run in place.
void ActivationForward(Context& ctx, Activation act, const Tensor& out, const Tensor& inp);
// pre += bias (broadcast over rows), then out = act(pre), in one pass.
void BiasActivationForward(Context& ctx, Activation act, const Tensor& out, const Tensor& pre,
                           const Tensor& bias);
// When dbias is defined it also accumulates the column sums of dinp (a pre-activation bias's
// gradient) in the same pass.
void ActivationBackward(Context& ctx, Activation act, const Tensor& dinp, const Tensor& dout,
                        const Tensor& inp, const Tensor& dbias = Tensor());

// out = a + b (out may alias either); out += a.
void Add(Context& ctx, const Tensor& out, const Tensor& a, const Tensor& b);
void Accumulate(Context& ctx, const Tensor& out, const Tensor& a);

// Mean-reduced cross-entropy pieces: returns the sum of per-row losses; when dlogits is defined it
// gets (softmax - onehot) * grad_scale (may alias logits).
double CrossEntropy(Context& ctx, const Tensor& dlogits, const Tensor& logits,
                    const Tensor& targets, float grad_scale);

// out [N, C] += bias [C] on every row; dbias [C] += column sums of dout [N, C] (a bias's
// gradient). For layers that add a bias apart from their GEMM (the grouped experts).
void AddBias(Context& ctx, const Tensor& out, const Tensor& bias);
void BiasGrad(Context& ctx, const Tensor& dbias, const Tensor& dout);

// Grouped GEMM for the experts: G = weights.size() groups over row blocks; rows
// [offsets[g], offsets[g + 1]) of inp [R, IC] times weights[g]^T ([OC, IC]) into the same rows of
// out [R, OC]. offsets has G + 1 entries, offsets[0] = 0 and offsets[G] = R. One cuBLAS grouped
// GEMM on a GPU; one GEMM per non-empty group on the CPU. The weights are all fp32, or all bf16
// (compute copies, with ctx.bf16).
void GroupedLinearForward(Context& ctx, const Tensor& out, const Tensor& inp,
                          const std::vector<Tensor>& weights, const std::vector<int64_t>& offsets);
// dinp (may be undefined) = dout W per group, or += when accumulate_dinp; dweights[g] (entries may
// be undefined; no two the same tensor) += dout_g^T inp_g. dinp may be inp (in place). With
// ctx.bf16, dout is rounded too.
void GroupedLinearBackward(Context& ctx, const Tensor& dinp, const std::vector<Tensor>& dweights,
                           const Tensor& dout, const Tensor& inp,
                           const std::vector<Tensor>& weights, const std::vector<int64_t>& offsets,
                           bool accumulate_dinp);

// dst (bf16) = src (fp32) rounded to the nearest bfloat16, element by element (ties to even, as
// kernels/bf16.h): a weight's compute copy for ctx.bf16's GEMMs. Same shape, same device.
void RoundToBf16(Context& ctx, const Tensor& dst, const Tensor& src);
// The same for pairs dsts[i], srcs[i], all on one device: one kernel on a GPU, whatever the count
// (a model's compute copies, made once per update).
void RoundToBf16(Context& ctx, const std::vector<Tensor>& dsts, const std::vector<Tensor>& srcs);

// ---- Optimizer
// -----------------------------------------------------------------------------------
void AdamW(Context& ctx, const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
           const AdamWHyper& hyper);
double SumSquares(Context& ctx, const Tensor& x);
// AdamW on host memory the caller owns (param, grad, m, v: n floats each), sliced over `pool`:
// the update AdamW gives a CPU tensor, bit for bit. For callers that keep parameters outside
// Tensors (the tiered store's host slots).
void AdamWHost(ThreadPool& pool, float* param, const float* grad, float* m, float* v, int64_t n,
               const AdamWHyper& hyper);

// ---- Mixture of Experts (see kernels/cpu/moe.h for the data flow) -------------------------------
// scores, logits [T, E]; lse [T]; topk_expert (i32), topk_weight [T, k]; bias [E] or undefined.
// The router MoeRouterSpec describes (kernels/vocabulary.h).
void MoeRouterForward(Context& ctx, const Tensor& scores, const Tensor& lse,
                      const Tensor& topk_expert, const Tensor& topk_weight, const Tensor& logits,
                      const Tensor& bias, const MoeRouterSpec& spec);
// The softmax router with no bias: the k most probable experts.
void MoeRouterForward(Context& ctx, const Tensor& probs, const Tensor& lse,
                      const Tensor& topk_expert, const Tensor& topk_weight, const Tensor& logits,
                      bool renormalize);
// Fills top1_counts [E] and returns the load-balancing loss E * sum_e f_e P_e; P from each
// token's scores divided by their sum when `normalize` (sigmoid scores).
double MoeAuxLoss(Context& ctx, const Tensor& scores, const Tensor& topk_expert,
                  std::vector<int64_t>* top1_counts, bool normalize = false);
// The sequence-wise balancing loss over sequences of seq_len tokens; fills dq [sequences * E],
// its gradient w.r.t. the (normalised) scores of each sequence's tokens (kernels/cpu/moe.h). On a
// GPU the scores come to the host for it.
double MoeSequenceAuxLoss(Context& ctx, const Tensor& scores, const Tensor& topk_expert,
                          int64_t seq_len, bool normalize, std::vector<double>* dq);
double MoeZLoss(Context& ctx, const Tensor& lse);
// The router's backward (kernels/cpu/moe.h moe_router_backward): score_grad [R, E] f32, row
// t / grad_rows for token t, or undefined; logits are read for sigmoid scores only.
void MoeRouterBackward(Context& ctx, const Tensor& dlogits, const Tensor& dweight,
                       const Tensor& scores, const Tensor& logits, const Tensor& lse,
                       const Tensor& topk_expert, const Tensor& score_grad, int64_t grad_rows,
                       const MoeRouterSpec& spec, float z_coef);
// The softmax router's backward with the Switch/GShard loss of top1_counts.
void MoeRouterBackward(Context& ctx, const Tensor& dlogits, const Tensor& dweight,
                       const Tensor& probs, const Tensor& lse, const Tensor& topk_expert,
                       const std::vector<int64_t>& top1_counts, bool renormalize, float aux_coef,
                       float z_coef);

// The dispatch plan of one MoE call, on the host: rows per expert and where each choice went.
struct DispatchPlan {
  int64_t rows = 0;              // R: dispatched (token, choice) pairs
  int64_t dropped = 0;           // choices dropped for capacity
  int64_t capacity = 0;          // per expert; 0 = dropless
  std::vector<int64_t> counts;   // [E] rows per expert
  std::vector<int64_t> offsets;  // [E + 1] first row of each expert
};
// slot [T, k] and row_token [>= T*k] are i32 tensors; eligible may be null.
void MoePlanDispatch(Context& ctx, const Tensor& topk_expert, const uint8_t* eligible,
                     int64_t num_experts, int64_t capacity, const Tensor& slot,
                     const Tensor& row_token, DispatchPlan* plan);
// xp [R, C] from x [T, C].
void MoePermuteForward(Context& ctx, const Tensor& xp, const Tensor& x, const Tensor& row_token);
// dx [T, C] from dxp [R, C]; accumulates when `accumulate`.
void MoePermuteBackward(Context& ctx, const Tensor& dx, const Tensor& dxp, const Tensor& slot,
                        bool accumulate);
// y [T, C] from yp [R, C].
void MoeCombineForward(Context& ctx, const Tensor& y, const Tensor& yp, const Tensor& weight,
                       const Tensor& slot);
// dyp [R, C] (may alias yp) and dweight [T, k].
void MoeCombineBackward(Context& ctx, const Tensor& dyp, const Tensor& dweight, const Tensor& dy,
                        const Tensor& yp, const Tensor& weight, const Tensor& slot);
// The same for a block of rows (one expert's, run where its GEMMs then find them in cache):
// dyp [n, C] (may alias yp [n, C]) and the n entries of dweight [T, k] that row_slot [n] names
// (row_slot[r] = t * k + j, the inverse of slot). Nothing else is written.
void MoeCombineBackwardRows(Context& ctx, const Tensor& dyp, const Tensor& dweight,
                            const Tensor& dy, const Tensor& yp, const Tensor& weight,
                            const Tensor& row_slot);
// Random draws of the gates; first_token is the index of row 0 within the whole batch (see
// kernels/cpu/moe.h), so workers holding parts of a batch draw what one process would.
// GShard random routing: (*eligible)[t, 0] = 1, (*eligible)[t, 1] = 2 * w[t, 1] > U_t.
void MoeRandomRouting(Context& ctx, std::vector<uint8_t>* eligible, const Tensor& topk_weight,
                      uint64_t key, int64_t first_token = 0);
void MoeJitterForward(Context& ctx, const Tensor& xj, const Tensor& x, uint64_t key, double eps,
                      int64_t first_token = 0);
// Accumulates into dx (it already holds the experts' part of the input gradient).
void MoeJitterBackward(Context& ctx, const Tensor& dx, const Tensor& dxj, uint64_t key, double eps,
                       int64_t first_token = 0);
void MoeNoisyLogitsForward(Context& ctx, const Tensor& h, const Tensor& clean,
                           const Tensor& raw_noise, uint64_t key, int64_t first_token = 0);
void MoeNoisyLogitsBackward(Context& ctx, const Tensor& draw_noise, const Tensor& dh,
                            const Tensor& raw_noise, uint64_t key, int64_t first_token = 0);

}  // namespace strata::ops
