// Q8 GEMM for the CPU: out (M, N) fp32 = x (M, K) fp32 @ w (N, K)^T, w int8 per output channel, x quantised here
// to int8 per block of 32 along K (Q8_0-like: an outlier only coarsens its own block).
//
// Owned by kernels/q8_gemm.py (the torch reference, the validating launcher and the build). Contract, checked there
// and again here: x (M, K) fp32 contiguous; wq (N, Kp) uint8 contiguous holding w + 128 (w in [-127, 127]),
// Kp = K rounded up to a multiple of 64 and the padding columns 128 (w = 0); wscale (N,) fp32. Any K: x is read as
// zero-padded to Kp (the last block of 32 quantised over its real elements).
//
// Why the weights carry the +128 offset and not the activations: the VNNI dot product (`vpdpbusd`) multiplies
// unsigned bytes by signed bytes. With u = w + 128 unsigned, sum_k u*x = sum_k w*x + 128 * sum_k x, and the
// correction depends on the activations alone: each int32 lane (4 bytes of K) starts from -128 * the sum of its 4
// activation bytes (`bias`, computed once per call), so after `vpdpbusd` it holds sum w*x exactly and the inner loop
// is dot, convert, fused multiply-add by the block scales. (The AVX2 and scalar paths widen w to int16 / int32 and
// subtract 128 there.) An all-zero weight row gives exactly 0.
//
// Numerics: exact int32 dot products per block of 32, fp32 accumulation of the scaled block results (then one
// multiply by the channel scale). Loop orders differ between ISA paths, so results agree to fp32 rounding.
//
// Threads: at::parallel_for over tiles of output channels (torch's intra-op pool, its OpenMP runtime). Each tile of
// weight rows is read once from memory and reused from L1 for every row of x: an 8-row step reads the weights once.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <string>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define Q8_AVX512_VNNI 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define Q8_AVX2 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t QK = 32;     // activation block along K
constexpr int64_t CHUNK = 64;  // bytes of K a 512-bit register holds: two blocks

// The activations of one call, quantised: q (M, Kp) int8, d (M, Kp / QK) block scales, bias (M, Kp / 4) int32
// = -128 * the sum of each 4 bytes of q (the +128 weight offset's correction, see above).
struct QuantX {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> bias;
};

void quantize_rows(const float* x, int64_t M, int64_t K, int64_t Kp, QuantX& out) {
  const int64_t nb = Kp / QK;
  out.q.assign(M * Kp, 0);
  out.d.assign(M * nb, 0.f);
  out.bias.assign(M * Kp / 4, 0);
  auto body = [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* row = x + m * K;
      int8_t* qrow = out.q.data() + m * Kp;
      int32_t* brow = out.bias.data() + m * (Kp / 4);
      for (int64_t b = 0; b * QK < K; ++b) {
        const float* xb = row + b * QK;
        const int64_t n = std::min<int64_t>(QK, K - b * QK);  // a last partial block reads as zero-padded
        float amax = 0.f;
        for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(xb[i]));
        const float d = amax / 127.f;
        const float inv = d > 0.f ? 1.f / d : 0.f;
        for (int64_t i = 0; i < n; ++i) {
          // Round half to even by the 1.5 * 2^23 trick (exact for |t| < 2^22; here |t| <= 127): what nearbyint
          // gives in the default mode, without its libm call per element, and vectorisable.
          const float t = xb[i] * inv;
          const int32_t v = static_cast<int32_t>((t + 12582912.f) - 12582912.f);
          qrow[b * QK + i] = static_cast<int8_t>(v);
          brow[(b * QK + i) / 4] -= 128 * v;
        }
        out.d[m * nb + b] = d;
      }
    }
  };
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1)), body);
}

#if Q8_AVX512_VNNI
// Rows of x in tiles of MT, weight rows in tiles of NT; MT * NT zmm accumulators (at most 16 of the 32 registers).
template <int MT, int NT>
inline void tile(const uint8_t* w, const int8_t* xq, const float* xs, const int32_t* xb, int64_t Kp, int64_t ldw,
                 int64_t ldx, float out[MT][NT]) {
  const int64_t nc = Kp / CHUNK;
  __m512 acc[MT][NT];
  for (int i = 0; i < MT; ++i)
    for (int t = 0; t < NT; ++t) acc[i][t] = _mm512_setzero_ps();
  for (int64_t c = 0; c < nc; ++c) {
    __m512i wv[NT];
    for (int t = 0; t < NT; ++t) wv[t] = _mm512_loadu_si512(w + t * ldw + c * CHUNK);
    for (int i = 0; i < MT; ++i) {
      const __m512i xv = _mm512_loadu_si512(xq + i * ldx + c * CHUNK);
      const __m512i bv = _mm512_loadu_si512(xb + (i * ldx + c * CHUNK) / 4);  // -128 * x, 4 bytes a lane
      const __m512 sv = _mm512_loadu_ps(xs + (i * nc + c) * 16);  // 8 lanes of block 2c's scale, 8 of 2c + 1's
      for (int t = 0; t < NT; ++t)
        acc[i][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(bv, wv[t], xv)), sv, acc[i][t]);
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int t = 0; t < NT; ++t) out[i][t] = _mm512_reduce_add_ps(acc[i][t]);
}
#elif Q8_AVX2
// AVX2 has no unsigned x signed byte dot without int16 saturation (`maddubs` saturates at 255 * 127 * 2), so the
// bytes widen to int16 (w less its offset) and `madd_epi16` sums pairs into int32 (exact).
template <int MT, int NT>
inline void tile(const uint8_t* w, const int8_t* xq, const float* xd, const int32_t*, int64_t Kp, int64_t ldw,
                 int64_t ldx, float out[MT][NT]) {
  const int64_t nb = Kp / QK;
  const __m256i off = _mm256_set1_epi16(128);
  __m256 acc[MT][NT];
  for (int i = 0; i < MT; ++i)
    for (int t = 0; t < NT; ++t) acc[i][t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256i wlo[NT], whi[NT];
    for (int t = 0; t < NT; ++t) {
      const __m256i wb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + t * ldw + b * QK));
      wlo[t] = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(wb)), off);
      whi[t] = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(wb, 1)), off);
    }
    for (int i = 0; i < MT; ++i) {
      const __m256i xb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + i * ldx + b * QK));
      const __m256i xlo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(xb));
      const __m256i xhi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(xb, 1));
      const __m256 sv = _mm256_set1_ps(xd[i * nb + b]);
      for (int t = 0; t < NT; ++t) {
        const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(wlo[t], xlo), _mm256_madd_epi16(whi[t], xhi));
        acc[i][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), sv, acc[i][t]);
      }
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int t = 0; t < NT; ++t) {
      const __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[i][t]), _mm256_extractf128_ps(acc[i][t], 1));
      const __m128 h = _mm_add_ps(s, _mm_movehl_ps(s, s));
      out[i][t] = _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
    }
}
#else
// Portable fallback: the same arithmetic, scalar.
template <int MT, int NT>
inline void tile(const uint8_t* w, const int8_t* xq, const float* xd, const int32_t*, int64_t Kp, int64_t ldw,
                 int64_t ldx, float out[MT][NT]) {
  const int64_t nb = Kp / QK;
  for (int i = 0; i < MT; ++i)
    for (int t = 0; t < NT; ++t) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        int32_t s = 0;
        for (int64_t k = b * QK; k < (b + 1) * QK; ++k)
          s += (static_cast<int32_t>(w[t * ldw + k]) - 128) * static_cast<int32_t>(xq[i * ldx + k]);
        acc += static_cast<float>(s) * xd[i * nb + b];
      }
      out[i][t] = acc;
    }
}
#endif

constexpr int NT_MAX = 4;
constexpr int MT_MAX = 4;

template <int NT>
void n_tile(const uint8_t* w, const QuantX& qx, const float* xs, int64_t stride_s, const float* wscale, int64_t n,
            int64_t M, int64_t Kp, int64_t N, float* out) {
  for (int64_t m = 0; m < M; m += MT_MAX) {
    const int64_t mt = std::min<int64_t>(MT_MAX, M - m);
    float r[MT_MAX][NT];
    const int8_t* xq = qx.q.data() + m * Kp;
    const int32_t* xb = qx.bias.data() + m * (Kp / 4);
    const float* s = xs + m * stride_s;
    switch (mt) {
      case 4: tile<4, NT>(w, xq, s, xb, Kp, Kp, Kp, r); break;
      case 3: tile<3, NT>(w, xq, s, xb, Kp, Kp, Kp, r); break;
      case 2: tile<2, NT>(w, xq, s, xb, Kp, Kp, Kp, r); break;
      default: tile<1, NT>(w, xq, s, xb, Kp, Kp, Kp, r); break;
    }
    for (int64_t i = 0; i < mt; ++i)
      for (int t = 0; t < NT; ++t) out[(m + i) * N + n + t] = wscale[n + t] * r[i][t];
  }
}

}  // namespace

std::string q8_isa() {
#if Q8_AVX512_VNNI
  return "avx512_vnni";
#elif Q8_AVX2
  return "avx2";
#else
  return "scalar";
#endif
}

torch::Tensor q8_gemm(const torch::Tensor& x, const torch::Tensor& wq, const torch::Tensor& wscale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.device().is_cpu(),
              "q8_gemm: x must be a contiguous 2-D fp32 CPU tensor");
  TORCH_CHECK(wq.dim() == 2 && wq.scalar_type() == torch::kUInt8 && wq.is_contiguous() && wq.device().is_cpu(),
              "q8_gemm: wq must be a contiguous 2-D uint8 CPU tensor");
  TORCH_CHECK(wscale.dim() == 1 && wscale.scalar_type() == torch::kFloat32 && wscale.is_contiguous() &&
                  wscale.size(0) == wq.size(0), "q8_gemm: wscale must be a contiguous fp32 (N,) tensor");
  const int64_t M = x.size(0), K = x.size(1), N = wq.size(0), Kp = wq.size(1);
  TORCH_CHECK(Kp % CHUNK == 0 && Kp >= K && Kp - K < CHUNK, "q8_gemm: wq's width must be K rounded up to 64");
  auto out = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;

  QuantX qx;
  quantize_rows(x.data_ptr<float>(), M, K, Kp, qx);
  const int64_t nb = Kp / QK;
#if Q8_AVX512_VNNI
  // Each chunk's two block scales spread over the 16 lanes their dot products land in (vpdpbusd: lane j sums
  // bytes 4j..4j+3, so lanes 0-7 are block 2c and 8-15 block 2c + 1).
  std::vector<float> spread(M * nb * 8);
  for (int64_t i = 0; i < M * nb; ++i) std::fill_n(spread.data() + i * 8, 8, qx.d[i]);
  const float* xs = spread.data();
  const int64_t stride_s = nb * 8;
#else
  const float* xs = qx.d.data();
  const int64_t stride_s = nb;
#endif
  const uint8_t* w = wq.data_ptr<uint8_t>();
  const float* ws = wscale.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t tiles = (N + NT_MAX - 1) / NT_MAX;
  // Enough work per task to amortise waking a thread: ~64 KB of weights.
  const int64_t grain = std::max<int64_t>(1, 65536 / (NT_MAX * Kp));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n = t * NT_MAX;
      if (n + NT_MAX <= N) {
        n_tile<NT_MAX>(w + n * Kp, qx, xs, stride_s, ws, n, M, Kp, N, o);
      } else {
        for (int64_t j = n; j < N; ++j) n_tile<1>(w + j * Kp, qx, xs, stride_s, ws, j, M, Kp, N, o);
      }
    }
  });
  return out;
}
