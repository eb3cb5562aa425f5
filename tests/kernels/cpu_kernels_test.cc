// Every CPU kernel's backward against central finite differences, in double precision, and the
// float kernels against the double ones (the float path uses vectorised exp/tanh).
//
// Each check builds a scalar loss L = sum_i r_i * out_i with fixed random r, runs the kernel's
// backward with dout = r, and compares every input gradient with (L(x + h) - L(x - h)) / 2h.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#include "core/common/rng.h"
#include "kernels/cpu/activation.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/elementwise.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/linear.h"
#include "kernels/cpu/loss.h"
#include "kernels/cpu/moe.h"
#include "kernels/cpu/norm.h"
#include "kernels/cpu/optimizer.h"

namespace strata::cpu {
namespace {

using Vec = std::vector<double>;

Vec Random(size_t n, uint64_t seed, double scale = 1.0, double offset = 0.0) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<double> d(0.0, 1.0);
  Vec v(n);
  for (auto& x : v) x = offset + scale * d(gen);
  return v;
}

double Dot(const Vec& a, const Vec& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// Compares `analytic` with central differences of `loss` over every element of `x`.
void ExpectGradient(const char* what, Vec& x, const Vec& analytic,
                    const std::function<double()>& loss, double h = 1e-5, double rtol = 1e-6) {
  ASSERT_EQ(x.size(), analytic.size()) << what;
  double worst = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double saved = x[i];
    x[i] = saved + h;
    const double lp = loss();
    x[i] = saved - h;
    const double lm = loss();
    x[i] = saved;
    const double numeric = (lp - lm) / (2 * h);
    const double err =
        std::abs(numeric - analytic[i]) / (1e-6 + std::abs(numeric) + std::abs(analytic[i]));
    worst = std::max(worst, err);
    EXPECT_LE(err, rtol) << what << "[" << i << "]: analytic " << analytic[i] << " numeric "
                         << numeric;
  }
  ::testing::Test::RecordProperty(std::string("max_rel_err_") + what, std::to_string(worst));
}

std::vector<float> ToFloat(const Vec& v) { return std::vector<float>(v.begin(), v.end()); }

void ExpectClose(const std::vector<float>& f, const Vec& d, double rtol, const char* what) {
  ASSERT_EQ(f.size(), d.size());
  for (size_t i = 0; i < f.size(); ++i) {
    EXPECT_NEAR(f[i], d[i], rtol * (1.0 + std::abs(d[i]))) << what << "[" << i << "]";
  }
}

class CpuKernelsTest : public ::testing::Test {
 protected:
  ThreadPool pool{3};  // three threads: uneven slices and a caller that also works
};

TEST_F(CpuKernelsTest, GemmMatchesReferenceLoopForAllTransposesAndSplits) {
  // Large enough that Gemm splits the output over the pool (rows for tall, columns for wide).
  for (auto [M, N, K] : {std::tuple{97, 65, 70}, std::tuple{40, 300, 33}, std::tuple{5, 3, 0}}) {
    for (int ta = 0; ta < 2; ++ta) {
      for (int tb = 0; tb < 2; ++tb) {
        Vec A = Random(static_cast<size_t>(M) * std::max(K, 1), 1);
        Vec B = Random(static_cast<size_t>(std::max(K, 1)) * N, 2);
        Vec C = Random(static_cast<size_t>(M) * N, 3);
        Vec ref = C;
        const int lda = ta ? M : K, ldb = tb ? K : N;
        for (int i = 0; i < M; ++i) {
          for (int j = 0; j < N; ++j) {
            double s = 0;
            for (int p = 0; p < K; ++p) {
              double a = ta ? A[p * lda + i] : A[i * lda + p];
              double b = tb ? B[j * ldb + p] : B[p * ldb + j];
              s += a * b;
            }
            ref[i * N + j] = 0.5 * s + 0.25 * ref[i * N + j];
          }
        }
        Gemm<double>(pool, ta, tb, M, N, K, 0.5, A.data(), std::max(lda, 1), B.data(),
                     std::max(ldb, 1), 0.25, C.data(), N);
        for (size_t i = 0; i < C.size(); ++i) {
          ASSERT_NEAR(C[i], ref[i], 1e-10)
              << M << "x" << N << "x" << K << " ta=" << ta << " tb=" << tb << " at " << i;
        }
      }
    }
  }
}

TEST_F(CpuKernelsTest, LinearBackward) {
  const int N = 5, IC = 7, OC = 4;
  Vec x = Random(N * IC, 1), w = Random(OC * IC, 2), b = Random(OC, 3), r = Random(N * OC, 4);
  auto loss = [&] {
    Vec out(N * OC);
    linear_forward<double>(pool, out.data(), x.data(), w.data(), b.data(), N, IC, OC);
    return Dot(out, r);
  };
  Vec dx(N * IC), dw(OC * IC, 0.0), db(OC, 0.0);
  linear_backward<double>(pool, dx.data(), dw.data(), db.data(), r.data(), x.data(), w.data(), N,
                          IC, OC, false);
  ExpectGradient("x", x, dx, loss);
  ExpectGradient("w", w, dw, loss);
  ExpectGradient("b", b, db, loss);
  // Parameter gradients accumulate; dinp accumulates on request.
  Vec dx2 = dx, dw2 = dw;
  linear_backward<double>(pool, dx2.data(), dw2.data(), nullptr, r.data(), x.data(), w.data(), N,
                          IC, OC, true);
  for (size_t i = 0; i < dx.size(); ++i) EXPECT_NEAR(dx2[i], 2 * dx[i], 1e-12);
  for (size_t i = 0; i < dw.size(); ++i) EXPECT_NEAR(dw2[i], 2 * dw[i], 1e-12);
}

TEST_F(CpuKernelsTest, LayerNormBackward) {
  const int N = 4, C = 9;
  Vec x = Random(N * C, 1, 2.0, 0.5), w = Random(C, 2, 0.5, 1.0), b = Random(C, 3),
      r = Random(N * C, 4);
  auto loss = [&] {
    Vec out(N * C), mean(N), rstd(N);
    layernorm_forward<double>(pool, out.data(), mean.data(), rstd.data(), x.data(), w.data(),
                              b.data(), N, C, 1e-5);
    return Dot(out, r);
  };
  Vec out(N * C), mean(N), rstd(N);
  layernorm_forward<double>(pool, out.data(), mean.data(), rstd.data(), x.data(), w.data(),
                            b.data(), N, C, 1e-5);
  // Forward against the textbook formula.
  for (int n = 0; n < N; ++n) {
    double m = 0, v = 0;
    for (int c = 0; c < C; ++c) m += x[n * C + c] / C;
    for (int c = 0; c < C; ++c) v += (x[n * C + c] - m) * (x[n * C + c] - m) / C;
    for (int c = 0; c < C; ++c) {
      EXPECT_NEAR(out[n * C + c], (x[n * C + c] - m) / std::sqrt(v + 1e-5) * w[c] + b[c], 1e-12);
    }
  }
  Vec base = Random(N * C, 9);  // dinp accumulates onto what is there
  Vec dx = base, dw(C, 0.0), db(C, 0.0);
  layernorm_backward<double>(pool, dx.data(), dw.data(), db.data(), r.data(), x.data(), w.data(),
                             mean.data(), rstd.data(), N, C);
  for (size_t i = 0; i < dx.size(); ++i) dx[i] -= base[i];
  ExpectGradient("x", x, dx, loss);
  ExpectGradient("w", w, dw, loss);
  ExpectGradient("b", b, db, loss);
}

TEST_F(CpuKernelsTest, RmsNormBackward) {
  const int N = 4, C = 8;
  Vec x = Random(N * C, 1, 1.5, 0.3), w = Random(C, 2, 0.5, 1.0), r = Random(N * C, 4);
  auto loss = [&] {
    Vec out(N * C), rstd(N);
    rmsnorm_forward<double>(pool, out.data(), rstd.data(), x.data(), w.data(), N, C, 1e-6);
    return Dot(out, r);
  };
  Vec out(N * C), rstd(N);
  rmsnorm_forward<double>(pool, out.data(), rstd.data(), x.data(), w.data(), N, C, 1e-6);
  for (int n = 0; n < N; ++n) {
    double ms = 0;
    for (int c = 0; c < C; ++c) ms += x[n * C + c] * x[n * C + c] / C;
    for (int c = 0; c < C; ++c) {
      EXPECT_NEAR(out[n * C + c], x[n * C + c] / std::sqrt(ms + 1e-6) * w[c], 1e-12);
    }
  }
  Vec dx(N * C, 0.0), dw(C, 0.0);
  rmsnorm_backward<double>(pool, dx.data(), dw.data(), r.data(), x.data(), w.data(), rstd.data(), N,
                           C);
  ExpectGradient("x", x, dx, loss);
  ExpectGradient("w", w, dw, loss);
}

// Causal attention written out per head, query and key: the reference for the GEMM version.
Vec ReferenceAttention(const Vec& qkv, int B, int T, int C, int NH) {
  const int hs = C / NH;
  Vec out(B * T * C, 0.0);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < NH; ++h)
      for (int i = 0; i < T; ++i) {
        std::vector<double> s(i + 1);
        double mx = -1e300;
        for (int j = 0; j <= i; ++j) {
          double d = 0;
          for (int c = 0; c < hs; ++c) {
            d += qkv[(b * T + i) * 3 * C + h * hs + c] * qkv[(b * T + j) * 3 * C + C + h * hs + c];
          }
          s[j] = d / std::sqrt(static_cast<double>(hs));
          mx = std::max(mx, s[j]);
        }
        double z = 0;
        for (int j = 0; j <= i; ++j) z += std::exp(s[j] - mx);
        for (int j = 0; j <= i; ++j) {
          double p = std::exp(s[j] - mx) / z;
          for (int c = 0; c < hs; ++c) {
            out[(b * T + i) * C + h * hs + c] += p * qkv[(b * T + j) * 3 * C + 2 * C + h * hs + c];
          }
        }
      }
  return out;
}

TEST_F(CpuKernelsTest, AttentionForwardAndBackward) {
  const int B = 2, T = 5, C = 8, NH = 2;
  Vec qkv = Random(B * T * 3 * C, 1), r = Random(B * T * C, 2);
  Vec out(B * T * C), att(B * NH * T * T);
  attention_forward<double>(pool, out.data(), att.data(), qkv.data(), B, T, C, NH);
  Vec ref = ReferenceAttention(qkv, B, T, C, NH);
  for (size_t i = 0; i < out.size(); ++i) EXPECT_NEAR(out[i], ref[i], 1e-12);
  auto loss = [&] {
    Vec o(B * T * C), a(B * NH * T * T);
    attention_forward<double>(pool, o.data(), a.data(), qkv.data(), B, T, C, NH);
    return Dot(o, r);
  };
  Vec dqkv(B * T * 3 * C);
  attention_backward<double>(pool, dqkv.data(), r.data(), qkv.data(), att.data(), B, T, C, NH);
  ExpectGradient("qkv", qkv, dqkv, loss);

  // The float path (vectorised exp) agrees with double.
  std::vector<float> qf = ToFloat(qkv), of(B * T * C), af(B * NH * T * T);
  attention_forward<float>(pool, of.data(), af.data(), qf.data(), B, T, C, NH);
  ExpectClose(of, out, 1e-5, "float attention");
}

// Decoding through a KV cache, in double: every row of two sequences, fed in three calls (a
// prefill of both that interleaves their rows, then one row at a time), gets the output of the
// causal forward over the whole sequences at its position; the cache holds each row's key and
// value. Slot 1's cache is filled with NaN first: nothing past a row's position may be read.
TEST_F(CpuKernelsTest, AttentionDecodeEqualsTheCausalForwardRowByRow) {
  const int B = 2, T = 7, C = 8, NH = 2, Tmax = 9;
  Vec qkv = Random(B * T * 3 * C, 3);
  Vec out(B * T * C), att(B * NH * T * T);
  attention_forward<double>(pool, out.data(), att.data(), qkv.data(), B, T, C, NH);
  Vec kc(B * Tmax * C, std::nan("")), vc(B * Tmax * C, std::nan(""));
  // (slot, position) of the rows of each call.
  const std::vector<std::vector<std::pair<int, int>>> calls = {
      {{1, 0}, {0, 0}, {0, 1}, {1, 1}, {0, 2}, {1, 2}, {0, 3}},
      {{0, 4}, {1, 3}},
      {{1, 4}, {0, 5}, {1, 5}, {1, 6}, {0, 6}}};
  for (const auto& rows : calls) {
    const int64_t N = static_cast<int64_t>(rows.size());
    Vec q(N * 3 * C), o(N * C);
    std::vector<int32_t> slots, positions;
    for (int64_t i = 0; i < N; ++i) {
      const auto [b, t] = rows[i];
      std::copy_n(qkv.begin() + (b * T + t) * 3 * C, 3 * C, q.begin() + i * 3 * C);
      slots.push_back(b);
      positions.push_back(t);
    }
    attention_decode<double>(pool, o.data(), q.data(), kc.data(), vc.data(), slots.data(),
                             positions.data(), N, Tmax, C, NH);
    for (int64_t i = 0; i < N; ++i) {
      const auto [b, t] = rows[i];
      for (int c = 0; c < C; ++c) {
        EXPECT_NEAR(o[i * C + c], out[(b * T + t) * C + c], 1e-12)
            << "slot " << b << " position " << t << " channel " << c;
        EXPECT_EQ(kc[(b * Tmax + t) * C + c], qkv[(b * T + t) * 3 * C + C + c]);
        EXPECT_EQ(vc[(b * Tmax + t) * C + c], qkv[(b * T + t) * 3 * C + 2 * C + c]);
      }
    }
  }
  // Positions past T were never written.
  for (int b = 0; b < B; ++b) EXPECT_TRUE(std::isnan(kc[(b * Tmax + T) * C]));
}

TEST_F(CpuKernelsTest, ActivationsBackward) {
  const int N = 3, H = 5;
  for (Activation act : {Activation::kGelu, Activation::kRelu, Activation::kSwiglu}) {
    const int W = ActivationInputWidth(act, H);
    Vec x = Random(N * W, 11, 1.5);
    if (act == Activation::kRelu) {
      for (auto& v : x) v += v > 0 ? 0.1 : -0.1;  // keep away from the kink
    }
    Vec r = Random(N * H, 12);
    auto loss = [&] {
      Vec out(N * H);
      activation_forward<double>(pool, act, out.data(), x.data(), N, H);
      return Dot(out, r);
    };
    Vec dx(N * W);
    activation_backward<double>(pool, act, dx.data(), r.data(), x.data(), N, H);
    ExpectGradient(act == Activation::kGelu   ? "gelu"
                   : act == Activation::kRelu ? "relu"
                                              : "swiglu",
                   x, dx, loss);
    // In place (dinp aliasing inp) gives the same gradient.
    Vec inplace = x;
    activation_backward<double>(pool, act, inplace.data(), r.data(), inplace.data(), N, H);
    for (int i = 0; i < N * W; ++i) EXPECT_DOUBLE_EQ(inplace[i], dx[i]);
    // Forward against the formula, and float against double.
    Vec out(N * H);
    activation_forward<double>(pool, act, out.data(), x.data(), N, H);
    for (int n = 0; n < N; ++n)
      for (int h = 0; h < H; ++h) {
        double expect;
        if (act == Activation::kGelu) {
          double v = x[n * H + h];
          expect = 0.5 * v * (1 + std::tanh(std::sqrt(2 / M_PI) * (v + 0.044715 * v * v * v)));
        } else if (act == Activation::kRelu) {
          expect = std::max(0.0, x[n * H + h]);
        } else {
          double g = x[n * W + h], u = x[n * W + H + h];
          expect = g / (1 + std::exp(-g)) * u;
        }
        EXPECT_NEAR(out[n * H + h], expect, 1e-12);
      }
    // Fused bias + activation, and the bias gradient summed in the backward pass.
    Vec bias = Random(W, 13);
    auto bias_loss = [&] {
      Vec pre = x, o(N * H);
      bias_activation_forward<double>(pool, act, o.data(), pre.data(), bias.data(), N, H);
      return Dot(o, r);
    };
    Vec pre = x, o(N * H), dpre(N * W), dbias(W, 0.0);
    bias_activation_forward<double>(pool, act, o.data(), pre.data(), bias.data(), N, H);
    for (int n = 0; n < N; ++n)
      for (int w = 0; w < W; ++w) EXPECT_DOUBLE_EQ(pre[n * W + w], x[n * W + w] + bias[w]);
    activation_backward<double>(pool, act, dpre.data(), r.data(), pre.data(), N, H, dbias.data());
    ExpectGradient("bias", bias, dbias, bias_loss);

    std::vector<float> xf = ToFloat(x), of(N * H), df(N * W), rf = ToFloat(r);
    activation_forward<float>(pool, act, of.data(), xf.data(), N, H);
    ExpectClose(of, out, 2e-6, "float activation");
    activation_backward<float>(pool, act, df.data(), rf.data(), xf.data(), N, H);
    ExpectClose(df, dx, 2e-6, "float activation backward");
  }
}

TEST_F(CpuKernelsTest, SoftmaxCrossEntropy) {
  const int N = 4, V = 6;
  Vec logits = Random(N * V, 1, 2.0);
  std::vector<int32_t> tgt = {0, 5, 2, 2};
  Vec dl(N * V), losses(N);
  const double sum = softmax_cross_entropy<double>(pool, dl.data(), losses.data(), logits.data(),
                                                   tgt.data(), N, V, 1.0);
  double ref = 0;
  for (int n = 0; n < N; ++n) {
    double z = 0;
    for (int v = 0; v < V; ++v) z += std::exp(logits[n * V + v]);
    const double l = std::log(z) - logits[n * V + tgt[n]];
    EXPECT_NEAR(losses[n], l, 1e-12);
    ref += l;
  }
  EXPECT_NEAR(sum, ref, 1e-12);
  auto loss = [&] {
    return softmax_cross_entropy<double>(pool, nullptr, nullptr, logits.data(), tgt.data(), N, V,
                                         1.0);
  };
  ExpectGradient("logits", logits, dl, loss);
  std::vector<float> lf = ToFloat(logits), df(N * V);
  const double fsum =
      softmax_cross_entropy<float>(pool, df.data(), nullptr, lf.data(), tgt.data(), N, V, 1.0f);
  EXPECT_NEAR(fsum, sum, 1e-5);
  ExpectClose(df, dl, 1e-6, "float dlogits");
}

TEST_F(CpuKernelsTest, EmbeddingBackwardWithRepeatedTokens) {
  const int B = 2, T = 3, C = 4, V = 5;
  std::vector<int32_t> tokens = {1, 3, 1, 4, 1, 0};
  Vec wte = Random(V * C, 1), wpe = Random(T * C, 2), r = Random(B * T * C, 3);
  auto loss = [&] {
    Vec out(B * T * C);
    embedding_forward<double>(pool, out.data(), tokens.data(), wte.data(), wpe.data(), B, T, C);
    return Dot(out, r);
  };
  Vec dwte(V * C, 0.0), dwpe(T * C, 0.0);
  embedding_backward<double>(pool, dwte.data(), dwpe.data(), r.data(), tokens.data(), B, T, C);
  ExpectGradient("wte", wte, dwte, loss);
  ExpectGradient("wpe", wpe, dwpe, loss);
}

// The router's gradient, through the top-k weights and both auxiliary losses.
TEST_F(CpuKernelsTest, MoeRouterBackward) {
  const int T = 7, E = 5;
  for (int k : {1, 2, 4}) {
    for (bool renorm : {false, true}) {
      Vec logits = Random(T * E, 100 + k, 1.5), dweight = Random(T * k, 200 + k);
      const double aux_coef = 0.3, z_coef = 0.07;
      std::vector<int64_t> counts(E);
      auto forward = [&](Vec& probs, Vec& lse, std::vector<int32_t>& idx, Vec& w) {
        probs.resize(T * E);
        lse.resize(T);
        idx.resize(T * k);
        w.resize(T * k);
        moe_router_forward<double>(pool, probs.data(), lse.data(), idx.data(), w.data(),
                                   logits.data(), T, E, k, renorm);
      };
      Vec probs, lse, w;
      std::vector<int32_t> idx;
      forward(probs, lse, idx, w);
      moe_aux_loss<double>(probs.data(), idx.data(), counts.data(), T, E, k);
      const std::vector<int32_t> idx0 = idx;
      auto loss = [&] {
        Vec p, l, ww;
        std::vector<int32_t> ii;
        forward(p, l, ii, ww);
        EXPECT_EQ(ii, idx0) << "a perturbation changed the routing; the check is invalid";
        std::vector<int64_t> c(E);
        return Dot(ww, dweight) +
               aux_coef * moe_aux_loss<double>(p.data(), ii.data(), c.data(), T, E, k) +
               z_coef * moe_z_loss<double>(l.data(), T);
      };
      Vec dlogits(T * E);
      moe_router_backward<double>(pool, dlogits.data(), dweight.data(), probs.data(), lse.data(),
                                  idx.data(), counts.data(), T, E, k, renorm, aux_coef, z_coef);
      ExpectGradient("router logits", logits, dlogits, loss);
      // Top-k is in descending probability order, and the weights sum to 1 when renormalised.
      for (int t = 0; t < T; ++t) {
        double s = 0;
        for (int j = 0; j < k; ++j) {
          if (j) {
            EXPECT_GE(probs[t * E + idx[t * k + j - 1]], probs[t * E + idx[t * k + j]]);
          }
          s += w[t * k + j];
        }
        if (renorm && k > 1) {
          EXPECT_NEAR(s, 1.0, 1e-12);
        }
      }
    }
  }
}

TEST_F(CpuKernelsTest, MoeAuxAndZLossHandComputed) {
  // Token 0: probs [0.25, 0.75]; token 1: probs [0.2, 0.8]. Both first choices are expert 1, so
  // f = [0, 1], P = [0.225, 0.775] and aux = E * sum f*P = 2 * 0.775 = 1.55.
  // lse = [ln 4, ln 5], z = (ln^2 4 + ln^2 5) / 2 = 2.2560512248...
  Vec logits = {0.0, std::log(3.0), 0.0, std::log(4.0)};
  Vec probs(4), lse(2), w(2);
  std::vector<int32_t> idx(2);
  std::vector<int64_t> counts(2);
  moe_router_forward<double>(pool, probs.data(), lse.data(), idx.data(), w.data(), logits.data(), 2,
                             2, 1, false);
  EXPECT_NEAR(probs[0], 0.25, 1e-15);
  EXPECT_NEAR(probs[3], 0.8, 1e-15);
  EXPECT_EQ(idx[0], 1);
  EXPECT_EQ(idx[1], 1);
  EXPECT_NEAR(w[1], 0.8, 1e-15);
  EXPECT_NEAR(moe_aux_loss<double>(probs.data(), idx.data(), counts.data(), 2, 2, 1), 1.55, 1e-12);
  EXPECT_EQ(counts[0], 0);
  EXPECT_EQ(counts[1], 2);
  EXPECT_NEAR(moe_z_loss<double>(lse.data(), 2), 2.2560512248, 1e-9);
}

TEST_F(CpuKernelsTest, MoeDispatchPlanCapacityAndPriority) {
  // 4 tokens, k = 2, 3 experts, capacity 2. Choices (token: first, second):
  // t0: 0,1  t1: 0,2  t2: 0,1  t3: 1,0.
  // First choices in token order: e0 <- t0, t1 (full), t2 dropped; e1 <- t3.
  // Second choices: e1 <- t0 (e1 now full), e2 <- t1, e1 <- t2 dropped, e0 <- t3 dropped (full).
  std::vector<int32_t> experts = {0, 1, 0, 2, 0, 1, 1, 0};
  std::vector<int32_t> slot(8), row_token(8);
  std::vector<int64_t> counts(3), offsets(4);
  int64_t dropped = -1;
  const int64_t R = moe_plan_dispatch(experts.data(), nullptr, 4, 2, 3, 2, slot.data(),
                                      counts.data(), offsets.data(), row_token.data(), &dropped);
  EXPECT_EQ(R, 5);
  EXPECT_EQ(dropped, 3);
  EXPECT_EQ(counts, (std::vector<int64_t>{2, 2, 1}));
  EXPECT_EQ(offsets, (std::vector<int64_t>{0, 2, 4, 5}));
  EXPECT_EQ(slot, (std::vector<int32_t>{0, 3, 1, 4, -1, -1, 2, -1}));
  EXPECT_EQ(std::vector<int32_t>(row_token.begin(), row_token.begin() + R),
            (std::vector<int32_t>{0, 1, 3, 0, 1}));
  // Dropless, with the gate declining token 1's second choice (random routing): not a drop.
  std::vector<uint8_t> eligible = {1, 1, 1, 0, 1, 1, 1, 1};
  const int64_t R2 = moe_plan_dispatch(experts.data(), eligible.data(), 4, 2, 3, 0, slot.data(),
                                       counts.data(), offsets.data(), row_token.data(), &dropped);
  EXPECT_EQ(R2, 7);
  EXPECT_EQ(dropped, 0);
  EXPECT_EQ(slot[3], -1);
  EXPECT_EQ(counts, (std::vector<int64_t>{4, 3, 0}));
  EXPECT_EQ(MoeCapacity(1.25, 10, 2, 4), 7);  // ceil(1.25 * 10 * 2 / 4) = ceil(6.25)
  EXPECT_EQ(MoeCapacity(0.0, 10, 2, 4), 0);
  EXPECT_EQ(MoeCapacity(0.01, 10, 1, 4), 1);
}

TEST_F(CpuKernelsTest, MoePermuteAndCombineBackward) {
  const int T = 6, k = 2, C = 3, E = 3;
  std::vector<int32_t> experts = {0, 2, 1, 0, 2, 1, 0, 1, 1, 2, 0, 2};
  std::vector<int32_t> slot(T * k), row_token(T * k);
  std::vector<int64_t> counts(E), offsets(E + 1);
  int64_t dropped;
  const int64_t R = moe_plan_dispatch(experts.data(), nullptr, T, k, E, 3, slot.data(),
                                      counts.data(), offsets.data(), row_token.data(), &dropped);
  ASSERT_GT(dropped, 0);  // capacity 3 of 4 wanted for expert 0: a drop is exercised
  Vec x = Random(T * C, 1), yp = Random(R * C, 2), w = Random(T * k, 3), r = Random(T * C, 4),
      rp = Random(R * C, 5);
  // Combine: L = <r, combine(yp, w)>
  auto combine_loss = [&] {
    Vec y(T * C);
    moe_combine_forward<double>(pool, y.data(), yp.data(), w.data(), slot.data(), T, k, C);
    return Dot(y, r);
  };
  Vec dyp(R * C), dw(T * k);
  moe_combine_backward<double>(pool, dyp.data(), dw.data(), r.data(), yp.data(), w.data(),
                               slot.data(), T, k, C);
  ExpectGradient("yp", yp, dyp, combine_loss);
  ExpectGradient("combine weights", w, dw, combine_loss);
  // Combine against the per-token definition.
  Vec y(T * C);
  moe_combine_forward<double>(pool, y.data(), yp.data(), w.data(), slot.data(), T, k, C);
  for (int t = 0; t < T; ++t)
    for (int c = 0; c < C; ++c) {
      double s = 0;
      for (int j = 0; j < k; ++j)
        if (slot[t * k + j] >= 0) s += w[t * k + j] * yp[slot[t * k + j] * C + c];
      EXPECT_DOUBLE_EQ(y[t * C + c], s);
    }
  // Permute: L = <rp, permute(x)>
  auto permute_loss = [&] {
    Vec xp(R * C);
    moe_permute_forward<double>(pool, xp.data(), x.data(), row_token.data(), R, C);
    return Dot(xp, rp);
  };
  Vec dx(T * C);
  moe_permute_backward<double>(pool, dx.data(), rp.data(), slot.data(), T, k, C, false);
  ExpectGradient("permute x", x, dx, permute_loss);
}

TEST_F(CpuKernelsTest, MoeCombineBackwardRowsMatchesTheTokenOrder) {
  // The per-expert combine backward (each expert's block of rows, in place over yp, as the layer
  // runs it inside its expert tasks) against the per-token kernel: bitwise, since both take the
  // same dot of the same floats. C = 70 covers the vector lanes and the tail; capacity drops some
  // choices, whose dweight the rows kernel must leave alone.
  const int T = 50, k = 3, C = 70, E = 5;
  std::mt19937 gen(11);
  std::vector<int32_t> experts(T * k);
  for (int t = 0; t < T; ++t) {
    for (int j = 0; j < k; ++j) experts[t * k + j] = (t + 2 * j + (t % 7 == 0 ? 0 : j)) % E;
  }
  std::vector<int32_t> slot(T * k), row_token(T * k);
  std::vector<int64_t> counts(E), offsets(E + 1);
  int64_t dropped;
  const int64_t R = moe_plan_dispatch(experts.data(), nullptr, T, k, E, 28, slot.data(),
                                      counts.data(), offsets.data(), row_token.data(), &dropped);
  ASSERT_GT(dropped, 0);
  std::normal_distribution<float> nd(0, 1);
  std::vector<float> yp(R * C), dy(T * C), w(T * k);
  for (float& v : yp) v = nd(gen);
  for (float& v : dy) v = nd(gen);
  for (float& v : w) v = nd(gen);
  std::vector<float> dyp_ref(R * C), dw_ref(T * k);
  moe_combine_backward<float>(pool, dyp_ref.data(), dw_ref.data(), dy.data(), yp.data(), w.data(),
                              slot.data(), T, k, C);
  std::vector<int32_t> row_slot(R, -1);
  for (int i = 0; i < T * k; ++i) {
    if (slot[i] >= 0) row_slot[slot[i]] = i;
  }
  std::vector<float> rows = yp, dw(T * k, 7.f);  // in place; 7 marks "not written"
  for (int e = 0; e < E; ++e) {
    const int64_t r0 = offsets[e], n = offsets[e + 1] - r0;
    moe_combine_backward_rows<float>(pool, rows.data() + r0 * C, dw.data(), dy.data(),
                                     rows.data() + r0 * C, w.data(), row_slot.data() + r0, n, k, C);
  }
  EXPECT_EQ(0, std::memcmp(rows.data(), dyp_ref.data(), rows.size() * sizeof(float)));
  for (int i = 0; i < T * k; ++i) {
    if (slot[i] >= 0) {
      EXPECT_EQ(dw[i], dw_ref[i]) << "choice " << i;
    } else {
      EXPECT_EQ(dw[i], 7.f) << "dropped choice " << i << " was written";
    }
  }
}

TEST_F(CpuKernelsTest, MoeJitterAndNoisyLogitsBackward) {
  const int T = 4, C = 5, E = 3;
  const uint64_t key = rng::Key(9, 8, 7);
  Vec x = Random(T * C, 1), r = Random(T * C, 2);
  auto jitter_loss = [&] {
    Vec xj(T * C);
    moe_jitter_forward<double>(pool, xj.data(), x.data(), key, T, C, 0.1);
    return Dot(xj, r);
  };
  Vec dx(T * C, 0.0);
  moe_jitter_backward<double>(pool, dx.data(), r.data(), key, T, C, 0.1);
  ExpectGradient("jitter x", x, dx, jitter_loss);
  Vec xj(T * C);
  moe_jitter_forward<double>(pool, xj.data(), x.data(), key, T, C, 0.1);
  for (int i = 0; i < T * C; ++i) {
    EXPECT_GE(xj[i] / x[i], 0.9 - 1e-12);
    EXPECT_LE(xj[i] / x[i], 1.1 + 1e-12);
  }

  Vec clean = Random(T * E, 3), raw = Random(T * E, 4), rh = Random(T * E, 5);
  auto noisy_loss = [&] {
    Vec h(T * E);
    moe_noisy_logits_forward<double>(pool, h.data(), clean.data(), raw.data(), key, T, E);
    return Dot(h, rh);
  };
  Vec draw(T * E);
  moe_noisy_logits_backward<double>(pool, draw.data(), rh.data(), raw.data(), key, T, E);
  ExpectGradient("noise raw", raw, draw, noisy_loss);
  ExpectGradient("noise clean", clean, rh, noisy_loss);  // dh/dclean = identity
}

TEST_F(CpuKernelsTest, AdamWMatchesReferenceUpdate) {
  const int n = 37;
  Vec p = Random(n, 1), m(n, 0.0), v(n, 0.0);
  Vec rp = p, rm = m, rv = v;
  AdamWHyper h;
  h.lr = 0.01;
  h.beta1 = 0.9;
  h.beta2 = 0.95;
  h.eps = 1e-8;
  h.weight_decay = 0.1;
  h.grad_scale = 0.5;
  for (int step = 1; step <= 3; ++step) {
    Vec g = Random(n, 10 + step);
    h.step = step;
    adamw_update<double>(pool, p.data(), g.data(), m.data(), v.data(), n, h);
    for (int i = 0; i < n; ++i) {  // PyTorch's AdamW, written out
      const double gi = g[i] * 0.5;
      rp[i] *= 1 - 0.01 * 0.1;
      rm[i] = 0.9 * rm[i] + 0.1 * gi;
      rv[i] = 0.95 * rv[i] + 0.05 * gi * gi;
      const double mhat = rm[i] / (1 - std::pow(0.9, step));
      const double vhat = rv[i] / (1 - std::pow(0.95, step));
      rp[i] -= 0.01 * mhat / (std::sqrt(vhat) + 1e-8);
    }
  }
  for (int i = 0; i < n; ++i) EXPECT_NEAR(p[i], rp[i], 1e-14);
}

// The float update is vectorised: an element must get the same bits whether it falls in the vector
// body or the scalar tail, i.e. wherever its tensor or slice begins. The tiered store updates one
// expert at a time and the in-memory path whole tensors, and their losses must match bitwise.
TEST_F(CpuKernelsTest, AdamWFloatBitsDoNotDependOnWhereTheArrayStarts) {
  const int n = 1000;
  std::vector<float> p0(n), g(n), m0(n), v0(n);
  std::mt19937 gen(5);
  std::normal_distribution<float> d(0.f, 1.f);
  for (int i = 0; i < n; ++i) {
    p0[i] = d(gen);
    g[i] = 0.01f * d(gen);
    m0[i] = 0.001f * d(gen);
    v0[i] = 1e-5f * std::abs(d(gen));
  }
  AdamWHyper h;
  h.lr = 3e-3;
  h.weight_decay = 0.1;
  h.step = 7;
  h.grad_scale = 0.37;
  std::vector<float> p = p0, m = m0, v = v0;
  adamw_update<float>(pool, p.data(), g.data(), m.data(), v.data(), n, h);
  for (int start : {1, 3, 5, 7, 13}) {  // the same elements, updated as a suffix of the array
    std::vector<float> q = p0, mq = m0, vq = v0;
    adamw_update<float>(pool, q.data() + start, g.data() + start, mq.data() + start,
                        vq.data() + start, n - start, h);
    for (int i = start; i < n; ++i) {
      ASSERT_EQ(0, std::memcmp(&q[i], &p[i], sizeof(float)))
          << "element " << i << " start " << start;
      ASSERT_EQ(0, std::memcmp(&mq[i], &m[i], sizeof(float))) << i;
      ASSERT_EQ(0, std::memcmp(&vq[i], &v[i], sizeof(float))) << i;
    }
  }
  // And the values are AdamW's: within float rounding of the double update of the same inputs.
  for (int i = 0; i < n; ++i) {
    const double gi = static_cast<double>(g[i]) * 0.37;
    const double mi = 0.9 * m0[i] + 0.1 * gi;
    const double vi = 0.999 * v0[i] + 0.001 * gi * gi;
    const double ref =
        p0[i] * (1 - 3e-3 * 0.1) -
        3e-3 * (mi / (1 - std::pow(0.9, 7))) / (std::sqrt(vi / (1 - std::pow(0.999, 7))) + 1e-8);
    EXPECT_NEAR(p[i], ref, 1e-6 * (1 + std::abs(ref))) << i;
  }
}

TEST_F(CpuKernelsTest, GradientNormAndClipScale) {
  Vec g(100000, 0.0);
  g[7] = 3.0;
  g[99999] = 4.0;  // the squares sum to 25 wherever the slices split
  EXPECT_DOUBLE_EQ(sum_squares<double>(pool, g.data(), static_cast<int64_t>(g.size())), 25.0);
  EXPECT_DOUBLE_EQ(ClipScale(5.0, 10.0), 1.0);
  EXPECT_DOUBLE_EQ(ClipScale(5.0, 0.0), 1.0);
  EXPECT_NEAR(ClipScale(5.0, 1.0), 0.2, 1e-7);
}

TEST_F(CpuKernelsTest, AddAndAccumulate) {
  Vec a = Random(50000, 1), b = Random(50000, 2), out(50000);
  add<double>(pool, out.data(), a.data(), b.data(), 50000);
  for (int i = 0; i < 50000; i += 997) EXPECT_DOUBLE_EQ(out[i], a[i] + b[i]);
  accumulate<double>(pool, out.data(), a.data(), 50000);
  for (int i = 0; i < 50000; i += 997) EXPECT_DOUBLE_EQ(out[i], a[i] + b[i] + a[i]);
}

}  // namespace
}  // namespace strata::cpu
