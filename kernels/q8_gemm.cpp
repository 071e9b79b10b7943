// Q8 GEMM for the CPU: out (M, N) fp32 = x (M, K) fp32 @ w (N, K)^T, w int8 per block of 32 along K with a bf16
// scale per (block, channel) (llama.cpp's Q8_0 for the weights), x quantised here to int8 per block of 32 along K
// (an outlier only coarsens its own block, in either operand).
//
// Owned by kernels/q8_gemm.py (the torch reference, the validating launcher and the build). Contract, checked there
// and again here: x (M, K) fp32 contiguous; wq (G, Kp / 4, 64) uint8 contiguous, the weights packed in groups of 16
// output channels: byte [g][k4][4 c + j] = w[16 g + c][4 k4 + j] + 128 (w in [-127, 127]), Kp = K rounded up to a
// multiple of 32, G = N rounded up to 16, over 16; the padding (columns past K, channels past N) is 128 (w = 0);
// wscale (Kp / 32, N) bf16 contiguous, the scale of each (block, channel), block-major so a group's 16 scales of
// one block are adjacent; kmask, optional, (K,) fp32 of 0 and 1: x is multiplied by it before quantisation (0 on
// the columns whose weights are negligible in every row: an activation there contributes nothing, so it must not
// set its block's scale). x is read as zero-padded to Kp (the last block of 32 quantised over its real elements).
//
// Why this layout (oneDNN's and llama.cpp's VNNI layout): one `vpdpbusd` multiplies 4 bytes of one activation row,
// broadcast, by 4 bytes of K for 16 output channels, so an int32 register holds 16 channels' partial dot products.
// A block of 32 along K is 8 of them, then one convert and one fused multiply-add by the block's two scales
// (activation row x weight channels): 11 uops per 512 MACs, no horizontal reduction, and each register of weights
// serves MT activation rows. (The earlier layout, weight rows along K, needed a convert + FMA per 64 MACs and a
// horizontal sum per (row, channel) pair: compute-bound at 3x below VNNI's rate from 8 rows up.)
//
// Why a weight scale per block and not per channel: one scale a row of 640-2048 weights is set by its largest, and
// the converted Gemma's rows mix blocks of very different size; per-channel int8 cost the default build's probe NLL
// 1.0034-1.0062x fp32 by kind (over the 1.005x gate on news and code), per block 1.0015-1.0036x (BENCHMARKS.md,
// issue 31). The scales are bf16 rounded up (so no weight is clamped): 1/16 more bytes than the int8 weights.
//
// Why the weights carry the +128 offset and not the activations: `vpdpbusd` multiplies unsigned bytes by signed
// bytes. With u = w + 128, sum_k u*x = sum_k w*x + 128 * sum_k x, and the correction depends on the activations
// alone: each block's int32 accumulators start from -128 * the sum of the row's quantised block (`bias`), so after
// the 8 dot products they hold sum w*x exactly. (The AVX2 and scalar paths subtract 128 from the weights instead.)
//
// Numerics: exact int32 dot products per block of 32, fp32 accumulation of the block results times the product of
// the block's two scales, in block order (the AVX2 path too: its output is the VNNI path's bit for bit). The torch
// reference is a float GEMM of the dequantised operands: the kernel agrees with it to fp32 rounding, not bit for bit.
//
// AMX (where the CPU has amx_int8 and the OS grants the tile state; `q8_amx(false)` turns it off): from 8 rows up, rows
// in tiles of 8 run on the tile unit (the last M % 8 on VNNI). The packed group above is exactly an AMX B tile: a
// block of 32 along K is 8 rows of 64 bytes (4 bytes of K for 16 channels), so `tdpbsud` (signed activations x
// unsigned weights) takes it straight from the weights, 8 rows x 16 channels x 32 K in one instruction, into an int32
// tile; the tile is stored to L1 and each row's 16 sums get the same bias, convert and FMA as the VNNI path, in the
// same order: the output is bit for bit the VNNI path's (the int32 block sums are exact either way). Why: at 8 rows
// the VNNI loop spends 8 `vpdpbusd` a row per group and block, the tile one instruction for all 8 rows, which leaves
// the conversions.
//
// Memory: no heap allocation per call beyond the output (the quantised activations live in thread-local buffers
// that grow to the largest call). Threads: at::parallel_for over tiles of channel groups (torch's intra-op pool,
// its OpenMP runtime); each tile of weights is read once from memory and reused from cache for every row of x.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define Q8_AVX512_VNNI 1
#include <immintrin.h>
#if defined(__linux__) && defined(__GNUC__) && (__GNUC__ >= 11 || defined(__clang__))
#define Q8_AMX 1  // compiled per function (target attribute); used only where cpuid and the kernel allow it
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#define Q8_AVX2 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t QK = 32;   // activation block along K
constexpr int64_t GN = 16;   // output channels per packed group (one zmm of int32)
constexpr int64_t GB = 64;   // bytes of a group per 4 bytes of K
constexpr int64_t PF = 4;    // blocks of 32 along K the AVX-512 tile prefetches its weights ahead

// The activations of one call, quantised: q (M, Kp) int8 (zero past K), d (M, Kp / QK) block scales, bias
// (M, Kp / QK) int32 = -128 * the sum of each block of q (the +128 weight offset's correction, see above).
struct QuantX {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> bias;
};

QuantX& scratch() {
  thread_local QuantX qx;  // grows to the largest call on this thread, never shrinks: no allocation per step
  return qx;
}

// One row's block: x[0, n) (n <= 32; read as zero-padded to 32), times the live-column mask km where given ->
// q[0, 32), the scale and the bias.
inline void quantize_block(const float* x, const float* km, int64_t n, int8_t* q, float* d, int32_t* bias) {
#if Q8_AVX512_VNNI
  const __mmask16 m0 = n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
  const __mmask16 m1 = n >= 32 ? 0xFFFF : n <= 16 ? 0 : static_cast<__mmask16>((1u << (n - 16)) - 1);
  __m512 a = _mm512_maskz_loadu_ps(m0, x), b = _mm512_maskz_loadu_ps(m1, x + 16);
  if (km != nullptr) {
    a = _mm512_mul_ps(a, _mm512_maskz_loadu_ps(m0, km));
    b = _mm512_mul_ps(b, _mm512_maskz_loadu_ps(m1, km + 16));
  }
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const float dd = amax / 127.f;
  const __m512 inv = _mm512_set1_ps(dd > 0.f ? 1.f / dd : 0.f);
  // Round half to even (the reference's torch.round), exact: |x * inv| <= 127.
  const __m512i qa = _mm512_cvt_roundps_epi32(_mm512_mul_ps(a, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512i qb = _mm512_cvt_roundps_epi32(_mm512_mul_ps(b, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(qb));
  *bias = -128 * _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
  *d = dd;
#elif Q8_AVX2
  // The same operations as above, 8 lanes at a time: one rounding for x * inv, then to the nearest integer, ties to
  // even (the MXCSR default), so both paths quantise alike (a scalar x * inv + 1.5 * 2^23 may be fused into one FMA
  // and round differently).
  alignas(32) float xm[QK] = {};
  for (int64_t i = 0; i < n; ++i) xm[i] = km != nullptr ? x[i] * km[i] : x[i];
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 mx = _mm256_setzero_ps();
  for (int j = 0; j < QK / 8; ++j) mx = _mm256_max_ps(mx, _mm256_and_ps(_mm256_load_ps(xm + 8 * j), abs_mask));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mx);
  const float amax = *std::max_element(lanes, lanes + 8);
  const float dd = amax / 127.f;
  const __m256 inv = _mm256_set1_ps(dd > 0.f ? 1.f / dd : 0.f);
  alignas(32) int32_t qi[QK];
  for (int j = 0; j < QK / 8; ++j)
    _mm256_store_si256(reinterpret_cast<__m256i*>(qi + 8 * j),
                       _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_load_ps(xm + 8 * j), inv)));
  int32_t sum = 0;
  for (int i = 0; i < QK; ++i) {
    q[i] = static_cast<int8_t>(qi[i]);
    sum += qi[i];
  }
  *bias = -128 * sum;
  *d = dd;
#else
  float xm[QK];
  for (int64_t i = 0; i < n; ++i) xm[i] = km != nullptr ? x[i] * km[i] : x[i];
  float amax = 0.f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(xm[i]));
  const float dd = amax / 127.f;
  const float inv = dd > 0.f ? 1.f / dd : 0.f;
  int32_t sum = 0;
  for (int64_t i = 0; i < QK; ++i) {
    // Round half to even by the 1.5 * 2^23 trick (exact for |t| < 2^22; here |t| <= 127): what nearbyint gives in
    // the default mode, without its libm call per element.
    const float t = i < n ? xm[i] * inv : 0.f;
    const int32_t v = static_cast<int32_t>((t + 12582912.f) - 12582912.f);
    q[i] = static_cast<int8_t>(v);
    sum += v;
  }
  *bias = -128 * sum;
  *d = dd;
#endif
}

void quantize_rows(const float* x, const float* km, int64_t M, int64_t K, int64_t Kp, QuantX& out) {
  const int64_t nb = Kp / QK;
  if (static_cast<int64_t>(out.q.size()) < M * Kp) out.q.resize(M * Kp);
  if (static_cast<int64_t>(out.d.size()) < M * nb) {
    out.d.resize(M * nb);
    out.bias.resize(M * nb);
  }
  int8_t* q = out.q.data();
  float* d = out.d.data();
  int32_t* bias = out.bias.data();
  auto body = [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t b = 0; b < nb; ++b)
        quantize_block(x + m * K + b * QK, km == nullptr ? nullptr : km + b * QK, std::min<int64_t>(QK, K - b * QK),
                       q + m * Kp + b * QK,
                       d + m * nb + b, bias + m * nb + b);
  };
  if (M * K < 65536) {
    body(0, M);  // a decode step's few rows: waking the pool costs more than the work
  } else {
    at::parallel_for(0, M, std::max<int64_t>(1, 16384 / K), body);
  }
}

// Everything a tile needs: the packed weights, the quantised activations, the weights' block scales and the output.
struct Args {
  const uint8_t* w;
  const int8_t* xq;
  const float* xd;
  const int32_t* xb;
  const uint16_t* ws;  // (nb, N) bf16 bits
  float* out;
  int64_t M, N, Kp, nb;
};

#if Q8_AVX512_VNNI
// The real channels of group `group` (the last group of an N that is not a multiple of 16 has fewer).
inline __mmask16 live_mask(const Args& a, int64_t group) {
  const int64_t n = std::min<int64_t>(GN, a.N - group * GN);
  return n >= GN ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
}

// Block b's weight scales of group `group`, 16 channels: bf16 -> fp32 is a 16-bit shift.
inline __m512 block_scales(const Args& a, int64_t b, int64_t group, __mmask16 live) {
  const __m256i bits = _mm256_maskz_loadu_epi16(live, a.ws + b * a.N + group * GN);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// Accumulators to zero and the groups' live channels: the start of every tile (VNNI and AMX).
template <int R, int NT>
inline void start_tile(const Args& a, int64_t g, __m512 (&acc)[R][NT], __mmask16 (&live)[NT]) {
#pragma GCC unroll 8
  for (int t = 0; t < NT; ++t) live[t] = live_mask(a, g + t);
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t) acc[i][t] = _mm512_setzero_ps();
}

// MT activation rows from m x NT channel groups from g: 2 * MT * NT accumulators + NT weight registers (<= 32).
template <int MT, int NT>
inline void tile(const Args& a, int64_t m, int64_t g) {
  const int64_t gstride = (a.Kp / 4) * GB;  // bytes of one packed group
  const uint8_t* w = a.w + g * gstride;
  __mmask16 live[NT];
  __m512 acc[MT][NT];
  start_tile(a, g, acc, live);
  for (int64_t b = 0; b < a.nb; ++b) {
    __m512i dot[MT][NT];
#pragma GCC unroll 8
    for (int i = 0; i < MT; ++i) {
      const __m512i bias = _mm512_set1_epi32(a.xb[(m + i) * a.nb + b]);
#pragma GCC unroll 8
      for (int t = 0; t < NT; ++t) dot[i][t] = bias;
    }
    const uint8_t* wb = w + b * (QK / 4) * GB;
    const int8_t* xq = a.xq + m * a.Kp + b * QK;
    // Prefetch each group's weights PF blocks ahead: at 8 rows the tile's dot products take about as long as
    // reading its weights, and the hardware prefetcher alone leaves the two in series (PF 2-8 measured, 4 best;
    // BENCHMARKS.md, "Kernels").
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t)
#pragma GCC unroll 8
      for (int l = 0; l < (QK / 4) * GB / 64; ++l)  // never faults: a prefetch past the weights is dropped
        _mm_prefetch(reinterpret_cast<const char*>(wb + t * gstride + PF * (QK / 4) * GB + 64 * l), _MM_HINT_T0);
#pragma GCC unroll 8
    for (int s = 0; s < QK / 4; ++s) {
      __m512i wv[NT];
#pragma GCC unroll 8
      for (int t = 0; t < NT; ++t) wv[t] = _mm512_loadu_si512(wb + t * gstride + s * GB);
#pragma GCC unroll 8
      for (int i = 0; i < MT; ++i) {
        int32_t x4;
        std::memcpy(&x4, xq + i * a.Kp + s * 4, 4);
        const __m512i xv = _mm512_set1_epi32(x4);
#pragma GCC unroll 8
        for (int t = 0; t < NT; ++t) dot[i][t] = _mm512_dpbusd_epi32(dot[i][t], wv[t], xv);
      }
    }
    __m512 sc[NT];
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t) sc[t] = block_scales(a, b, g + t, live[t]);
#pragma GCC unroll 8
    for (int i = 0; i < MT; ++i) {
      const __m512 dv = _mm512_set1_ps(a.xd[(m + i) * a.nb + b]);
#pragma GCC unroll 8
      for (int t = 0; t < NT; ++t)
        acc[i][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i][t]), _mm512_mul_ps(dv, sc[t]), acc[i][t]);
    }
  }
#pragma GCC unroll 8
  for (int t = 0; t < NT; ++t) {
    const int64_t n = (g + t) * GN;
#pragma GCC unroll 8
    for (int i = 0; i < MT; ++i) _mm512_mask_storeu_ps(a.out + (m + i) * a.N + n, live[t], acc[i][t]);
  }
}
#elif Q8_AVX2
// AVX2 has no dot of unsigned by signed bytes that cannot saturate: `maddubs` multiplies them into int16 pairs, and
// 255 * 127 * 2 overflows int16. So, as llama.cpp's Q8_0 dot does, the weights are made signed (u XOR 0x80 = u - 128
// = w) and their sign moved onto the activations: |w| (<= 128 as unsigned) times sign(w) * x (|x| <= 127) sums a pair
// to at most 2 * 128 * 127 < 2^15, exact; `madd` with ones sums the pairs into int32. A ymm holds 8 channels x 4
// bytes of K, and each weight vector's |w| and sign serve the tile's MT rows (the weights are read once per tile).
// The block's exact int32 sums then get the VNNI path's convert and FMA by the two scales, in block order, into a
// small fp32 buffer: the output is the VNNI path's bit for bit.
template <int MT, int NT>
inline void tile(const Args& a, int64_t m, int64_t g) {
  static_assert(NT == 1, "the AVX2 path tiles one group of 16 channels");
  const uint8_t* w = a.w + g * (a.Kp / 4) * GB;
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t live = std::min<int64_t>(GN, a.N - g * GN);
  alignas(32) float acc[MT][GN] = {};
  alignas(32) uint16_t tail[GN];
  for (int64_t b = 0; b < a.nb; ++b) {
    __m256i dot[MT][2];
#pragma GCC unroll 4
    for (int i = 0; i < MT; ++i) dot[i][0] = dot[i][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int s = 0; s < QK / 4; ++s) {
      const uint8_t* ws = w + (b * (QK / 4) + s) * GB;
      const __m256i w0 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ws)), flip);
      const __m256i w1 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ws + 32)), flip);
      const __m256i a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1);
#pragma GCC unroll 4
      for (int i = 0; i < MT; ++i) {
        int32_t x4;
        std::memcpy(&x4, a.xq + (m + i) * a.Kp + b * QK + s * 4, 4);
        const __m256i xv = _mm256_set1_epi32(x4);  // 4 bytes of K, for every channel
        dot[i][0] = _mm256_add_epi32(dot[i][0], _mm256_madd_epi16(_mm256_maddubs_epi16(a0, _mm256_sign_epi8(xv, w0)),
                                                                   ones));
        dot[i][1] = _mm256_add_epi32(dot[i][1], _mm256_madd_epi16(_mm256_maddubs_epi16(a1, _mm256_sign_epi8(xv, w1)),
                                                                   ones));
      }
    }
    const uint16_t* wsb = a.ws + b * a.N + g * GN;  // the block's 16 channel scales (bf16)
    if (live < GN) {  // the last group of an N that is not a multiple of 16: never read past the row
      std::memset(tail, 0, sizeof(tail));
      std::memcpy(tail, wsb, live * sizeof(uint16_t));
      wsb = tail;
    }
    __m256 sc[2];
    for (int h = 0; h < 2; ++h)  // bf16 -> fp32 is a 16-bit shift
      sc[h] = _mm256_castsi256_ps(_mm256_slli_epi32(
          _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wsb + 8 * h))), 16));
#pragma GCC unroll 4
    for (int i = 0; i < MT; ++i) {
      const __m256 dv = _mm256_set1_ps(a.xd[(m + i) * a.nb + b]);
      for (int h = 0; h < 2; ++h)
        _mm256_store_ps(acc[i] + 8 * h, _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[i][h]), _mm256_mul_ps(dv, sc[h]),
                                                        _mm256_load_ps(acc[i] + 8 * h)));
    }
  }
  for (int i = 0; i < MT; ++i) std::memcpy(a.out + (m + i) * a.N + g * GN, acc[i], live * sizeof(float));
}
#else
// Portable fallback: the same arithmetic, scalar.
template <int MT, int NT>
inline void tile(const Args& a, int64_t m, int64_t g) {
  static_assert(MT == 1 && NT == 1, "the scalar path tiles one row by one group");
  const uint8_t* w = a.w + g * (a.Kp / 4) * GB;
  const int8_t* xq = a.xq + m * a.Kp;
  for (int64_t c = 0; c < GN && g * GN + c < a.N; ++c) {
    float acc = 0.f;
    for (int64_t b = 0; b < a.nb; ++b) {
      int32_t s = 0;
      for (int64_t k = b * QK; k < (b + 1) * QK; ++k)
        s += (static_cast<int32_t>(w[(k / 4) * GB + 4 * c + k % 4]) - 128) * static_cast<int32_t>(xq[k]);
      const uint32_t bits = static_cast<uint32_t>(a.ws[b * a.N + g * GN + c]) << 16;
      float sw;
      std::memcpy(&sw, &bits, 4);
      acc += static_cast<float>(s) * (a.xd[m * a.nb + b] * sw);
    }
    a.out[m * a.N + g * GN + c] = acc;
  }
}
#endif

// Rows in tiles of MT_MAX, then one shorter tile for the rest, for NT groups from g.
template <int MT_MAX, int NT>
inline void rows(const Args& a, int64_t g) {
  int64_t m = 0;
  for (; m + MT_MAX <= a.M; m += MT_MAX) tile<MT_MAX, NT>(a, m, g);
  const int64_t rest = a.M - m;
  if constexpr (MT_MAX >= 4) {
    if (rest == 3) return tile<3, NT>(a, m, g);
  }
  if constexpr (MT_MAX >= 3) {
    if (rest == 2) return tile<2, NT>(a, m, g);
  }
  if constexpr (MT_MAX >= 2) {
    if (rest == 1) return tile<1, NT>(a, m, g);
  }
}

// Register budget (AVX-512: 32 zmm): a tile of MT rows x NT groups holds 2 * MT * NT accumulators and NT weight
// registers. One to three rows: 4 groups (64 channels: enough independent dot chains to hide vpdpbusd's latency);
// four or more: 4 rows x 3 groups (28 registers; each weight register feeds 4 dot products).
// Tiles of `nt` groups a task: enough work to amortise waking a thread, ~64 KB of weights (more rows: less).
inline int64_t task_grain(const Args& a, int64_t nt) {
  const int64_t bytes = nt * (a.Kp / 4) * GB * std::max<int64_t>(1, a.M / 4);
  return std::max<int64_t>(1, 65536 / bytes);
}

template <int MT_MAX, int NT>
void run(const Args& a, int64_t groups) {
  const int64_t tiles = (groups + NT - 1) / NT;
  at::parallel_for(0, tiles, task_grain(a, NT), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t g = t * NT;
      if (g + NT <= groups) {
        rows<MT_MAX, NT>(a, g);
      } else {
        for (int64_t j = g; j < groups; ++j) rows<MT_MAX, 1>(a, j);
      }
    }
  });
}

#if Q8_AMX
#include "q8_amx.h"  // the AMX tile path: needs Args, tile and rows above
#endif

}  // namespace

bool q8_amx(bool wanted) {
#if Q8_AMX
  amx_wanted = wanted;
  return wanted && amx_granted();
#else
  (void)wanted;
  return false;
#endif
}

std::string q8_isa() {
#if Q8_AVX512_VNNI
  return "avx512_vnni";
#elif Q8_AVX2
  return "avx2";
#else
  return "scalar";
#endif
}

torch::Tensor q8_gemm(const torch::Tensor& x, const torch::Tensor& wq, const torch::Tensor& wscale,
                      const c10::optional<torch::Tensor>& kmask) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.device().is_cpu(),
              "q8_gemm: x must be a contiguous 2-D fp32 CPU tensor");
  TORCH_CHECK(wq.dim() == 3 && wq.size(2) == GB && wq.scalar_type() == torch::kUInt8 && wq.is_contiguous() &&
                  wq.device().is_cpu(), "q8_gemm: wq must be a contiguous (G, Kp / 4, 64) uint8 CPU tensor");
  TORCH_CHECK(wscale.dim() == 2 && wscale.scalar_type() == torch::kBFloat16 && wscale.is_contiguous() &&
                  wscale.device().is_cpu(), "q8_gemm: wscale must be a contiguous bf16 (Kp / 32, N) CPU tensor");
  const int64_t M = x.size(0), K = x.size(1), N = wscale.size(1), G = wq.size(0), Kp = wq.size(1) * 4;
  TORCH_CHECK(Kp % QK == 0 && Kp >= K && Kp - K < QK, "q8_gemm: wq's K width must be K rounded up to 32");
  TORCH_CHECK(wscale.size(0) == Kp / QK, "q8_gemm: wscale must hold one row of scales per block of 32 along K");
  TORCH_CHECK(G == (N + GN - 1) / GN, "q8_gemm: wq must hold N rounded up to 16 channels");
  if (kmask.has_value())
    TORCH_CHECK(kmask->dim() == 1 && kmask->size(0) == K && kmask->scalar_type() == torch::kFloat32 &&
                    kmask->is_contiguous(), "q8_gemm: kmask must be a contiguous fp32 (K,) tensor");
  auto out = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;

  QuantX& qx = scratch();
  quantize_rows(x.data_ptr<float>(), kmask.has_value() ? kmask->data_ptr<float>() : nullptr, M, K, Kp, qx);
  const Args a{wq.data_ptr<uint8_t>(), qx.q.data(), qx.d.data(), qx.bias.data(),
               reinterpret_cast<const uint16_t*>(wscale.data_ptr<at::BFloat16>()), out.data_ptr<float>(), M, N, Kp,
               Kp / QK};
#if Q8_AMX
  if (M >= AR && amx_wanted && amx_granted()) {
    run_amx(a, G);
    return out;
  }
#endif
#if Q8_AVX512_VNNI
  if (M >= 4) {
    run<4, 3>(a, G);
  } else {
    run<3, 4>(a, G);
  }
#elif Q8_AVX2
  run<4, 1>(a, G);
#else
  run<1, 1>(a, G);
#endif
  return out;
}
