// The AR drafts' token draw for fp32 logit rows on the CPU: bans, min-p, temperature, one inverse-CDF draw, and the
// drawn token's log-probability, in a few passes over each row.
//
// Owned by kernels/sample_cpu.py (reference, validating launcher). Contract: logits (K, V) fp32 with unit column
// stride (any row stride, 0 included: K lanes drafting from one context's logits), u (K,) fp32 in [0, 1), inv_temp >=
// 0, min_p in [0, 1], bans as CSR (offsets (K + 1,) int64, ids (N,) int64 in [0, V)). Per row k: the allowed logits
// are the row without its bans; those under max(allowed) + log(min_p) are cut (none when min_p is 0); each remaining
// token weighs exp((x - max(allowed)) * inv_temp), and the token drawn is the first whose running weight passes
// u[k] times the total (kept below the total: a token of zero weight is never drawn). inv_temp 0 is greedy: the first
// allowed token of the largest logit (torch's argmax over the allowed row; u is not read). Returns (tok (K,) int64,
// logp (K,) fp32): logp is the drawn token's log-softmax over the raw row at temperature 1, bans included (the
// drafting frame's likelihood).
// Why: in torch the same draw is ~8 passes over (K, V) with a (K, V) tensor allocated for most (log_softmax, the
// banned clone, the tempered division, softmax, cumsum), a sizeable share of the 8-lane decode step at a 96k
// vocabulary. Here each row is copied once into a per-thread scratch (L2-resident at 96k) and read from there
// (BENCHMARKS.md, "Kernels").
// Numerics: exp is cpu_math.h's (within 2 ulp); sums are in another order than torch's softmax and cumsum, so a draw
// lands on the other side of a token boundary only when u is within fp32 rounding of it.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

#include "cpu_math.h"

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

using dcanvas_cpu::exp8;
using dcanvas_cpu::f8;
using dcanvas_cpu::load8;
using dcanvas_cpu::max8;
using dcanvas_cpu::store8;
using dcanvas_cpu::sum8;

#if defined(__AVX512F__)
using dcanvas_cpu::exp512;
using dcanvas_cpu::tail_mask;
#endif

// Copy src[0, V) into dst and return its maximum.
float copy_max(const float* src, float* dst, int64_t V) {
  int64_t j = 0;
  float m = -kInf;
#if defined(__AVX512F__)
  __m512 vm = _mm512_set1_ps(-kInf);
  for (; j < V; j += 16) {
    const __mmask16 t = tail_mask(V - j);
    const __m512 x = _mm512_mask_loadu_ps(_mm512_set1_ps(-kInf), t, src + j);
    _mm512_mask_storeu_ps(dst + j, t, x);
    vm = _mm512_max_ps(vm, x);
  }
  m = _mm512_reduce_max_ps(vm);
#else
  f8 vm = f8{} - kInf;
  for (; j + 8 <= V; j += 8) {
    const f8 x = load8(src + j);
    store8(dst + j, x);
    vm = x > vm ? x : vm;
  }
  m = max8(vm);
#endif
  for (; j < V; ++j) {
    dst[j] = src[j];
    m = std::max(m, src[j]);
  }
  return m;
}

// The maximum of x[0, V) and the sum of exp(x - shift) over it (-inf entries add nothing).
std::pair<float, double> max_and_expsum(const float* x, int64_t V, float shift) {
  int64_t j = 0;
  float m = -kInf;
  double s = 0.0;
#if defined(__AVX512F__)
  __m512 vm = _mm512_set1_ps(-kInf), vs = _mm512_setzero_ps();
  const __m512 vshift = _mm512_set1_ps(shift);
  for (; j < V; j += 16) {
    const __mmask16 t = tail_mask(V - j);
    const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-kInf), t, x + j);
    vm = _mm512_max_ps(vm, v);
    const __mmask16 live = _mm512_cmp_ps_mask(v, _mm512_set1_ps(-kInf), _CMP_GT_OQ);
    vs = _mm512_add_ps(vs, _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(v, vshift))));
  }
  m = _mm512_reduce_max_ps(vm);
  s = _mm512_reduce_add_ps(vs);
#else
  f8 vm = f8{} - kInf, vs = {};
  for (; j + 8 <= V; j += 8) {
    const f8 v = load8(x + j);
    vm = v > vm ? v : vm;
    const f8 e = exp8(v - shift);
    vs += v > -kInf ? e : 0.f;
  }
  m = max8(vm);
  s = sum8(vs);
#endif
  for (; j < V; ++j) {
    m = std::max(m, x[j]);
    if (x[j] > -kInf) s += std::exp(x[j] - shift);
  }
  return {m, s};
}

// w = exp((x - top) * inv_temp) where x >= floor, else 0, written over x; returns the sum of w.
double weigh(float* x, int64_t V, float top, float inv_temp, float floor) {
  int64_t j = 0;
  double s = 0.0;
#if defined(__AVX512F__)
  __m512 vs = _mm512_setzero_ps();
  const __m512 vtop = _mm512_set1_ps(top), vt = _mm512_set1_ps(inv_temp), vfloor = _mm512_set1_ps(floor);
  for (; j < V; j += 16) {
    const __mmask16 t = tail_mask(V - j);
    const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-kInf), t, x + j);
    const __mmask16 keep = _mm512_cmp_ps_mask(v, vfloor, _CMP_GE_OQ);
    const __m512 w = _mm512_maskz_mov_ps(keep, exp512(_mm512_mul_ps(_mm512_sub_ps(v, vtop), vt)));
    _mm512_mask_storeu_ps(x + j, t, w);
    vs = _mm512_add_ps(vs, w);
  }
  s = _mm512_reduce_add_ps(vs);
#else
  f8 vs = {};
  for (; j + 8 <= V; j += 8) {
    const f8 v = load8(x + j);
    const f8 w = v >= floor ? exp8((v - top) * inv_temp) : 0.f;
    store8(x + j, w);
    vs += w;
  }
  s = sum8(vs);
#endif
  for (; j < V; ++j) {
    const float w = x[j] >= floor ? std::exp((x[j] - top) * inv_temp) : 0.f;
    x[j] = w;
    s += w;
  }
  return s;
}

// The first index whose running sum of w passes target; the last positive weight when rounding leaves target at or
// above the running total.
int64_t invert(const float* w, int64_t V, double target) {
  double run = 0.0;
  int64_t j = 0;
#if defined(__AVX512F__)
  for (; j + 16 <= V; j += 16) {
    const double block = _mm512_reduce_add_ps(_mm512_loadu_ps(w + j));
    if (run + block > target) break;  // the draw lands in this block: walk it one weight at a time
    run += block;
  }
#endif
  for (; j < V; ++j) {
    run += w[j];
    if (run > target && w[j] > 0.f) return j;
  }
  for (j = V - 1; j > 0 && !(w[j] > 0.f); --j) {
  }
  return j;
}

// The first index of x[0, V) holding `top` (which x holds).
int64_t first_of(const float* x, int64_t V, float top) {
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 vtop = _mm512_set1_ps(top);
  for (; j < V; j += 16) {
    const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_maskz_loadu_ps(tail_mask(V - j), x + j), vtop, _CMP_EQ_OQ) &
                          tail_mask(V - j);
    if (hit != 0) return j + __builtin_ctz(hit);
  }
#endif
  for (; j < V; ++j)
    if (x[j] == top) return j;
  return V - 1;  // unreachable: top is one of x's values
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> draw_tokens(const torch::Tensor& logits, const torch::Tensor& u,
                                                     double inv_temp, double min_p, const torch::Tensor& ban_offsets,
                                                     const torch::Tensor& ban_ids) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.device().is_cpu() &&
                  logits.stride(1) == 1 && logits.stride(0) >= 0 && logits.size(1) > 0,
              "draw_tokens: logits must be a (K, V) fp32 CPU tensor with unit column stride");
  const int64_t K = logits.size(0), V = logits.size(1);
  TORCH_CHECK(u.dim() == 1 && u.size(0) == K && u.scalar_type() == torch::kFloat32 && u.is_contiguous(),
              "draw_tokens: u must be a contiguous (K,) fp32 tensor");
  TORCH_CHECK(ban_offsets.dim() == 1 && ban_offsets.size(0) == K + 1 && ban_offsets.scalar_type() == torch::kInt64 &&
                  ban_offsets.is_contiguous() && ban_ids.dim() == 1 && ban_ids.scalar_type() == torch::kInt64 &&
                  ban_ids.is_contiguous(),
              "draw_tokens: bans must be CSR int64 tensors: offsets (K + 1,), ids (N,)");
  TORCH_CHECK(inv_temp >= 0 && min_p >= 0 && min_p <= 1, "draw_tokens: need inv_temp >= 0 and min_p in [0, 1]");
  const float* lp = logits.data_ptr<float>();
  const int64_t row_stride = logits.stride(0);
  const float* up = u.data_ptr<float>();
  const int64_t* off = ban_offsets.data_ptr<int64_t>();
  const int64_t* ids = ban_ids.data_ptr<int64_t>();
  TORCH_CHECK(off[0] == 0 && off[K] == ban_ids.size(0), "draw_tokens: ban offsets must run from 0 to len(ids)");
  for (int64_t k = 0; k < K; ++k) {
    TORCH_CHECK(off[k] <= off[k + 1], "draw_tokens: ban offsets must not decrease");
  }
  for (int64_t i = 0; i < ban_ids.size(0); ++i) {
    TORCH_CHECK(ids[i] >= 0 && ids[i] < V, "draw_tokens: a banned id is outside the vocabulary");
  }
  auto tok = torch::empty({K}, torch::kInt64);
  auto logp = torch::empty({K}, torch::kFloat32);
  int64_t* tp = tok.data_ptr<int64_t>();
  float* gp = logp.data_ptr<float>();
  const float log_min_p = min_p > 0 ? static_cast<float>(std::log(min_p)) : -kInf;
  at::parallel_for(0, K, 1, [&](int64_t k0, int64_t k1) {
    thread_local std::vector<float> scratch;
    scratch.resize(V);
    float* buf = scratch.data();
    for (int64_t k = k0; k < k1; ++k) {
      const float* row = lp + k * row_stride;
      const float m_raw = copy_max(row, buf, V);
      double banned = 0.0;  // the raw softmax mass of the bans (each counted once)
      for (int64_t i = off[k]; i < off[k + 1]; ++i) {
        float& x = buf[ids[i]];
        if (x > -kInf) {
          banned += std::exp(static_cast<double>(x) - m_raw);
          x = -kInf;
        }
      }
      const auto [top, allowed] = max_and_expsum(buf, V, m_raw);
      TORCH_CHECK(top > -kInf, "draw_tokens: every token of a row is banned");
      if (inv_temp == 0) {  // greedy: min-p never cuts the top token
        const int64_t t = first_of(buf, V, top);
        tp[k] = t;
        gp[k] = static_cast<float>(row[t] - m_raw - std::log(allowed + banned));
        continue;
      }
      // Without min-p the floor still excludes the bans' -inf (and any -inf logit).
      const float floor = log_min_p > -kInf ? top + log_min_p : std::numeric_limits<float>::lowest();
      const double total = weigh(buf, V, top, static_cast<float>(inv_temp), floor);
      // The draw is kept below the total, as torch's sampler keeps it: u * total may round up to it.
      const double target = std::min(static_cast<double>(up[k]) * total, std::nextafter(total, 0.0));
      const int64_t t = invert(buf, V, target);
      tp[k] = t;
      gp[k] = static_cast<float>(row[t] - m_raw - std::log(allowed + banned));
    }
  });
  return {tok, logp};
}
