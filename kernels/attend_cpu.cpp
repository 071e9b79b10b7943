// One query a row over its cached keys, for fp32 on the CPU (the decode step's attention, grouped-query).
//
// Owned by kernels/attend_cpu.py (the torch reference, the validating launcher). Contract: q (B, H, D) fp32
// contiguous; keys / values (B, G, S, D) fp32 whose last dim is contiguous (any other strides: views of the static
// cache); mask (B, S + X) bool contiguous or absent (true: attend); extra_k / extra_v (B, G, D) fp32 contiguous or
// both absent (X = 1: one more key and value after the S cached ones, the ring window's own token). H a multiple
// of G: query head h reads KV head h / (H / G). Scale 1 (folded into the q norm). -> out (B, H, D).
//
// Why: the step's attention in torch is two batched matmuls, a masked_fill, a softmax and (on the ring) a cat and
// an add per layer, ~8 small ops; here one call reads each cached key and value row once for the H / G query
// heads that share it, with the rows spread over the threads.
// Numerics: fp32 throughout; exp by a degree-6 polynomial after range reduction (Cephes' expf; within 2 ulp of
// libm), sums in a different order from torch's: results agree to fp32 rounding, not bit for bit. A masked key
// weighs exactly 0; a row with every key masked gives 0 (torch gives NaN there; the model never builds one).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#define ATT_AVX512 1
#include <immintrin.h>
#endif

namespace {

constexpr int RMAX = 8;  // query heads a KV head serves, at most (Gemma-3-270M: 4)

#if ATT_AVX512
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.33654f));
  x = _mm512_min_ps(x, _mm512_set1_ps(88.72283f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500E-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1); }
#endif

// scores[r][s] = q_r . key_s for the R heads of one KV head.
inline void dots(const float* const* qr, int R, const float* key, int64_t D, float* out, int64_t ld) {
#if ATT_AVX512
  __m512 acc[RMAX];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    const __mmask16 m = tail_mask(D - d);
    const __m512 kv = _mm512_maskz_loadu_ps(m, key + d);
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, qr[r] + d), kv, acc[r]);
  }
  for (int r = 0; r < R; ++r) out[r * ld] = _mm512_reduce_add_ps(acc[r]);
#else
  for (int r = 0; r < R; ++r) {
    float s = 0.f;
    for (int64_t d = 0; d < D; ++d) s += qr[r][d] * key[d];
    out[r * ld] = s;
  }
#endif
}

// p[0, n) = exp(p - max) where valid (else 0), in place; returns the sum.
inline float softmax_num(float* p, const bool* valid, int64_t n) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t s = 0; s < n; ++s)
    if (valid == nullptr || valid[s]) mx = std::max(mx, p[s]);
  if (mx == -std::numeric_limits<float>::infinity()) {
    std::fill_n(p, n, 0.f);
    return 0.f;
  }
  float sum = 0.f;
#if ATT_AVX512
  const __m512 mv = _mm512_set1_ps(mx);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t s = 0; s < n; s += 16) {
    __mmask16 m = tail_mask(n - s);
    if (valid != nullptr) {
      __mmask16 v = 0;
      for (int j = 0; j < 16 && s + j < n; ++j) v |= static_cast<__mmask16>(valid[s + j]) << j;
      m &= v;
    }
    const __m512 e = _mm512_maskz_mov_ps(m, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, p + s), mv)));
    _mm512_mask_storeu_ps(p + s, tail_mask(n - s), e);
    acc = _mm512_add_ps(acc, e);
  }
  sum = _mm512_reduce_add_ps(acc);
#else
  for (int64_t s = 0; s < n; ++s) {
    p[s] = (valid == nullptr || valid[s]) ? std::exp(p[s] - mx) : 0.f;
    sum += p[s];
  }
#endif
  return sum;
}

// out[0, D) += w * v[0, D)
inline void axpy(float w, const float* v, float* out, int64_t D) {
#if ATT_AVX512
  const __m512 wv = _mm512_set1_ps(w);
  for (int64_t d = 0; d < D; d += 16) {
    const __mmask16 m = tail_mask(D - d);
    _mm512_mask_storeu_ps(out + d, m, _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(m, v + d),
                                                       _mm512_maskz_loadu_ps(m, out + d)));
  }
#else
  for (int64_t d = 0; d < D; ++d) out[d] += w * v[d];
#endif
}

}  // namespace

torch::Tensor attend_one(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                         const c10::optional<torch::Tensor>& mask, const c10::optional<torch::Tensor>& extra_k,
                         const c10::optional<torch::Tensor>& extra_v) {
  auto f32cpu = [](const torch::Tensor& t) { return t.scalar_type() == torch::kFloat32 && t.device().is_cpu(); };
  TORCH_CHECK(q.dim() == 3 && f32cpu(q) && q.is_contiguous(), "attend_one: q must be a contiguous (B, H, D) fp32 "
              "CPU tensor");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  TORCH_CHECK(keys.dim() == 4 && f32cpu(keys) && keys.size(0) == B && keys.size(3) == D && keys.stride(3) == 1,
              "attend_one: keys must be (B, G, S, D) fp32 with a contiguous last dim");
  TORCH_CHECK(values.sizes() == keys.sizes() && f32cpu(values) && values.stride(3) == 1,
              "attend_one: values must match keys");
  const int64_t G = keys.size(1), S = keys.size(2);
  TORCH_CHECK(G > 0 && H % G == 0 && H / G <= RMAX, "attend_one: H must be a multiple of G, at most 8 times it");
  TORCH_CHECK(extra_k.has_value() == extra_v.has_value(), "attend_one: extra_k and extra_v go together");
  const int64_t X = extra_k.has_value() ? 1 : 0;
  for (const auto* e : {&extra_k, &extra_v})
    if (e->has_value())
      TORCH_CHECK((*e)->dim() == 3 && (*e)->size(0) == B && (*e)->size(1) == G && (*e)->size(2) == D &&
                      f32cpu(**e) && (*e)->is_contiguous(), "attend_one: extra_k / extra_v must be (B, G, D)");
  const int64_t T = S + X;  // keys a row attends over
  TORCH_CHECK(T > 0, "attend_one: no keys");
  if (mask.has_value())
    TORCH_CHECK(mask->dim() == 2 && mask->size(0) == B && mask->size(1) == T && mask->scalar_type() == torch::kBool &&
                    mask->is_contiguous(), "attend_one: mask must be a contiguous (B, S + X) bool tensor");
  auto out = torch::zeros({B, H, D}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = keys.data_ptr<float>();
  const float* vp = values.data_ptr<float>();
  const float* ekp = X ? extra_k->data_ptr<float>() : nullptr;
  const float* evp = X ? extra_v->data_ptr<float>() : nullptr;
  const bool* mp = mask.has_value() ? mask->data_ptr<bool>() : nullptr;
  float* op = out.data_ptr<float>();
  const int R = static_cast<int>(H / G);
  const int64_t ksb = keys.stride(0), ksg = keys.stride(1), kss = keys.stride(2);
  const int64_t vsb = values.stride(0), vsg = values.stride(1), vss = values.stride(2);
  at::parallel_for(0, B * G, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> p(static_cast<size_t>(R) * T);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / G, g = i % G;
      const float* qr[RMAX];
      for (int r = 0; r < R; ++r) qr[r] = qp + (b * H + g * R + r) * D;
      const float* kb = kp + b * ksb + g * ksg;
      const float* vb = vp + b * vsb + g * vsg;
      for (int64_t s = 0; s < S; ++s) dots(qr, R, kb + s * kss, D, p.data() + s, T);
      if (X) dots(qr, R, ekp + (b * G + g) * D, D, p.data() + S, T);
      const bool* valid = mp == nullptr ? nullptr : mp + b * T;
      float* o[RMAX];
      for (int r = 0; r < R; ++r) {  // normalised weights, in place
        float* pr = p.data() + r * T;
        o[r] = op + (b * H + g * R + r) * D;
        const float sum = softmax_num(pr, valid, T);
        const float inv = sum > 0.f ? 1.f / sum : 0.f;
        for (int64_t s = 0; s < T; ++s) pr[s] *= inv;
      }
      // Each value row read once for the R heads (their output rows stay in L1).
      for (int64_t s = 0; s < T; ++s) {
        const float* vrow = s < S ? vb + s * vss : evp + (b * G + g) * D;
        for (int r = 0; r < R; ++r) {
          const float w = p[r * T + s];
          if (w != 0.f) axpy(w, vrow, o[r], D);
        }
      }
    }
  });
  return out;
}
