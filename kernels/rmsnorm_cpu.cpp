// Fused RMSNorm for fp32 rows on the CPU: out = (residual + x * rsqrt(mean(x^2) + eps) * weight) * scale.
//
// Owned by kernels/rmsnorm_cpu.py (reference, validating launcher). Contract: x (R, D) fp32 contiguous; weight
// (D,) or (P, D) (row r takes weight row r % P), residual (R, D), scale (1,) fp32 contiguous, each optional. Why: torch's CPU rms_norm is ~8 small ops, and a
// decode step runs ten norms a layer on a few rows, so dispatch, not arithmetic, is their cost.
// rms_norm_rope: x (B * P, D) rows of B groups of P (a decode step's q, k and v heads), weight (P, D), cos / sin (B, D):
// each row normed by its weight row, then the first `rotate` rows of each group rotated (RoPE: y * cos +
// rotate_half(y) * sin, with group b's cos and sin). One call where torch takes a norm, a cat and four elementwise ops.
// Numerics: the sum of squares accumulates in 16 fp32 partial sums (vectorisable), so it rounds differently from
// torch's in the last bits; the rest is the same formula in the same order.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>

namespace {

// 1 / sqrt(mean(x[0, D)^2) + eps): the sum of squares in 16 fp32 partial sums (vectorisable).
inline float inv_rms(const float* xr, int64_t D, float e) {
  float part[16] = {0.f};
  int64_t i = 0;
  for (; i + 16 <= D; i += 16)
    for (int j = 0; j < 16; ++j) part[j] += xr[i + j] * xr[i + j];
  float ss = 0.f;
  for (int j = 0; j < 16; ++j) ss += part[j];
  for (; i < D; ++i) ss += xr[i] * xr[i];
  return 1.f / std::sqrt(ss / static_cast<float>(D) + e);
}

}  // namespace

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
      const float inv = inv_rms(xr, D, e);
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

torch::Tensor rms_norm_rope(const torch::Tensor& x, const torch::Tensor& weight, double eps, const torch::Tensor& cos,
                            const torch::Tensor& sin, int64_t rotate) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.device().is_cpu(),
              "rms_norm_rope: x must be a contiguous (B * P, D) fp32 CPU tensor");
  const int64_t R = x.size(0), D = x.size(1);
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == D && weight.scalar_type() == torch::kFloat32 &&
                  weight.is_contiguous() && weight.size(0) >= 1 && R % weight.size(0) == 0,
              "rms_norm_rope: weight must be a contiguous (P, D) fp32 tensor with R a multiple of P");
  const int64_t P = weight.size(0), B = R / P;
  for (const auto* t : {&cos, &sin})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == B && t->size(1) == D && t->scalar_type() == torch::kFloat32 &&
                    t->is_contiguous(), "rms_norm_rope: cos and sin must be contiguous (B, D) fp32 tensors");
  TORCH_CHECK(D % 2 == 0 && 0 <= rotate && rotate <= P, "rms_norm_rope: need an even D and 0 <= rotate <= P");
  auto out = torch::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  const int64_t half = D / 2;
  at::parallel_for(0, R, std::max<int64_t>(1, 65536 / std::max<int64_t>(D, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / P, p = r % P;
      const float* xr = xp + r * D;
      const float* wr = wp + p * D;
      const float inv = inv_rms(xr, D, e);
      float* o = op + r * D;
      if (p >= rotate) {
        for (int64_t k = 0; k < D; ++k) o[k] = xr[k] * inv * wr[k];
        continue;
      }
      // y * cos + rotate_half(y) * sin, rotate_half(y) = (-y[half:], y[:half]) (cos and sin repeat at half).
      const float* c = cp + b * D;
      const float* sn = sp + b * D;
      for (int64_t k = 0; k < half; ++k) {
        const float y0 = xr[k] * inv * wr[k], y1 = xr[k + half] * inv * wr[k + half];
        o[k] = y0 * c[k] - y1 * sn[k];
        o[k + half] = y1 * c[k + half] + y0 * sn[k + half];
      }
    }
  });
  return out;
}
