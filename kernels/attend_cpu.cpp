// One query a row over its cached keys, for fp32 on the CPU (the decode step's attention, grouped-query).
//
// Owned by kernels/attend_cpu.py (the torch reference, the validating launcher). Contract: q (B, H, D) fp32
// contiguous; keys / values (B, G, S, D) fp32 whose last dim is contiguous (any other strides: views of the static
// cache); mask (B, S + X) bool contiguous or absent (true: attend); extra_k / extra_v (B, G, D) fp32 contiguous or
// both absent (X = 1: one more key and value after the S cached ones, the ring window's own token). H a multiple
// of G: query head h reads KV head h / (H / G). Scale 1 (folded into the q norm). -> out (B, H, D).
// Shared prefixes: leader (B,) int64 contiguous or absent, with a slot range [shared_lo, shared_hi): the caller
// promises keys / values[b, :, s] == keys / values[leader[b], :, s] for s in that range (the batched AR drafts of one
// context: every lane's rows are copies of the context's). Rows with one leader form a group, and each shared key
// and value row is read once for all of the group's query heads instead of once per row.
//
// Why: the step's attention in torch is two batched matmuls, a masked_fill, a softmax and (on the ring) a cat and
// an add per layer, ~8 small ops; here one call reads each cached key and value row once for the H / G query
// heads that share it (and for every row of a group, over the shared slots). Work items are (group, KV head, key
// chunk): with fewer groups than threads (one row; the drafts of one context) the keys are split into chunks whose
// partial softmax sums are merged afterwards (as flash-decoding does), so every thread streams part of the cache.
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

#include "cpu_math.h"

#if defined(__AVX512F__)
#define ATT_AVX512 1
#include <immintrin.h>
#endif

namespace {

using dcanvas_cpu::exp8;
using dcanvas_cpu::f8;
using dcanvas_cpu::load8;
using dcanvas_cpu::store8;
using dcanvas_cpu::sum8;

constexpr int RMAX = 8;  // query heads a KV head serves, at most (Gemma-3-270M: 4)
// Keys are scored in blocks of 4 while the key rows kAhead further on are prefetched. Values are weighed in blocks of
// kValueBlock rows (16 KB at D = 256), which stay in L1 across the block's passes over D and the query heads (one
// pass over every key per 64 dims read each value row four times, from L2 at best); the next block is prefetched
// meanwhile, which took a tenth off the 8-row decode step of Gemma-3-270M (BENCHMARKS.md, "Kernels").
constexpr int64_t kAhead = 8;
constexpr int64_t kValueBlock = 16;

#if ATT_AVX512
using dcanvas_cpu::exp512;
using dcanvas_cpu::tail_mask;

// Every cache line of rows [from, to) (D floats each, rows `stride` apart) requested into L1.
inline void prefetch_rows(const float* base, int64_t stride, int64_t from, int64_t to, int64_t D) {
  for (int64_t j = from; j < to; ++j)
    for (int64_t d = 0; d < D; d += 16) _mm_prefetch(reinterpret_cast<const char*>(base + j * stride + d), _MM_HINT_T0);
}

// [sum(v0), ..., sum(v7)] of eight 8-lane vectors.
inline __m256 hsum8(__m256 v0, __m256 v1, __m256 v2, __m256 v3, __m256 v4, __m256 v5, __m256 v6, __m256 v7) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v0, v1), _mm256_hadd_ps(v2, v3));  // per 128-bit half: v0..v3
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v4, v5), _mm256_hadd_ps(v6, v7));  // per 128-bit half: v4..v7
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// The two 8-lane halves of v added (the upper half through the AVX-512F 64-bit extract: no AVX-512DQ needed).
inline __m256 halves(__m512 v) {
  return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
#endif

// out[i * ld + j] = q[i] . k[j] for i < nq, j < nk (both <= 4; the pointer arrays hold 4, padded with valid ones).
// A 4 x 4 register tile: each key and query vector loaded once per 16 lanes of D for 4 dot products, the 16 sums
// reduced together at the end (one horizontal sum each would cost about as much as the products).
inline void dots4x4(const float* const q[4], const float* const k[4], int64_t D, float* out, int64_t ld, int nq,
                    int nk) {
#if ATT_AVX512
  __m512 acc[4][4];
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    const __mmask16 m = tail_mask(D - d);
    __m512 kv[4];
    for (int j = 0; j < 4; ++j) kv[j] = _mm512_maskz_loadu_ps(m, k[j] + d);
    for (int i = 0; i < 4; ++i) {
      const __m512 qv = _mm512_maskz_loadu_ps(m, q[i] + d);
      for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_fmadd_ps(qv, kv[j], acc[i][j]);
    }
  }
  alignas(32) float sums[16];
  _mm256_store_ps(sums, hsum8(halves(acc[0][0]), halves(acc[0][1]), halves(acc[0][2]), halves(acc[0][3]),
                              halves(acc[1][0]), halves(acc[1][1]), halves(acc[1][2]), halves(acc[1][3])));
  _mm256_store_ps(sums + 8, hsum8(halves(acc[2][0]), halves(acc[2][1]), halves(acc[2][2]), halves(acc[2][3]),
                                  halves(acc[3][0]), halves(acc[3][1]), halves(acc[3][2]), halves(acc[3][3])));
  for (int i = 0; i < nq; ++i)
    for (int j = 0; j < nk; ++j) out[i * ld + j] = sums[i * 4 + j];
#else
  // The same register tile in 8-lane vectors (a scalar sum per pair is one serial chain of D FMAs).
  f8 acc[4][4] = {};
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    f8 kv[4];
    for (int j = 0; j < 4; ++j) kv[j] = load8(k[j] + d);
    for (int i = 0; i < 4; ++i) {
      const f8 qv = load8(q[i] + d);
      for (int j = 0; j < 4; ++j) acc[i][j] += qv * kv[j];
    }
  }
  for (int i = 0; i < nq; ++i)
    for (int j = 0; j < nk; ++j) {
      float sum = sum8(acc[i][j]);
      for (int64_t t = d; t < D; ++t) sum += q[i][t] * k[j][t];
      out[i * ld + j] = sum;
    }
#endif
}

// p[i * ld + s] = q[i] . key s for i < nq, s < ns, the keys at kbase + s * kstride: key blocks of 4 outside (they
// stay in L1 while every query block reads them), query blocks of 4 inside.
inline void score_block(const float* const* q, int64_t nq, const float* kbase, int64_t kstride, int64_t ns, int64_t D,
                        float* p, int64_t ld) {
  for (int64_t s0 = 0; s0 < ns; s0 += 4) {
    const int nk = static_cast<int>(std::min<int64_t>(4, ns - s0));
#if ATT_AVX512
    prefetch_rows(kbase, kstride, std::min(ns, s0 + kAhead), std::min(ns, s0 + kAhead + 4), D);
#endif
    const float* kptr[4];
    for (int j = 0; j < 4; ++j) kptr[j] = kbase + (s0 + std::min(j, nk - 1)) * kstride;
    for (int64_t i0 = 0; i0 < nq; i0 += 4) {
      const int n = static_cast<int>(std::min<int64_t>(4, nq - i0));
      const float* qptr[4];
      for (int i = 0; i < 4; ++i) qptr[i] = q[i0 + std::min(i, n - 1)];
      dots4x4(qptr, kptr, D, p + i0 * ld + s0, ld, n, nk);
    }
  }
}

// out[i] += sum_s p[i * ld + s] * value s, for i < nq, s < ns, the values at vbase + s * vstride. AVX-512: a register
// tile of 4 query heads x 64 dims (16 accumulators) runs over a block of kValueBlock keys, so each output vector is
// read and written once per block, not once per 4 keys (the stores bound the kernel before), and each value vector
// loaded feeds 4 FMAs. Masked keys weigh exactly 0 and the cache's values are finite: they add nothing.
inline void weigh_block(const float* p, int64_t ld, int64_t nq, float* const* out, const float* vbase,
                        int64_t vstride, int64_t ns, int64_t D) {
#if ATT_AVX512
  for (int64_t sb = 0; sb < ns; sb += kValueBlock) {
    const int64_t se = std::min(ns, sb + kValueBlock);
    prefetch_rows(vbase, vstride, se, std::min(ns, se + kValueBlock), D);
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
      const __mmask16 m0 = tail_mask(D - d0), m1 = D - d0 > 16 ? tail_mask(D - d0 - 16) : 0,
                      m2 = D - d0 > 32 ? tail_mask(D - d0 - 32) : 0, m3 = D - d0 > 48 ? tail_mask(D - d0 - 48) : 0;
      for (int64_t i0 = 0; i0 < nq; i0 += 4) {
        const int n = static_cast<int>(std::min<int64_t>(4, nq - i0));
        const float* w0 = p + i0 * ld;  // a short block repeats its last query head
        const float* w1 = p + (i0 + std::min(1, n - 1)) * ld;
        const float* w2 = p + (i0 + std::min(2, n - 1)) * ld;
        const float* w3 = p + (i0 + std::min(3, n - 1)) * ld;
        __m512 a00 = _mm512_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00, a13 = a00,
               a20 = a00, a21 = a00, a22 = a00, a23 = a00, a30 = a00, a31 = a00, a32 = a00, a33 = a00;
        const float* v = vbase + sb * vstride + d0;
        for (int64_t s = sb; s < se; ++s, v += vstride) {
          const __m512 v0 = _mm512_maskz_loadu_ps(m0, v), v1 = _mm512_maskz_loadu_ps(m1, v + 16),
                       v2 = _mm512_maskz_loadu_ps(m2, v + 32), v3 = _mm512_maskz_loadu_ps(m3, v + 48);
          __m512 w = _mm512_set1_ps(w0[s]);
          a00 = _mm512_fmadd_ps(w, v0, a00), a01 = _mm512_fmadd_ps(w, v1, a01);
          a02 = _mm512_fmadd_ps(w, v2, a02), a03 = _mm512_fmadd_ps(w, v3, a03);
          w = _mm512_set1_ps(w1[s]);
          a10 = _mm512_fmadd_ps(w, v0, a10), a11 = _mm512_fmadd_ps(w, v1, a11);
          a12 = _mm512_fmadd_ps(w, v2, a12), a13 = _mm512_fmadd_ps(w, v3, a13);
          w = _mm512_set1_ps(w2[s]);
          a20 = _mm512_fmadd_ps(w, v0, a20), a21 = _mm512_fmadd_ps(w, v1, a21);
          a22 = _mm512_fmadd_ps(w, v2, a22), a23 = _mm512_fmadd_ps(w, v3, a23);
          w = _mm512_set1_ps(w3[s]);
          a30 = _mm512_fmadd_ps(w, v0, a30), a31 = _mm512_fmadd_ps(w, v1, a31);
          a32 = _mm512_fmadd_ps(w, v2, a32), a33 = _mm512_fmadd_ps(w, v3, a33);
        }
        const __m512 acc[4][4] = {{a00, a01, a02, a03}, {a10, a11, a12, a13}, {a20, a21, a22, a23},
                                  {a30, a31, a32, a33}};
        const __mmask16 mk[4] = {m0, m1, m2, m3};
        for (int i = 0; i < n; ++i) {
          float* o = out[i0 + i] + d0;
          for (int j = 0; j < 4; ++j)
            _mm512_mask_storeu_ps(o + 16 * j, mk[j],
                                  _mm512_add_ps(_mm512_maskz_loadu_ps(mk[j], o + 16 * j), acc[i][j]));
        }
      }
    }
  }
#else
  // The same tiles in 8-lane vectors: 4 query heads x 16 dims over a block of keys, then the dims past the last 16.
  const int64_t D16 = D / 16 * 16;
  for (int64_t sb = 0; sb < ns; sb += kValueBlock) {
    const int64_t se = std::min(ns, sb + kValueBlock);
    for (int64_t d0 = 0; d0 < D16; d0 += 16) {
      for (int64_t i0 = 0; i0 < nq; i0 += 4) {
        const int n = static_cast<int>(std::min<int64_t>(4, nq - i0));
        const float* w[4];
        for (int i = 0; i < 4; ++i) w[i] = p + (i0 + std::min(i, n - 1)) * ld;  // a short block repeats its last
        f8 acc[4][2] = {};
        const float* v = vbase + sb * vstride + d0;
        for (int64_t s = sb; s < se; ++s, v += vstride) {
          const f8 v0 = load8(v), v1 = load8(v + 8);
          for (int i = 0; i < 4; ++i) {
            acc[i][0] += w[i][s] * v0;
            acc[i][1] += w[i][s] * v1;
          }
        }
        for (int i = 0; i < n; ++i) {
          float* o = out[i0 + i] + d0;
          store8(o, load8(o) + acc[i][0]);
          store8(o + 8, load8(o + 8) + acc[i][1]);
        }
      }
    }
    for (int64_t i = 0; i < nq; ++i)
      for (int64_t s = sb; s < se; ++s)
        for (int64_t d = D16; d < D; ++d) out[i][d] += p[i * ld + s] * vbase[s * vstride + d];
  }
#endif
}

#if ATT_AVX512
// Lanes s.. s + 15 of `valid` (true: attend) within the first n as a mask; all of them without a mask.
inline __mmask16 valid_bits(const bool* valid, int64_t s, int64_t n) {
  const __mmask16 tail = tail_mask(n - s);
  if (valid == nullptr) return tail;
  __m128i bytes;
  if (n - s >= 16) {
    bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(valid + s));
  } else {
    alignas(16) bool buf[16] = {};
    std::copy(valid + s, valid + n, buf);
    bytes = _mm_load_si128(reinterpret_cast<const __m128i*>(buf));
  }
  return _mm512_test_epi32_mask(_mm512_cvtepu8_epi32(bytes), _mm512_set1_epi32(0xFF)) & tail;
}
#endif

// p[0, n) = exp(p - max) where valid (else 0), in place; returns the sum, and the max (-inf: none valid) in *max.
// AVX-512: both passes 16 lanes at a time under the mask built from `valid`'s bytes (a scalar max over a bool per
// key cost a tenth of the kernel with 32 query heads).
inline float softmax_num(float* p, const bool* valid, int64_t n, float* max) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
#if ATT_AVX512
  __m512 mxv = _mm512_set1_ps(kNegInf);
  for (int64_t s = 0; s < n; s += 16) {
    const __mmask16 m = valid_bits(valid, s, n);
    mxv = _mm512_mask_max_ps(mxv, m, mxv, _mm512_maskz_loadu_ps(m, p + s));
  }
  const float mx = _mm512_reduce_max_ps(mxv);
#else
  float mx = kNegInf;
  for (int64_t s = 0; s < n; ++s)
    if (valid == nullptr || valid[s]) mx = std::max(mx, p[s]);
#endif
  *max = mx;
  if (mx == kNegInf) {
    std::fill_n(p, n, 0.f);
    return 0.f;
  }
  float sum = 0.f;
#if ATT_AVX512
  const __m512 mv = _mm512_set1_ps(mx);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t s = 0; s < n; s += 16) {
    const __mmask16 m = valid_bits(valid, s, n);
    const __m512 e = _mm512_maskz_mov_ps(m, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, p + s), mv)));
    _mm512_mask_storeu_ps(p + s, tail_mask(n - s), e);
    acc = _mm512_add_ps(acc, e);
  }
  sum = _mm512_reduce_add_ps(acc);
#else
  f8 acc = {};
  int64_t s = 0;
  for (; s + 8 <= n; s += 8) {
    f8 e = exp8(load8(p + s) - mx);
    if (valid != nullptr)
      for (int l = 0; l < 8; ++l) e[l] = valid[s + l] ? e[l] : 0.f;
    store8(p + s, e);
    acc += e;
  }
  sum = sum8(acc);
  for (; s < n; ++s) {
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
                         const c10::optional<torch::Tensor>& extra_v, const c10::optional<torch::Tensor>& leader,
                         int64_t shared_lo, int64_t shared_hi) {
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
  // Groups of rows by leader (each row its own without one), in order of first appearance.
  std::vector<int64_t> lead(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) lead[b] = b;
  int64_t lo = 0, hi = 0;
  if (leader.has_value()) {
    TORCH_CHECK(leader->dim() == 1 && leader->size(0) == B && leader->scalar_type() == torch::kInt64 &&
                    leader->device().is_cpu() && leader->is_contiguous(),
                "attend_one: leader must be a contiguous (B,) int64 CPU tensor");
    TORCH_CHECK(0 <= shared_lo && shared_lo <= shared_hi && shared_hi <= S,
                "attend_one: the shared slots must lie in [0, S)");
    const int64_t* lp = leader->data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(0 <= lp[b] && lp[b] < B, "attend_one: leader indices must be rows");
      lead[b] = lp[b];
    }
    lo = shared_lo;
    hi = shared_hi;
  }
  std::vector<std::vector<int64_t>> groups;
  {
    std::vector<int64_t> index(static_cast<size_t>(B), -1);
    for (int64_t b = 0; b < B; ++b) {
      int64_t& gi = index[lead[b]];
      if (gi < 0) {
        gi = static_cast<int64_t>(groups.size());
        groups.emplace_back();
      }
      groups[gi].push_back(b);
    }
  }
  const int64_t NG = static_cast<int64_t>(groups.size());
  // Key chunks: enough work items for every thread, no chunk under 64 keys.
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t C = std::max<int64_t>(1, std::min((threads + NG * G - 1) / (NG * G), T / 64));
  const int64_t span = (T + C - 1) / C;

  auto out = torch::zeros({B, H, D}, q.options());
  // Per chunk partials when C > 1: the chunk's max and sum of each (row, head), its unnormalised output.
  std::vector<float> part_m, part_l, part_o;
  if (C > 1) {
    part_m.assign(static_cast<size_t>(C * B * H), -std::numeric_limits<float>::infinity());
    part_l.assign(static_cast<size_t>(C * B * H), 0.f);
    part_o.assign(static_cast<size_t>(C * B * H * D), 0.f);
  }
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
  at::parallel_for(0, NG * G * C, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> p;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t c = i % C, g = (i / C) % G;
      const std::vector<int64_t>& rows = groups[i / (C * G)];
      const int64_t n = static_cast<int64_t>(rows.size());
      const int64_t c0 = c * span, c1 = std::min(T, c0 + span), L = c1 - c0;
      if (L <= 0) continue;
      const int64_t Q = n * R;  // the group's query heads of KV head g: row rows[j], head r at j * R + r
      p.assign(static_cast<size_t>(Q * L), 0.f);
      std::vector<const float*> qs(static_cast<size_t>(Q));
      std::vector<float*> os(static_cast<size_t>(Q));
      for (int64_t j = 0; j < n; ++j)
        for (int r = 0; r < R; ++r) {
          const int64_t bh = rows[j] * H + g * R + r;
          qs[j * R + r] = qp + bh * D;
          os[j * R + r] = C > 1 ? part_o.data() + (c * B * H + bh) * D : op + bh * D;
        }
      // The chunk's cached keys in three runs: own slots before the shared ones, the shared, own after; then the
      // extra key when the chunk reaches it. Shared runs are scored for every query head of the group at once.
      const int64_t e = std::min(c1, S);
      const int64_t s_lo = std::clamp(lo, c0, std::max(c0, e)), s_hi = std::clamp(hi, s_lo, std::max(s_lo, e));
      const int64_t lb = lead[rows[0]];
      // run(first query head, query heads, the run's first key, its first value, first slot, slots) for each run, in
      // the same order for the scores and the weighted values (rows kss / vss apart; the extra key is a run of one).
      auto runs = [&](auto&& run) {
        for (int64_t j = 0; j < n; ++j) {
          const int64_t b = rows[j];
          if (s_lo > c0)
            run(j * R, R, kp + b * ksb + g * ksg + c0 * kss, vp + b * vsb + g * vsg + c0 * vss, c0, s_lo - c0);
          if (e > s_hi)
            run(j * R, R, kp + b * ksb + g * ksg + s_hi * kss, vp + b * vsb + g * vsg + s_hi * vss, s_hi, e - s_hi);
        }
        if (s_hi > s_lo)
          run(0, Q, kp + lb * ksb + g * ksg + s_lo * kss, vp + lb * vsb + g * vsg + s_lo * vss, s_lo, s_hi - s_lo);
        if (X && c1 > S)
          for (int64_t j = 0; j < n; ++j)
            run(j * R, R, ekp + (rows[j] * G + g) * D, evp + (rows[j] * G + g) * D, S, 1);
      };
      runs([&](int64_t q0, int64_t nq, const float* kb, const float*, int64_t s0, int64_t ns) {
        score_block(qs.data() + q0, nq, kb, kss, ns, D, p.data() + q0 * L + (s0 - c0), L);
      });
      // Softmax numerators per (row, head) over the chunk, under each row's mask.
      std::vector<float> m(static_cast<size_t>(Q)), l(static_cast<size_t>(Q));
      for (int64_t j = 0; j < n; ++j) {
        const bool* valid = mp == nullptr ? nullptr : mp + rows[j] * T + c0;
        for (int r = 0; r < R; ++r) l[j * R + r] = softmax_num(p.data() + (j * R + r) * L, valid, L, &m[j * R + r]);
      }
      runs([&](int64_t q0, int64_t nq, const float*, const float* vb, int64_t s0, int64_t ns) {
        weigh_block(p.data() + q0 * L + (s0 - c0), L, nq, os.data() + q0, vb, vss, ns, D);
      });
      for (int64_t j = 0; j < n; ++j)
        for (int r = 0; r < R; ++r) {
          const int64_t bh = rows[j] * H + g * R + r;
          if (C > 1) {
            part_m[c * B * H + bh] = m[j * R + r];
            part_l[c * B * H + bh] = l[j * R + r];
          } else {
            const float inv = l[j * R + r] > 0.f ? 1.f / l[j * R + r] : 0.f;
            float* o = op + bh * D;
            for (int64_t d = 0; d < D; ++d) o[d] *= inv;
          }
        }
    }
  });
  if (C > 1) {  // merge the chunks' partial softmaxes: sum_c e^(m_c - M) o_c / sum_c e^(m_c - M) l_c
    at::parallel_for(0, B * H, 1, [&](int64_t i0, int64_t i1) {
      for (int64_t bh = i0; bh < i1; ++bh) {
        float M = -std::numeric_limits<float>::infinity();
        for (int64_t c = 0; c < C; ++c) M = std::max(M, part_m[c * B * H + bh]);
        float* o = op + bh * D;
        if (M == -std::numeric_limits<float>::infinity()) continue;  // every key masked: 0, as in one chunk
        float total = 0.f;
        for (int64_t c = 0; c < C; ++c) {
          const float mc = part_m[c * B * H + bh];
          if (mc == -std::numeric_limits<float>::infinity()) continue;
          const float w = std::exp(mc - M);
          total += w * part_l[c * B * H + bh];
          axpy(w, part_o.data() + (c * B * H + bh) * D, o, D);
        }
        const float inv = total > 0.f ? 1.f / total : 0.f;
        for (int64_t d = 0; d < D; ++d) o[d] *= inv;
      }
    });
  }
  return out;
}
