// The AMX tile path of q8_gemm.cpp (see "AMX" in its header comment), included by it inside its anonymous namespace
// after the VNNI path: it uses that file's Args, rows, start_tile, block_scales, task_grain, QK, GN, GB and PF. It is
// compiled only in its AVX-512 VNNI build (Q8_AMX), per function for the tile instructions, so the binary runs on CPUs
// without AMX.
//
// Owns: amx_granted (cpuid and the OS permission, asked once per process), amx_wanted (q8_amx, DCANVAS_Q8_AMX),
// the tile configuration, and run_amx (the GEMM for 8 rows or more). Invariant: its output is the VNNI path's bit
// for bit (exact int32 block sums, then the same bias, convert and FMA per row in block order).

#pragma once

constexpr int AR = 8;  // activation rows per AMX tile (A and C tiles: 8 rows)
constexpr int AT = 2;  // channel groups per A tile load: C tiles tmm2, tmm3 (16 accumulators in zmm)

// Whether the tile unit may be used: the CPU reports AMX-TILE and AMX-INT8 (cpuid leaf 7, edx bits 24, 25) and
// Linux grants this process the tile data state (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA; without
// it the first tile instruction faults). Asked once per process.
bool amx_granted() {
  static const bool ok = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    if (((edx >> 24) & 1u) == 0 || ((edx >> 25) & 1u) == 0) return false;
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return ok;
}

// q8_amx(false), or DCANVAS_Q8_AMX=off in the environment: the VNNI path everywhere (to compare the two, or to rule
// the tiles out).
bool amx_wanted = [] {
  const char* env = std::getenv("DCANVAS_Q8_AMX");
  return env == nullptr || std::string(env) != "off";
}();

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0: A, AR rows of one block of 32 activations; tmm1: B, one group's block (8 rows of 64 bytes); tmm2-5: C,
// two sets of AT (even and odd blocks).
__attribute__((target("amx-tile,amx-int8"))) void amx_configure() {
  TileConfig cfg;
  cfg.rows[0] = AR;
  cfg.colsb[0] = QK;
  cfg.rows[1] = QK / 4;
  cfg.colsb[1] = GB;
  for (int t = 2; t < 2 + 2 * AT; ++t) {
    cfg.rows[t] = AR;
    cfg.colsb[t] = GN * 4;
  }
  _tile_loadconfig(&cfg);
}

// Block b's int32 sums for NT groups from g into c (NT x AR x 16), through the C tiles T0, T0 + 1.
template <int NT, int T0>
__attribute__((target("amx-tile,amx-int8"))) inline void amx_block(const Args& a, int64_t m, int64_t g, int64_t b,
                                                                   int32_t* c) {
  const int64_t gstride = (a.Kp / 4) * GB;
  const uint8_t* wb = a.w + g * gstride + b * (QK / 4) * GB;
  for (int l = 0; l < (QK / 4) * GB / 64; ++l)  // the weights PF blocks ahead, as the VNNI tile does
    for (int t = 0; t < NT; ++t)
      _mm_prefetch(reinterpret_cast<const char*>(wb + t * gstride + PF * (QK / 4) * GB + 64 * l), _MM_HINT_T0);
  _tile_loadd(0, a.xq + m * a.Kp + b * QK, a.Kp);
  // GCC's tile intrinsics paste the register number into the assembly text: literals only, hence the macro.
#define Q8_AMX_BLOCK(C0, C1)                      \
  _tile_zero(C0);                                 \
  _tile_loadd(1, wb, GB);                         \
  _tile_dpbsud(C0, 0, 1);                         \
  if constexpr (NT == 2) {                        \
    _tile_zero(C1);                               \
    _tile_loadd(1, wb + gstride, GB);             \
    _tile_dpbsud(C1, 0, 1);                       \
  }                                               \
  _tile_stored(C0, c, GN * 4);                    \
  if constexpr (NT == 2) _tile_stored(C1, c + AR * GN, GN * 4);
  if constexpr (T0 == 2) {
    Q8_AMX_BLOCK(2, 3)
  } else {
    Q8_AMX_BLOCK(4, 5)
  }
#undef Q8_AMX_BLOCK
}

// AR rows from m x NT (<= AT) groups from g, on the tile unit; `c` is the tile's int32 scratch (2 x AT x AR x 16).
// The tiles of block b + 1 are issued before block b's sums are scaled (two sets of C tiles and of scratch): tile
// registers are not renamed, so with one set each block's tile work would wait for the previous block's epilogue.
template <int NT>
__attribute__((target("amx-tile,amx-int8"))) void amx_tile(const Args& a, int64_t m, int64_t g, int32_t* c) {
  __mmask16 live[NT];
  __m512 acc[AR][NT];
  start_tile(a, g, acc, live);
  constexpr int64_t half = AT * AR * GN;
  amx_block<NT, 2>(a, m, g, 0, c);
  for (int64_t b = 0; b < a.nb; ++b) {
    if (b + 1 < a.nb) {
      if (b % 2 == 0) {
        amx_block<NT, 4>(a, m, g, b + 1, c + half);
      } else {
        amx_block<NT, 2>(a, m, g, b + 1, c);
      }
    }
    const int32_t* cb = c + (b % 2) * half;
    __m512 sc[NT];
    for (int t = 0; t < NT; ++t) sc[t] = block_scales(a, b, g + t, live[t]);
#pragma GCC unroll 8
    for (int i = 0; i < AR; ++i) {
      const __m512i bias = _mm512_set1_epi32(a.xb[(m + i) * a.nb + b]);
      const __m512 dv = _mm512_set1_ps(a.xd[(m + i) * a.nb + b]);
#pragma GCC unroll 2
      for (int t = 0; t < NT; ++t) {
        const __m512i dot = _mm512_add_epi32(bias, _mm512_loadu_si512(cb + (t * AR + i) * GN));
        acc[i][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dv, sc[t]), acc[i][t]);
      }
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int i = 0; i < AR; ++i) _mm512_mask_storeu_ps(a.out + (m + i) * a.N + (g + t) * GN, live[t], acc[i][t]);
}

// One task's tiles of AT groups: every full tile of AR rows on the tile unit, the rest of the rows on VNNI.
__attribute__((target("amx-tile,amx-int8"))) void amx_task(const Args& a, int64_t groups, int64_t t0, int64_t t1) {
  alignas(64) int32_t c[2 * AT * AR * GN];
  amx_configure();  // the tile configuration is per thread: every task loads it, and releases the tiles after
  const int64_t full = a.M / AR * AR;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t g = t * AT;
    const int nt = static_cast<int>(std::min<int64_t>(AT, groups - g));
    for (int64_t m = 0; m < full; m += AR) {
      if (nt == 2) {
        amx_tile<2>(a, m, g, c);
      } else {
        amx_tile<1>(a, m, g, c);
      }
    }
    if (full < a.M) {
      Args r = a;  // the last M % AR rows: a view from row `full`
      r.xq += full * a.Kp;
      r.xd += full * a.nb;
      r.xb += full * a.nb;
      r.out += full * a.N;
      r.M = a.M - full;
      for (int j = 0; j < nt; ++j) rows<4, 1>(r, g + j);
    }
  }
  _tile_release();
}

void run_amx(const Args& a, int64_t groups) {
  const int64_t tiles = (groups + AT - 1) / AT;
  at::parallel_for(0, tiles, task_grain(a, AT), [&](int64_t t0, int64_t t1) { amx_task(a, groups, t0, t1); });
}
