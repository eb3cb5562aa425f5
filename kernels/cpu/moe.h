// Mixture-of-Experts kernels: router, dispatch plan, permutation and combine.
//
// One MoE layer's data flow (T tokens, E experts, k choices per token, C channels):
//   logits [T, E] = x W_gate^T                       (linear kernel)
//   moe_router_forward: probs, logsumexp, top-k experts and combine weights
//   moe_plan_dispatch:  capacity, counts per expert, slot of every (token, choice), row -> token
//   moe_permute_forward: xp[r] = x[row_token[r]] — per-expert contiguous rows
//   experts run on their blocks of xp              (Expert::Forward)
//   moe_combine_forward: y[t] = sum_j w[t, j] * yp[slot[t, j]]
// and backward in reverse. Every kernel is parallel over tokens or rows and each output element is
// written by exactly one thread, so results are bitwise deterministic without atomics.
//
// Priority under capacity (GShard/Tutel): all first choices before any second choice, and within
// a choice rank by token position. An (token, choice) beyond its expert's capacity is dropped: its
// slot is -1 and the token's output simply lacks that expert's term (the residual carries it).
//
// Threads: the kernels that take a pool run on it (one calling thread at a time; inline on the
// calling thread inside a pool task, see core/common/thread_pool.h); moe_aux_loss, moe_z_loss,
// moe_plan_dispatch and moe_random_routing are serial and may be called from any thread. All
// borrow their arrays for the call only.
#pragma once

#include <cstdint>

#include "core/common/thread_pool.h"
#include "kernels/vocabulary.h"

namespace strata::cpu {

// The most experts a token is routed to (the CUDA kernels keep the same bound).
inline constexpr int kMaxTopK = ops::kMaxRouterTopK;
using ops::MoeRouterSpec;

// The router (kernels/vocabulary.h MoeRouterSpec says what each option does):
// scores [T, E] = softmax(logits) or sigmoid(logits); lse [T] = logsumexp(logits) (the z-loss's,
// for either score function); topk_expert [T, k]: the chosen experts in descending order of
// selection value (scores plus `bias` [E], which may be null); topk_weight [T, k]: their combine
// weights. When every score is NaN the ids are the lowest unused ones, so they stay valid.
// scores must not alias logits (the sigmoid reads the logits after the softmax's exps are written).
template <typename T>
void moe_router_forward(ThreadPool& pool, T* scores, T* lse, int32_t* topk_expert, T* topk_weight,
                        const T* logits, const T* bias, int64_t Tn, int64_t E,
                        const MoeRouterSpec& spec);

// The softmax router without a bias: probs = softmax(logits), the k most probable experts and
// their probabilities, divided by the sum of the k when `renormalize`.
template <typename T>
void moe_router_forward(ThreadPool& pool, T* probs, T* lse, int32_t* topk_expert, T* topk_weight,
                        const T* logits, int64_t Tn, int64_t E, int k, bool renormalize);

// Writes top1_counts[e] = number of tokens whose first choice is e, and returns the Switch/GShard
// load-balancing loss E * sum_e (top1_counts[e] / T) * mean_t q[t, e], where q = scores, or, when
// `normalize` (sigmoid scores), each token's scores divided by their sum.
template <typename T>
double moe_aux_loss(const T* scores, const int32_t* topk_expert, int64_t* top1_counts, int64_t Tn,
                    int64_t E, int k, bool normalize = false);

// The sequence-wise load-balancing loss (DeepSeek-V3) over consecutive sequences of seq_len
// tokens (the last may be shorter): mean over sequences s of sum_e f_se * P_se, with f_se =
// E / (k * S_s) * (choices of the sequence's tokens that went to e) and P_se = mean over the
// sequence of q[t, e] (q as in moe_aux_loss). Writes dq [ceil(T / seq_len), E] = d(loss)/d q[t,
// e] for the tokens of each sequence (f constant).
template <typename T>
double moe_sequence_aux_loss(const T* scores, const int32_t* topk_expert, int64_t Tn, int64_t E,
                             int k, int64_t seq_len, bool normalize, double* dq);

// Router z-loss mean_t lse_t^2.
template <typename T>
double moe_z_loss(const T* lse, int64_t Tn);

// dlogits [T, E] (=): the gradient through moe_router_forward (same spec, the scores it wrote) of
// a loss whose gradient w.r.t. topk_weight is dweight [T, k], plus score_grad, the gradient of
// the balancing losses w.r.t. q (moe_aux_loss): row t / grad_rows of score_grad [., E] for token
// t (null: none), plus z_coef * d(z-loss)/d(logits). The bias and the group choice are constants.
template <typename T>
void moe_router_backward(ThreadPool& pool, T* dlogits, const T* dweight, const T* scores,
                         const T* logits, const T* lse, const int32_t* topk_expert,
                         const T* score_grad, int64_t grad_rows, int64_t Tn, int64_t E,
                         const MoeRouterSpec& spec, T z_coef);

// The softmax router's backward with the Switch/GShard loss: score_grad = aux_coef * E *
// top1_counts[e] / T^2 for every token.
template <typename T>
void moe_router_backward(ThreadPool& pool, T* dlogits, const T* dweight, const T* probs,
                         const T* lse, const int32_t* topk_expert, const int64_t* top1_counts,
                         int64_t Tn, int64_t E, int k, bool renormalize, T aux_coef, T z_coef);

// Capacity per expert (kernels/vocabulary.h).
using ops::MoeCapacity;

// Plans the dispatch (serial, O(T k + E)). `eligible` [T, k] may be null; a zero entry means the
// gate itself chose not to dispatch that choice (GShard random routing) — not counted as a drop.
// Writes slot [T, k] (row in the permuted buffer, or -1), counts [E], offsets [E + 1],
// row_token [R] (token of each permuted row) and returns R; *dropped gets the number of choices
// dropped for capacity. capacity 0 means unlimited.
// row_capacity: the rows row_token holds (-1: Tn * k); more dispatched rows are a CHECK failure.
int64_t moe_plan_dispatch(const int32_t* topk_expert, const uint8_t* eligible, int64_t Tn, int k,
                          int64_t E, int64_t capacity, int32_t* slot, int64_t* counts,
                          int64_t* offsets, int32_t* row_token, int64_t* dropped,
                          int64_t row_capacity = -1);

// xp [R, C]: xp[r] = x[row_token[r]].
template <typename T>
void moe_permute_forward(ThreadPool& pool, T* xp, const T* x, const int32_t* row_token, int64_t R,
                         int64_t C);

// dx [T, C] (=, or += when accumulate): sum over the token's dispatched choices of dxp[slot].
template <typename T>
void moe_permute_backward(ThreadPool& pool, T* dx, const T* dxp, const int32_t* slot, int64_t Tn,
                          int k, int64_t C, bool accumulate);

// y [T, C] (=): y[t] = sum_j weight[t, j] * yp[slot[t, j]] over dispatched choices.
template <typename T>
void moe_combine_forward(ThreadPool& pool, T* y, const T* yp, const T* weight, const int32_t* slot,
                         int64_t Tn, int k, int64_t C);

// dyp [R, C] (=): dyp[slot[t, j]] = weight[t, j] * dy[t];
// dweight [T, k] (=): <dy[t], yp[slot[t, j]]>, 0 for choices not dispatched.
template <typename T>
void moe_combine_backward(ThreadPool& pool, T* dyp, T* dweight, const T* dy, const T* yp,
                          const T* weight, const int32_t* slot, int64_t Tn, int k, int64_t C);
// The same for a block of R rows (one expert's), row by row: with s = row_slot[r] = t * k + j,
// dweight[s] = <dy[t], yp[r]> and dyp[r] = weight[s] * dy[t]. dyp may alias yp. Nothing else is
// written.
template <typename T>
void moe_combine_backward_rows(ThreadPool& pool, T* dyp, T* dweight, const T* dy, const T* yp,
                               const T* weight, const int32_t* row_slot, int64_t R, int k,
                               int64_t C);

// --- Gate-specific pieces
// ------------------------------------------------------------------------- Random numbers come
// from rng::Uniform/Normal(key, counter) with counter = (first_token + t) * width + i, so a
// reference can reproduce each draw, and a worker holding tokens [first_token, first_token + Tn) of
// a batch draws what one process holding the whole batch would.

// Switch jitter: xj = x * (1 - eps + 2 eps u), u ~ U[0, 1).
template <typename T>
void moe_jitter_forward(ThreadPool& pool, T* xj, const T* x, uint64_t key, int64_t Tn, int64_t C,
                        double eps, int64_t first_token = 0);
// dx += dxj * (1 - eps + 2 eps u).
template <typename T>
void moe_jitter_backward(ThreadPool& pool, T* dx, const T* dxj, uint64_t key, int64_t Tn, int64_t C,
                         double eps, int64_t first_token = 0);

// Noisy top-k: h = clean + n * softplus(raw_noise), n ~ N(0, 1). h may alias clean.
template <typename T>
void moe_noisy_logits_forward(ThreadPool& pool, T* h, const T* clean, const T* raw_noise,
                              uint64_t key, int64_t Tn, int64_t E, int64_t first_token = 0);
// draw_noise = dh * n * sigmoid(raw_noise) (the gradient w.r.t. clean is dh itself).
template <typename T>
void moe_noisy_logits_backward(ThreadPool& pool, T* draw_noise, const T* dh, const T* raw_noise,
                               uint64_t key, int64_t Tn, int64_t E, int64_t first_token = 0);

// GShard random routing: eligible[t, 0] = 1 and eligible[t, 1] = (2 * w[t, 1] > u_t) with
// u_t ~ U[0, 1), w the (normalised) combine weights. k must be 2.
template <typename T>
void moe_random_routing(uint8_t* eligible, const T* topk_weight, uint64_t key, int64_t Tn,
                        int64_t first_token = 0);

}  // namespace strata::cpu
