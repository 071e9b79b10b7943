// Vector math shared by the CPU kernels (attend_cpu.cpp, act_cpu.cpp): exp, tanh and a refined reciprocal on 16
// fp32 lanes, and the lane mask of a vector's tail, for the AVX-512 builds; and, for every build, 8-lane vectors in
// GCC's vector extensions with their loads, stores, sum, max and exp (the paths of a CPU without AVX-512: with -mavx2 they
// compile to ymm FMAs; without, to SSE pairs). Header-only.

#pragma once

#include <cstdint>
#include <cstring>

namespace dcanvas_cpu {

// 8 fp32 / int32 lanes; memcpy loads and stores: no alignment or aliasing assumed, one vmovups each.
typedef float f8 __attribute__((vector_size(32)));
typedef int32_t i8 __attribute__((vector_size(32)));

inline f8 load8(const float* p) {
  f8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store8(float* p, f8 v) { std::memcpy(p, &v, sizeof(v)); }

inline float sum8(f8 v) { return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7])); }

inline float max8(f8 v) {
  float m = v[0];
  for (int l = 1; l < 8; ++l) m = m > v[l] ? m : v[l];
  return m;
}

// exp(x) lane by lane: exp512's range reduction and polynomial (Cephes' expf; within 2 ulp of libm), 2^n applied in
// two halves so every n in [-126, 128] stays a normal scale; under -87.3: a tiny value, as exp512's clamp gives.
inline f8 exp8(f8 x) {
  const f8 lo = f8{} - 87.33654f, hi = f8{} + 88.72283f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const f8 magic = f8{} + 12582912.f;  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const f8 n = (x * 1.44269504088896341f + magic) - magic;
  f8 r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  f8 q = f8{} + 1.9875691500E-4f;
  q = q * r + 1.3981999507E-3f;
  q = q * r + 8.3334519073E-3f;
  q = q * r + 4.1665795894E-2f;
  q = q * r + 1.6666665459E-1f;
  q = q * r + 5.0000001201E-1f;
  q = q * r * r + (r + 1.f);
  const i8 ni = __builtin_convertvector(n, i8), n1 = ni >> 1, n2 = ni - n1;
  return q * (f8)((n1 + 127) << 23) * (f8)((n2 + 127) << 23);
}

// tanh(x) lane by lane: tanh512's two pieces (an odd polynomial below |x| = 0.625, 1 - 2 / (exp(2|x|) + 1) with
// x's sign above), each lane taking its own; the exp and the division only when some lane needs them.
inline f8 tanh8(f8 x) {
  const f8 ax = x < 0.f ? -x : x;
  const f8 z = x * x;
  f8 q = f8{} - 5.70498872745E-3f;
  q = q * z + 2.06390887954E-2f;
  q = q * z - 5.37397155531E-2f;
  q = q * z + 1.33314422036E-1f;
  q = q * z - 3.33332819422E-1f;
  const f8 small = q * z * x + x;
  const i8 is_small = ax < 0.625f;  // -1 where small
  if ((is_small[0] & is_small[1] & is_small[2] & is_small[3] & is_small[4] & is_small[5] & is_small[6] &
       is_small[7]) != 0)
    return small;
  const f8 big = 1.f - 2.f / (exp8(ax + ax) + 1.f);
  return ax < 0.625f ? small : (x < 0.f ? -big : big);
}

}  // namespace dcanvas_cpu

#if defined(__AVX512F__)
#include <immintrin.h>

namespace dcanvas_cpu {

// exp(x) lane by lane: range reduction by ln 2, then a degree-6 polynomial (Cephes' expf; within 2 ulp of libm),
// clamped to fp32's range (under -87.3: 0 after scaling; over 88.7: inf).
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

// 1 / d for d >= 1: the 14-bit estimate and one Newton step (~23 bits), where a division would cost more than the
// rest of an element's work. d is capped at 1e30 first (1 / inf would give 0 * inf = NaN in the Newton step).
inline __m512 recip(__m512 d) {
  d = _mm512_min_ps(d, _mm512_set1_ps(1e30f));
  const __m512 r = _mm512_rcp14_ps(d);
  return _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.f)));
}

// tanh(x) lane by lane, to a few ulp relative everywhere: Cephes' tanhf, an odd polynomial below |x| = 0.625 (where
// 1 - 2 / (exp(2x) + 1) would cancel: its absolute error ~1e-7 is all of a small result), that formula above
// (saturating to +-1). When every lane is below 0.625 the exp is skipped (the same result: the blend would take the
// polynomial everywhere): the soft-capped logits' x / cap mostly are, and the exp is most of the work.
inline __m512 tanh512(__m512 x) {
  const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u));
  const __m512 ax = _mm512_castsi512_ps(_mm512_andnot_si512(sign, _mm512_castps_si512(x)));
  const __m512 z = _mm512_mul_ps(x, x);
  __m512 q = _mm512_set1_ps(-5.70498872745E-3f);
  q = _mm512_fmadd_ps(q, z, _mm512_set1_ps(2.06390887954E-2f));
  q = _mm512_fmadd_ps(q, z, _mm512_set1_ps(-5.37397155531E-2f));
  q = _mm512_fmadd_ps(q, z, _mm512_set1_ps(1.33314422036E-1f));
  q = _mm512_fmadd_ps(q, z, _mm512_set1_ps(-3.33332819422E-1f));
  const __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(q, z), x, x);
  const __mmask16 is_small = _mm512_cmp_ps_mask(ax, _mm512_set1_ps(0.625f), _CMP_LT_OQ);
  if (is_small == 0xFFFF) return small;
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 e = exp512(_mm512_add_ps(ax, ax));
  const __m512 big = _mm512_fnmadd_ps(_mm512_set1_ps(2.f), recip(_mm512_add_ps(e, one)), one);  // 1 - 2 / (e + 1)
  const __m512 signed_big =
      _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(big), _mm512_and_si512(sign, _mm512_castps_si512(x))));
  return _mm512_mask_blend_ps(is_small, signed_big, small);
}

// The first min(n, 16) lanes.
inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1); }

}  // namespace dcanvas_cpu
#endif
