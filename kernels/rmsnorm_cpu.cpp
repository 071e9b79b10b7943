// Fused RMSNorm for fp32 rows on the CPU: out = (residual + x * rsqrt(mean(x^2) + eps) * weight) * scale.
//
// Owned by kernels/rmsnorm_cpu.py (reference, validating launcher). Contract: x (R, D) fp32 contiguous; weight
// (D,) or (P, D) (row r takes weight row r % P), residual (R, D), scale (1,) fp32 contiguous, each optional. Why: torch's CPU rms_norm is ~8 small ops, and a
// decode step runs ten norms a layer on a few rows, so dispatch, not arithmetic, is their cost.
// Numerics: the sum of squares accumulates in 16 fp32 partial sums (vectorisable), so it rounds differently from
// torch's in the last bits; the rest is the same formula in the same order.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>

torch::Tensor rms_norm_fused(const torch::Tensor& x, const c10::optional<torch::Tensor>& weight, double eps,
                             const c10::optional<torch::Tensor>& residual, const c10::optional<torch::Tensor>& scale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.device().is_cpu(),
              "rms_norm_fused: x must be a contiguous (R, D) fp32 CPU tensor");
  const int64_t R = x.size(0), D = x.size(1);
  auto check = [&](const c10::optional<torch::Tensor>& t, int64_t n, const char* name) -> const float* {
    if (!t.has_value()) return nullptr;
    TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->is_contiguous() && t->numel() == n,
                "rms_norm_fused: ", name, " must be contiguous fp32 with ", n, " elements");
    return t->data_ptr<float>();
  };
  // weight: (D,) or (P, D) with R a multiple of P, row r scaled by weight row r % P (stacked per-head norms).
  const int64_t P = weight.has_value() ? weight->numel() / std::max<int64_t>(D, 1) : 1;
  TORCH_CHECK(!weight.has_value() || (P >= 1 && P * D == weight->numel() && R % P == 0),
              "rms_norm_fused: weight must hold D or P * D elements with R a multiple of P");
  const float* w = check(weight, P * D, "weight");
  const float* res = check(residual, R * D, "residual");
  const float* sc = check(scale, 1, "scale");
  auto out = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float s = sc ? *sc : 1.f;
  const float e = static_cast<float>(eps);
  at::parallel_for(0, R, std::max<int64_t>(1, 65536 / std::max<int64_t>(D, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = xp + r * D;
      float part[16] = {0.f};
      int64_t i = 0;
      for (; i + 16 <= D; i += 16)
        for (int j = 0; j < 16; ++j) part[j] += xr[i + j] * xr[i + j];
      float ss = 0.f;
      for (int j = 0; j < 16; ++j) ss += part[j];
      for (; i < D; ++i) ss += xr[i] * xr[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(D) + e);
      float* o = op + r * D;
      const float* wr = w ? w + (r % P) * D : nullptr;
      const float* rr = res ? res + r * D : nullptr;
      for (int64_t k = 0; k < D; ++k) {
        float y = xr[k] * inv;
        if (wr) y *= wr[k];
        if (rr) y += rr[k];
        o[k] = y * s;
      }
    }
  });
  return out;
}
