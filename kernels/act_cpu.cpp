// Elementwise activations of the decode step for fp32 rows on the CPU: the MLP's gated GELU and the LM head's
// logit soft-cap.
//
// Owned by kernels/act_cpu.py (references, validating launchers). Contracts: gelu_mul: gate_up (R, 2I) fp32
// contiguous, gate the first I columns of a row and up the last I -> (R, I) = gelu_tanh(gate) * up. softcap_: x fp32
// contiguous, any shape, in place: x = tanh(x / cap) * cap, cap > 0.
// Why: in torch each is three ops over the whole tensor (a chunk's views, gelu, mul; div, tanh, mul), each a pass
// over memory and a dispatch, on a few rows a step, where the passes and dispatches, not the arithmetic, are the
// cost. One pass here (BENCHMARKS.md, "Kernels").
// Numerics: gelu_tanh(x) = 0.5 x (1 + tanh(u)) = x / (1 + exp(-2u)), u = sqrt(2 / pi) (x + 0.044715 x^3) (no
// cancellation near 0; 1 / (1 + e) a reciprocal estimate refined once, ~23 bits); tanh is cpu_math.h's (a few ulp
// relative, small arguments included: a tiny model's logits are all near 0), exp its polynomial (within 2 ulp): the
// results agree with torch's to fp32 rounding, not bit for bit. At the saturated ends gelu gives x or ~0 (under
// 1e-29 in size) and tanh +-1.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cpu_math.h"

namespace {

constexpr float kGeluC = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluA = 0.044715f;

using dcanvas_cpu::exp8;
using dcanvas_cpu::f8;
using dcanvas_cpu::load8;
using dcanvas_cpu::store8;
using dcanvas_cpu::tanh8;

#if defined(__AVX512F__)
using dcanvas_cpu::exp512;
using dcanvas_cpu::recip;
using dcanvas_cpu::tail_mask;
using dcanvas_cpu::tanh512;
#endif

inline float gelu_tanh(float x) {
  const float u = kGeluC * (x + kGeluA * x * x * x);
  return x / (1.f + std::exp(-2.f * u));
}

}  // namespace

torch::Tensor gelu_mul(const torch::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == torch::kFloat32 && gate_up.is_contiguous() &&
                  gate_up.device().is_cpu() && gate_up.size(1) % 2 == 0,
              "gelu_mul: gate_up must be a contiguous (R, 2I) fp32 CPU tensor");
  const int64_t R = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = torch::empty({R, I}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, R * I, 16384, [&](int64_t i0, int64_t i1) {
    int64_t i = i0;
#if defined(__AVX512F__)
    const __m512 c = _mm512_set1_ps(-2.f * kGeluC), a = _mm512_set1_ps(kGeluA), one = _mm512_set1_ps(1.f);
    while (i < i1) {  // a run of one row: [i, min(i1, row end))
      const int64_t r = i / I, end = std::min(i1, (r + 1) * I);
      const float* g = gp + r * 2 * I - r * I;  // row r's gate at column i - r * I
      const float* u = g + I;
      for (; i < end; i += 16) {
        const __mmask16 m = tail_mask(end - i);
        const __m512 x = _mm512_maskz_loadu_ps(m, g + i);
        const __m512 x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
        const __m512 e = exp512(_mm512_mul_ps(c, _mm512_fmadd_ps(a, x3, x)));  // exp(-2u)
        const __m512 y = _mm512_mul_ps(x, recip(_mm512_add_ps(one, e)));
        _mm512_mask_storeu_ps(op + i, m, _mm512_mul_ps(y, _mm512_maskz_loadu_ps(m, u + i)));
      }
      i = end;
    }
#else
    while (i < i1) {  // a run of one row, 8 lanes at a time, then its tail
      const int64_t r = i / I, end = std::min(i1, (r + 1) * I);
      const float* g = gp + r * 2 * I - r * I;  // row r's gate at column i - r * I
      const float* u = g + I;
      for (; i + 8 <= end; i += 8) {
        const f8 x = load8(g + i);
        const f8 e = exp8(-2.f * kGeluC * (kGeluA * x * x * x + x));  // exp(-2u)
        store8(op + i, x / (1.f + e) * load8(u + i));
      }
      for (; i < end; ++i) op[i] = gelu_tanh(g[i]) * u[i];
    }
#endif
  });
  return out;
}

torch::Tensor softcap_(torch::Tensor& x, double cap) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.device().is_cpu(),
              "softcap_: x must be a contiguous fp32 CPU tensor");
  TORCH_CHECK(cap > 0, "softcap_: cap must be > 0");
  const int64_t n = x.numel();
  float* xp = x.data_ptr<float>();
  const float c = static_cast<float>(cap);
  at::parallel_for(0, n, 32768, [&](int64_t i0, int64_t i1) {
    int64_t i = i0;
#if defined(__AVX512F__)
    const __m512 cv = _mm512_set1_ps(c), inv = _mm512_set1_ps(1.f / c);
    for (; i < i1; i += 16) {
      const __mmask16 m = tail_mask(i1 - i);
      const __m512 t = tanh512(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, xp + i), inv));  // x / cap, within an ulp
      _mm512_mask_storeu_ps(xp + i, m, _mm512_mul_ps(t, cv));
    }
#else
    const float inv = 1.f / c;
    for (; i + 8 <= i1; i += 8) store8(xp + i, tanh8(load8(xp + i) * inv) * c);
    for (; i < i1; ++i) xp[i] = std::tanh(xp[i] / c) * c;
#endif
  });
  return x;
}
