// Fused CPU kernels for the glue of a decode step (components/model/native.py builds and loads them).
//
// A layer of a decode step is three calls: `pre_attention` (RMSNorm, the q/k/v product, RoPE),
// `attention` over the cache with the step's tree bias, and `post_attention` (output product,
// residual, RMSNorm, gate/up product, SwiGLU, down product, residual). The products themselves are
// torch's kernels (called here, with the plan's kernel and padding), so their bits are the ones the
// pure-torch path gets; the glue is computed in float32 and rounded once.
//
// Every loop reduces in an order fixed by the row's own data: attention walks the slots a row may
// see, compacted, in slot order; a masked sibling or a padding row changes nothing. A row's bits
// therefore never depend on which or how many rows come with it (batch invariance by construction).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <string>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int LANES = 16;  // partial sums per reduction: vectorizes on AVX2 and AVX-512 alike

template <typename T> inline float f32(T v) { return static_cast<float>(v); }

// y = x W^T for bfloat16 x (M, K) and W (N, K) (the LM head as the embedding stores it, or a
// matrix's [out, in] copy), or W in the packed layout (below): each output a dot product along K, for
// a block of NB outputs and RB rows at a time, so each loaded weight serves RB rows from registers.
// With avx512_bf16 the dot products are `vdpbf16ps` (32 products an instruction, exact in float32,
// summed in float32 lanes), else float32 FMAs in LANES partial sums. Either way a row's sums run in
// an order fixed by K alone, the same in either layout: its bits never depend on the other rows.
// `wat(n, k)`: where output n's weights for inputs k .. k + 31 lie (k a multiple of 32, or the tail);
// `pf`: a block to prefetch, 16 lines each 32 inputs (the next packed block), or null.
constexpr int64_t NB = 4, RB = 4;

inline void prefetch_chunk(const at::BFloat16* pf, int64_t k) {
  for (int l = 0; l < 16; ++l) _mm_prefetch(reinterpret_cast<const char*>(pf + (k / 32) * 512 + l * 32), _MM_HINT_T0);
}

#if defined(__AVX512BF16__)
template <int R, typename XT, typename WAt>
inline void dot_block(const XT* x, int64_t K, WAt wat, float* y, int64_t N, const at::BFloat16* pf) {
  __m512 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < NB; ++n) acc[r][n] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    if (pf) prefetch_chunk(pf, k);
    __m512bh wv[NB];
    for (int n = 0; n < NB; ++n) wv[n] = (__m512bh)_mm512_loadu_si512(wat(n, k));
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * K + k);
      for (int n = 0; n < NB; ++n) acc[r][n] = _mm512_dpbf16_ps(acc[r][n], xv, wv[n]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < NB; ++n) {
      float t = _mm512_reduce_add_ps(acc[r][n]);
      for (int64_t kk = k; kk < K; ++kk) t += f32(x[r * K + kk]) * f32(wat(n, kk)[0]);
      y[r * N + n] = t;
    }
}

// One row against a whole packed block of 16 outputs, read in memory order (the block streams in;
// rows after it find it in cache): the same sums as `dot_block`.
inline void dot_row16(const at::BFloat16* x, int64_t K, const at::BFloat16* wb, float* y) {
  __m512 acc[16];
  for (int n = 0; n < 16; ++n) acc[n] = _mm512_setzero_ps();
  for (int64_t g = 0; g < K / 32; ++g) {
    const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + g * 32);
    for (int n = 0; n < 16; ++n) acc[n] = _mm512_dpbf16_ps(acc[n], xv, (__m512bh)_mm512_loadu_si512(wb + g * 512 + n * 32));
  }
  for (int n = 0; n < 16; ++n) y[n] = _mm512_reduce_add_ps(acc[n]);
}
constexpr bool ROW16 = true;
#else
// Without avx512_bf16 the rows come as float32 (`x_operand`: converted once a product, exactly) and
// the weights as bfloat16 or, for the 4-bit product on AVX2, decoded float32; each output's 16 lanes
// sum the inputs k = l (mod 16) in K order by FMA, the tail goes into lanes 0.., then the lanes
// reduce pairwise (l += l + 8, + 4, + 2, + 1): the same order on AVX2 and in the scalar loop.
inline float reduce16(float* acc) {
  for (int w2 = LANES / 2; w2 > 0; w2 /= 2)
    for (int l = 0; l < w2; ++l) acc[l] += acc[l + w2];
  return acc[0];
}
#if defined(__AVX2__) && defined(__FMA__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {  // 8 bfloat16 -> float32, exactly
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
template <int R, typename XT, typename WAt>
inline void dot_block(const XT* x, int64_t K, WAt wat, float* y, int64_t N, const at::BFloat16* pf) {
  constexpr int O = R == 1 ? 4 : R == 2 ? 2 : 1;  // outputs at once: 8 independent FMA chains (their latency)
  for (int n0 = 0; n0 < NB; n0 += O) {
    __m256 a[R][O][2];
    for (int r = 0; r < R; ++r)
      for (int o = 0; o < O; ++o) a[r][o][0] = a[r][o][1] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + LANES <= K; k += LANES) {
      if (pf && n0 == 0 && k % 32 == 0) prefetch_chunk(pf, k);
      __m256 xv[R][2];
      for (int r = 0; r < R; ++r) xv[r][0] = load8(x + r * K + k), xv[r][1] = load8(x + r * K + k + 8);
      for (int o = 0; o < O; ++o) {
        const auto* wk = wat(n0 + o, k);
        const __m256 w0 = load8(wk), w1 = load8(wk + 8);
        for (int r = 0; r < R; ++r) {
          a[r][o][0] = _mm256_fmadd_ps(xv[r][0], w0, a[r][o][0]);
          a[r][o][1] = _mm256_fmadd_ps(xv[r][1], w1, a[r][o][1]);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int o = 0; o < O; ++o) {
        alignas(32) float acc[LANES];
        _mm256_store_ps(acc, a[r][o][0]);
        _mm256_store_ps(acc + 8, a[r][o][1]);
        for (int64_t kk = k, l = 0; kk < K; ++kk, ++l) acc[l] = std::fma(f32(x[r * K + kk]), f32(wat(n0 + o, kk)[0]), acc[l]);
        y[r * N + n0 + o] = reduce16(acc);
      }
  }
}
#else
template <int R, typename XT, typename WAt>
inline void dot_block(const XT* x, int64_t K, WAt wat, float* y, int64_t N, const at::BFloat16* pf) {
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < NB; ++n) {
      float acc[LANES] = {0};
      int64_t k = 0;
      for (; k + LANES <= K; k += LANES) {
        if (pf && r == 0 && n == 0 && k % 32 == 0) prefetch_chunk(pf, k);
        const auto* wk = wat(n, k);
        for (int l = 0; l < LANES; ++l) acc[l] += f32(x[r * K + k + l]) * f32(wk[l]);
      }
      for (int l = 0; k < K; ++k, ++l) acc[l] += f32(x[r * K + k]) * f32(wat(n, k)[0]);
      y[r * N + n] = reduce16(acc);
    }
}
#endif
template <typename T> inline void dot_row16(const T*, int64_t, const at::BFloat16*, float*) {}
constexpr bool ROW16 = false;
#endif

// The rows as `dot_block` reads them: bfloat16 as given where `vdpbf16ps` multiplies them, else
// float32 (exact), converted once a product into `keep`.
#if defined(__AVX512BF16__)
using XT = at::BFloat16;
inline const XT* x_operand(const torch::Tensor& x, torch::Tensor&) { return x.data_ptr<at::BFloat16>(); }
#else
using XT = float;
inline const XT* x_operand(const torch::Tensor& x, torch::Tensor& keep) {
  keep = x.to(torch::kFloat);
  return keep.data_ptr<float>();
}
#endif

template <typename WAt>
inline void dot_rows(const XT* x, int64_t M, int64_t r0, int64_t K, WAt wat, float* y, int64_t N,
                     const at::BFloat16* pf) {  // rows r0 .. M - 1 of NB outputs, RB rows at a time
  for (; r0 < M; r0 += RB, pf = nullptr) {
    const XT* xr = x + r0 * K;
    float* yr = y + r0 * N;
    switch (std::min(RB, M - r0)) {
      case 1: dot_block<1>(xr, K, wat, yr, N, pf); break;
      case 2: dot_block<2>(xr, K, wat, yr, N, pf); break;
      case 3: dot_block<3>(xr, K, wat, yr, N, pf); break;
      default: dot_block<4>(xr, K, wat, yr, N, pf); break;
    }
  }
}

torch::Tensor bf16_mm_dot(torch::Tensor x, torch::Tensor w, bool out_bf16) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto yf = torch::empty({M, N}, x.options().dtype(torch::kFloat));
  torch::Tensor keep;
  const XT* xp = x_operand(x, keep);
  const auto* wp = w.data_ptr<at::BFloat16>();
  float* yp = yf.data_ptr<float>();
  at::parallel_for(0, N / NB, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const at::BFloat16* wb = wp + b * NB * K;
      dot_rows(xp, M, 0, K, [wb, K](int64_t n, int64_t k) { return wb + n * K + k; }, yp + b * NB, N, nullptr);
    }
  });
  return out_bf16 ? yf.to(torch::kBFloat16) : yf;
}

// The packed bfloat16 layout (components/model/linear.py `native_bf16_layout`): W (N, K) as
// (N / 16, K / 32, 16, 32), block b's chunk g holding its 16 outputs' inputs 32 g .. 32 g + 31, so
// that a block lies in the order a product reads it: from memory at copy bandwidth (the (N, K)
// layout reads 16 rows K apart at once, at about half of it), and as AMX's 16 x 32 tiles.
torch::Tensor bf16_mm_dot_packed(torch::Tensor x, torch::Tensor w, bool out_bf16) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0) * 16;
  auto yf = torch::empty({M, N}, x.options().dtype(torch::kFloat));
  torch::Tensor keep;
  const XT* xp = x_operand(x, keep);
  const auto* wp = w.data_ptr<at::BFloat16>();
  float* yp = yf.data_ptr<float>();
  at::parallel_for(0, N / 16, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const at::BFloat16* wb = wp + b * 16 * K;
      const at::BFloat16* next = b + 1 < b1 ? wb + 16 * K : nullptr;  // fetched while rows after the first compute
      int64_t r0 = 0;
      if (ROW16) dot_row16(xp, K, wb, yp + b * 16), r0 = 1;
      for (int64_t j = 0; j < 16; j += NB)
        dot_rows(xp, M, r0, K, [wb, j](int64_t n, int64_t k) { return wb + (k / 32) * 512 + (j + n) * 32 + k % 32; },
                 yp + b * 16 + j, N, j == 0 ? next : nullptr);
    }
  });
  return out_bf16 ? yf.to(torch::kBFloat16) : yf;
}

// ---- 4-bit products: each weight tile decoded once for all the step's rows ----
//
// The native q4 layout (components/model/linear.py `Int4`), blocked so that what a block of 16
// outputs needs for one 32-input chunk lies together: codes (N / 16, K / 32, 256) uint8, outputs
// 4u .. 4u + 3 of the block in bytes [64 u, 64 u + 64), little-endian 16-bit word i holding their
// codes for input i in its four nibbles (lowest first); sz (N / 16, K / 32, 32) bfloat16, the 16 outputs' (scale, zero):
// w = (q - 8) scale + zero.
// A group is decoded to bfloat16 through a 16-entry table (the 16 values its codes can take, each
// exact in float32 and rounded once to nearest even): the weight every path multiplies by. Each
// chunk of a block is decoded once and serves every row of the step:
// - with AMX, as a 16 x 32 tile against 16-row tiles of x (`tdpbf16ps`, float32 accumulation);
// - else as rows of a decoded block that `dot_block` reads for 4 rows at a time.
// Each output's sum runs over its chunks in K order with the arithmetic of one path, chosen once per
// process: a row's bits never depend on the other rows or on their count.
constexpr int64_t QB = 16;  // outputs a block
constexpr int64_t QG = 32;  // inputs a group (and a chunk)

inline uint16_t bf16_bits(float f) {  // round to nearest even (finite values)
  uint32_t b;
  __builtin_memcpy(&b, &f, 4);
  b += 0x7FFF + ((b >> 16) & 1);
  return static_cast<uint16_t>(b >> 16);
}

inline float bf16_float(uint16_t h) {
  const uint32_t b = static_cast<uint32_t>(h) << 16;
  float f;
  __builtin_memcpy(&f, &b, 4);
  return f;
}

// One chunk of a block: 16 outputs x 32 inputs -> out[n * stride + i] bfloat16 bits. The chunk's
// codes come as 4 quads of outputs, 64 bytes a quad: 16-bit word i holds outputs 4u .. 4u + 3's codes
// for input i in its four nibbles, lowest first; its sz as 16 (scale, zero) pairs.
inline int code_of(const uint8_t* c, int64_t n, int64_t i) {
  const uint16_t word = static_cast<uint16_t>(c[64 * (n / 4) + 2 * i] | (c[64 * (n / 4) + 2 * i + 1] << 8));
  return (word >> (4 * (n % 4))) & 0x0F;
}

#if defined(__AVX512BW__)
inline __m512i two_tables(__m512 q, float s0, float z0, float s1, float z1) {  // 32 bfloat16: output 0 in words 0..15
  const __m512 t0 = _mm512_fmadd_ps(q, _mm512_set1_ps(s0), _mm512_set1_ps(z0));  // (q - 8) s + z, exact
  const __m512 t1 = _mm512_fmadd_ps(q, _mm512_set1_ps(s1), _mm512_set1_ps(z1));
#if defined(__AVX512BF16__)
  return (__m512i)_mm512_cvtne2ps_pbh(t1, t0);
#else
  auto rnd = [](__m512 f) {
    __m512i b = _mm512_castps_si512(f);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16));
  };
  return _mm512_inserti64x4(_mm512_castsi256_si512(rnd(t0)), rnd(t1), 1);
#endif
}

inline void decode_chunk(const uint8_t* c, const uint16_t* sz, uint16_t* out, int64_t stride) {
  alignas(64) float f[32];  // scale, zero of each output, as float32 (a bfloat16's bits shifted up)
  const __m512i v = _mm512_loadu_si512(sz);  // lane n: scale (low half) | zero (high half)
  _mm512_store_ps(f, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
  _mm512_store_ps(f + 16, _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(0xFFFF0000u))));
  const __m512 q = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  const __m512i m4 = _mm512_set1_epi16(0x0F), second = _mm512_set1_epi16(0x10);
  for (int64_t u = 0; u < 4; ++u) {
    const int64_t n = 4 * u;
    const __m512i w = _mm512_loadu_si512(c + 64 * u);
    const __m512i lut01 = two_tables(q, f[n], f[16 + n], f[n + 1], f[16 + n + 1]);
    const __m512i lut23 = two_tables(q, f[n + 2], f[16 + n + 2], f[n + 3], f[16 + n + 3]);
    _mm512_storeu_si512(out + n * stride, _mm512_permutexvar_epi16(_mm512_and_si512(w, m4), lut01));
    _mm512_storeu_si512(out + (n + 1) * stride,
                        _mm512_permutexvar_epi16(_mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(w, 4), m4), second), lut01));
    _mm512_storeu_si512(out + (n + 2) * stride, _mm512_permutexvar_epi16(_mm512_and_si512(_mm512_srli_epi16(w, 8), m4), lut23));
    _mm512_storeu_si512(out + (n + 3) * stride, _mm512_permutexvar_epi16(_mm512_or_si512(_mm512_srli_epi16(w, 12), second), lut23));
  }
}
using QW = uint16_t;  // a decoded weight as the products read it: bfloat16 bits
#elif defined(__AVX2__) && defined(__FMA__)
// AVX2 without AVX-512: a chunk decoded straight to float32 (the bfloat16 weight, exactly), 8 inputs
// a vector: code - 8 from the quad's words, (q - 8) scale + zero by one FMA (the product is exact, as
// in the table), rounded to bfloat16 as `bf16_bits` rounds.
using QW = float;
inline __m256 bf16_round8(__m256 t) {
  __m256i b = _mm256_castps_si256(t);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  b = _mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  return _mm256_castsi256_ps(_mm256_and_si256(b, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline void decode_chunk(const uint8_t* c, const uint16_t* sz, float* out, int64_t stride) {
  const __m256i m4 = _mm256_set1_epi16(0x0F), eight = _mm256_set1_epi16(8);
  for (int64_t u = 0; u < 4; ++u) {
    const __m256i w[2] = {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64 * u)),
                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64 * u + 32))};  // inputs 0..15, 16..31
    for (int j = 0; j < 4; ++j) {
      const int64_t n = 4 * u + j;
      const __m256 vs = _mm256_set1_ps(bf16_float(sz[2 * n])), vz = _mm256_set1_ps(bf16_float(sz[2 * n + 1]));
      const __m128i shift = _mm_cvtsi32_si128(4 * j);
      for (int h = 0; h < 2; ++h) {
        const __m256i q = _mm256_sub_epi16(_mm256_and_si256(_mm256_srl_epi16(w[h], shift), m4), eight);
        const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(q)));
        const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(q, 1)));
        _mm256_storeu_ps(out + n * stride + 16 * h, bf16_round8(_mm256_fmadd_ps(lo, vs, vz)));
        _mm256_storeu_ps(out + n * stride + 16 * h + 8, bf16_round8(_mm256_fmadd_ps(hi, vs, vz)));
      }
    }
  }
}
#else
using QW = uint16_t;
inline void decode_chunk(const uint8_t* c, const uint16_t* sz, uint16_t* out, int64_t stride) {
  for (int64_t n = 0; n < QB; ++n) {
    uint16_t lut[16];
    const float s = bf16_float(sz[2 * n]), z = bf16_float(sz[2 * n + 1]);
    for (int i = 0; i < 16; ++i) lut[i] = bf16_bits(static_cast<float>(i - 8) * s + z);
    uint16_t* o = out + n * stride;
    for (int64_t i = 0; i < QG; ++i) o[i] = lut[code_of(c, n, i)];
  }
}
#endif

// GCC's tile intrinsics are asm without a memory operand: the compiler must be told that a tile
// load reads what was just stored (else it may drop the stores) and that a tile store writes
// memory read next.
inline void memory_fence() { __asm__ __volatile__("" ::: "memory"); }
struct alignas(64) TileConfig {  // ldtilecfg's operand (palette 1: 8 tiles of at most 16 rows x 64 bytes)
  uint8_t palette = 1, start_row = 0, reserved[14] = {0};
  uint16_t colsb[16] = {0};
  uint8_t rows[16] = {0};
};

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
constexpr bool AMX_BUILT = true;

bool amx_permitted() {  // Linux hands AMX's tile state to a process that asks (arch_prctl)
  constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

// One block of 16 outputs x up to 3 tiles of 16 rows: tmm0 the block's weights for one 32-input
// chunk (16 outputs x 32 inputs, put there by `load_a(g)`), tmm1 a chunk of x in AMX's pair layout,
// tmm2 + 2t / tmm3 + 2t the (output, row) float32 sums of row tile t over the even / odd chunks (two
// chains, so that one product need not wait for the last), added at the end in that order, for
// every row count.
template <int T, typename LoadA>
void amx_block(int64_t groups, const uint16_t* xv, int64_t tile_stride, float* cbuf, LoadA load_a) {
  memory_fence();
  if constexpr (T > 0) { _tile_zero(2); _tile_zero(3); }
  if constexpr (T > 1) { _tile_zero(4); _tile_zero(5); }
  if constexpr (T > 2) { _tile_zero(6); _tile_zero(7); }
#define STEP(t, c)                            \
  if constexpr (T > t) {                      \
    _tile_loadd(1, xg + t * tile_stride, 64); \
    _tile_dpbf16ps(c, 0, 1);                  \
  }
  for (int64_t g = 0; g < groups; ++g) {
    load_a(g);
    const uint16_t* xg = xv + g * 512;
    if (g % 2 == 0) {
      STEP(0, 2) STEP(1, 4) STEP(2, 6)
    } else {
      STEP(0, 3) STEP(1, 5) STEP(2, 7)
    }
  }
#undef STEP
  if constexpr (T > 0) { _tile_stored(2, cbuf + 0 * 256, 64); _tile_stored(3, cbuf + 1 * 256, 64); }
  if constexpr (T > 1) { _tile_stored(4, cbuf + 2 * 256, 64); _tile_stored(5, cbuf + 3 * 256, 64); }
  if constexpr (T > 2) { _tile_stored(6, cbuf + 4 * 256, 64); _tile_stored(7, cbuf + 5 * 256, 64); }
  memory_fence();
}

// y (M, N) = x (M, K) W^T through AMX, W given per block of 16 outputs by `block_a(b)`, which returns
// the block's `load_a(g)`; float32 out, or bfloat16 (rounded once) with `out_bf16`.
template <typename BlockA>
torch::Tensor amx_mm(torch::Tensor x, int64_t N, bool out_bf16, BlockA block_a) {
  const int64_t M = x.size(0), K = x.size(1), groups = K / QG;
  const int64_t MT = (M + 15) / 16;
  // x in AMX's pair layout: tile t, chunk g, pair p, row m, (2p, 2p + 1); padding rows zero
  auto xv_t = torch::zeros({MT, groups, 16, 16, 2}, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  auto* xv = reinterpret_cast<uint16_t*>(xv_t.data_ptr<at::BFloat16>());
  for (int64_t m = 0; m < M; ++m) {
    uint16_t* xt = xv + (m / 16) * groups * 512 + (m % 16) * 2;
    for (int64_t k = 0; k < K; k += 2) {  // pair (k, k + 1) of row m: chunk k / 32, pair (k % 32) / 2
      uint16_t* d = xt + (k / QG) * 512 + ((k % QG) / 2) * 32;
      d[0] = xp[m * K + k];
      d[1] = xp[m * K + k + 1];
    }
  }
  auto y = torch::empty({M, N}, x.options().dtype(out_bf16 ? torch::kBFloat16 : torch::kFloat));
  auto* yb = reinterpret_cast<uint16_t*>(out_bf16 ? y.data_ptr() : nullptr);
  float* yf = out_bf16 ? nullptr : y.data_ptr<float>();
  const int64_t tile_stride = groups * 512;
  at::parallel_for(0, N / QB, 1, [&](int64_t b0, int64_t b1) {
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
    alignas(64) float cbuf[6 * 256];
    for (int64_t b = b0; b < b1; ++b) {
      auto load_a = block_a(b);
      for (int64_t t0 = 0; t0 < MT; t0 += 3) {
        const int64_t T = std::min<int64_t>(3, MT - t0);
        const uint16_t* xt = xv + t0 * tile_stride;
        switch (T) {
          case 1: amx_block<1>(groups, xt, tile_stride, cbuf, load_a); break;
          case 2: amx_block<2>(groups, xt, tile_stride, cbuf, load_a); break;
          default: amx_block<3>(groups, xt, tile_stride, cbuf, load_a); break;
        }
        for (int64_t t = 0; t < T; ++t)
          for (int64_t mm = 0; mm < 16; ++mm) {
            const int64_t m = (t0 + t) * 16 + mm;
            if (m >= M) break;
            const float* even = cbuf + 2 * t * 256 + mm;
            const float* odd = even + 256;
            if (out_bf16)
              for (int64_t n = 0; n < QB; ++n) yb[m * N + b * QB + n] = bf16_bits(even[n * 16] + odd[n * 16]);
            else
              for (int64_t n = 0; n < QB; ++n) yf[m * N + b * QB + n] = even[n * 16] + odd[n * 16];
          }
      }
    }
    _tile_release();
  });
  return y;
}

torch::Tensor q4_mm_amx(torch::Tensor x, torch::Tensor codes, torch::Tensor sz, int64_t N) {
  const int64_t groups = x.size(1) / QG;
  const auto* cp = codes.data_ptr<uint8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(sz.data_ptr<at::BFloat16>());
  return amx_mm(x, N, true, [&](int64_t b) {
    return [cb = cp + b * groups * 256, sb = sp + b * groups * 32](int64_t g) {
      alignas(64) uint16_t a[QB * QG];
      decode_chunk(cb + g * 256, sb + g * 32, a, QG);
      memory_fence();
      _tile_loadd(0, a, 64);
    };
  });
}

torch::Tensor bf16_mm_amx(torch::Tensor x, torch::Tensor w, bool out_bf16) {  // W (N, K) or packed
  const int64_t K = x.size(1);
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  if (w.dim() == 4)  // a chunk's tile lies whole: 16 rows of 64 bytes
    return amx_mm(x, w.size(0) * QB, out_bf16, [&](int64_t b) {
      return [wb = wp + b * QB * K](int64_t g) { _tile_loadd(0, wb + g * QB * QG, QG * 2); };
    });
  return amx_mm(x, w.size(0), out_bf16, [&](int64_t b) {
    return [wb = wp + b * QB * K, K](int64_t g) { _tile_loadd(0, wb + g * QG, K * 2); };
  });
}
#else
constexpr bool AMX_BUILT = false;
bool amx_permitted() { return false; }
torch::Tensor q4_mm_amx(torch::Tensor x, torch::Tensor, torch::Tensor, int64_t) { return x; }
torch::Tensor bf16_mm_amx(torch::Tensor x, torch::Tensor, bool) { return x; }
#endif

#if defined(__AVX512BF16__)
// A few rows against one block of 16 outputs, each quad of outputs decoded chunk by chunk into
// registers and multiplied at once (no decoded copy to store and read back): the weights, the
// `vdpbf16ps` chain over the chunks in K order and the final reduction of `dot_block`, so the
// same bits as the decode-then-dot path below, which pays where many rows share each decode.
template <int R>
inline void q4_block_rows(const at::BFloat16* x, int64_t K, const uint8_t* cb, const uint16_t* sb, float* y, int64_t N,
                          float* f) {  // f: scratch, 32 floats a chunk
  constexpr int Q = R == 1 ? 4 : R == 2 ? 2 : 1;  // quads of outputs a pass: R x 4Q sums in registers
  const __m512 q = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  const __m512i m4 = _mm512_set1_epi16(0x0F), second = _mm512_set1_epi16(0x10);
  const int64_t groups = K / QG;
  for (int64_t g = 0; g < groups; ++g) {  // chunk g's (scale, zero) as float32: scales 0..15, then zeros
    const __m512i v = _mm512_loadu_si512(sb + g * 32);
    _mm512_storeu_ps(f + g * 32, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
    _mm512_storeu_ps(f + g * 32 + 16, _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(0xFFFF0000u))));
  }
  for (int64_t u0 = 0; u0 < 4; u0 += Q) {
    __m512 acc[R][4 * Q];
    for (int r = 0; r < R; ++r)
      for (int n = 0; n < 4 * Q; ++n) acc[r][n] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const float* fg = f + g * 32;
      for (int j = 0; j < Q; ++j) {
        const int64_t n0 = 4 * (u0 + j);
        const __m512i w = _mm512_loadu_si512(cb + g * 256 + 16 * n0);
        const __m512i lut01 = two_tables(q, fg[n0], fg[16 + n0], fg[n0 + 1], fg[16 + n0 + 1]);
        const __m512i lut23 = two_tables(q, fg[n0 + 2], fg[16 + n0 + 2], fg[n0 + 3], fg[16 + n0 + 3]);
        __m512bh wv[4];
        wv[0] = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(w, m4), lut01);
        wv[1] = (__m512bh)_mm512_permutexvar_epi16(_mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(w, 4), m4), second), lut01);
        wv[2] = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(_mm512_srli_epi16(w, 8), m4), lut23);
        wv[3] = (__m512bh)_mm512_permutexvar_epi16(_mm512_or_si512(_mm512_srli_epi16(w, 12), second), lut23);
        for (int r = 0; r < R; ++r) {
          const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * K + g * QG);
          for (int n = 0; n < 4; ++n) acc[r][4 * j + n] = _mm512_dpbf16_ps(acc[r][4 * j + n], xv, wv[n]);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int n = 0; n < 4 * Q; ++n) y[r * N + 4 * u0 + n] = _mm512_reduce_add_ps(acc[r][n]);
  }
}
constexpr int64_t Q4_FUSED_ROWS = 4;  // up to this many rows, `q4_block_rows` (measured faster on Zen 5)
#endif

torch::Tensor q4_mm_dot(torch::Tensor x, torch::Tensor codes, torch::Tensor sz, int64_t N) {
  const int64_t M = x.size(0), K = x.size(1), groups = K / QG;
  auto yf = torch::empty({M, N}, x.options().dtype(torch::kFloat));
  torch::Tensor keep;
  const XT* xp = x_operand(x, keep);
  const auto* cp = codes.data_ptr<uint8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(sz.data_ptr<at::BFloat16>());
  float* yp = yf.data_ptr<float>();
#if defined(__AVX512BF16__)
  if (M <= Q4_FUSED_ROWS) {
    at::parallel_for(0, N / QB, 1, [&](int64_t b0, int64_t b1) {
      std::vector<float> f(groups * 32);
      for (int64_t b = b0; b < b1; ++b) {
        const uint8_t* cb = cp + b * groups * 256;
        const uint16_t* sb = sp + b * groups * 32;
        switch (M) {
          case 1: q4_block_rows<1>(xp, K, cb, sb, yp + b * QB, N, f.data()); break;
          case 2: q4_block_rows<2>(xp, K, cb, sb, yp + b * QB, N, f.data()); break;
          case 3: q4_block_rows<3>(xp, K, cb, sb, yp + b * QB, N, f.data()); break;
          default: q4_block_rows<4>(xp, K, cb, sb, yp + b * QB, N, f.data()); break;
        }
      }
    });
    return yf.to(torch::kBFloat16);
  }
#endif
  at::parallel_for(0, N / QB, 1, [&](int64_t b0, int64_t b1) {
    std::vector<QW> w(QB * K);  // the block's 16 outputs decoded, [out, in]
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t g = 0; g < groups; ++g)
        decode_chunk(cp + (b * groups + g) * 256, sp + (b * groups + g) * 32, w.data() + g * QG, K);
      using WT = std::conditional_t<std::is_same_v<QW, float>, float, at::BFloat16>;
      const auto* wb = reinterpret_cast<const WT*>(w.data());
      for (int64_t j = 0; j < QB; j += NB) {
        const WT* wj = wb + j * K;
        dot_rows(xp, M, 0, K, [wj, K](int64_t n, int64_t k) { return wj + n * K + k; }, yp + b * QB + j, N, nullptr);
      }
    }
  });
  return yf.to(torch::kBFloat16);
}

// Which arithmetic the products (bf16_mm, q4_mm) take in this process: "amx" (AMX built, the kernel permits
// it, and LLM_DECODE_AMX is not 0), else "avx512_bf16" or "float32" (dot_block's two paths). Decided
// once: every product of the process then gives a row the same bits.
const std::string& product_path() {
  static const std::string path = [] {
    const char* env = std::getenv("LLM_DECODE_AMX");
    const bool off = env && std::string(env) == "0";
    if (AMX_BUILT && !off && amx_permitted()) return std::string("amx");
#if defined(__AVX512BF16__)
    return std::string("avx512_bf16");
#else
    return std::string("float32");
#endif
  }();
  return path;
}

// y = x W^T for bfloat16 x (M, K) and W (N, K) or packed (N / 16, K / 32, 16, 32): through AMX where
// this process uses it and the shape fits its tiles (K % 32 == 0, N % 16 == 0, always so when packed;
// a matrix's shape, so every row count of it takes the same path), else `bf16_mm_dot(_packed)`.
// float32 out, or bfloat16 with `out_bf16`.
torch::Tensor bf16_mm(torch::Tensor x, torch::Tensor w, bool out_bf16) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && w.scalar_type() == torch::kBFloat16, "bf16_mm: bfloat16 inputs");
  x = x.contiguous();
  TORCH_CHECK(w.is_contiguous(), "bf16_mm: W must be contiguous, (N, K) or packed (N / 16, K / 32, 16, 32)");
  const int64_t K = x.size(1);
  if (w.dim() == 4) {
    TORCH_CHECK(w.size(1) * QG == K && w.size(2) == QB && w.size(3) == QG, "bf16_mm: packed W must be (N / 16, K / 32, 16, 32)");
    return product_path() == "amx" ? bf16_mm_amx(x, w, out_bf16) : bf16_mm_dot_packed(x, w, out_bf16);
  }
  const int64_t N = w.size(0);
  TORCH_CHECK(w.dim() == 2 && w.size(1) == K && N % NB == 0, "bf16_mm: bad shapes");
  if (product_path() == "amx" && K % QG == 0 && N % QB == 0) return bf16_mm_amx(x, w, out_bf16);
  return bf16_mm_dot(x, w, out_bf16);
}

// x (M, K) bfloat16 times the native q4 layout (codes (N / 16, K / 32, 256) uint8, sz (N / 16, K / 32,
// 32) bfloat16) -> (M, N) bfloat16.
torch::Tensor q4_mm(torch::Tensor x, torch::Tensor codes, torch::Tensor sz) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && codes.scalar_type() == torch::kUInt8 &&
              sz.scalar_type() == torch::kBFloat16, "q4_mm: bfloat16 x, uint8 codes, bfloat16 scales");
  x = x.contiguous();
  const int64_t K = x.size(1), N = codes.size(0) * QB;
  TORCH_CHECK(codes.is_contiguous() && sz.is_contiguous() && K % QG == 0 && codes.dim() == 3 &&
              codes.size(1) == K / QG && codes.size(2) == 256 && sz.dim() == 3 && sz.size(0) == codes.size(0) &&
              sz.size(1) == K / QG && sz.size(2) == 32,
              "q4_mm: shapes must be x (M, K), codes (N / 16, K / 32, 256), sz (N / 16, K / 32, 32)");
  return product_path() == "amx" ? q4_mm_amx(x, codes, sz, N) : q4_mm_dot(x, codes, sz, N);
}

#include "w4a8.h"

// A product y = x W as the plan computes it: kind 0 `x @ W` on [in, out], 1 `linear` on [out, in],
// 2 torch's int4 kernel (a = packed, b = scales and zeros), 3 torch's int8 kernel (a = codes, b = row
// scales), 5 the native bfloat16 product (`bf16_mm`, a = W [out, in] or packed); x padded with zero rows to
// `min_rows` first; 6 the native 4-bit product (`q4_mm`, a = codes, b = scales and zeros); 7 the w4a8 integer product
// (`q4i8_mm`, a = codes, b = d and m).
struct Product {
  int64_t kind;
  torch::Tensor a, b;
  int64_t group, min_rows;
};

Product product_from(const std::vector<torch::Tensor>& ts, const std::vector<int64_t>& ints) {
  return Product{ints[0], ts[0], ts.size() > 1 ? ts[1] : torch::Tensor(), ints[1], ints[2]};
}

torch::Tensor apply(const Product& p, torch::Tensor x) {  // x: (n, in) -> (n, out)
  const int64_t n = x.size(0);
  if (n < p.min_rows) x = torch::cat({x, x.new_zeros({p.min_rows - n, x.size(1)})});
  torch::Tensor y;
  switch (p.kind) {
    case 0: y = torch::mm(x, p.a); break;
    case 1: y = at::linear(x, p.a); break;
    case 2: y = at::_weight_int4pack_mm_for_cpu(x, p.a, p.group, p.b); break;
    case 3: y = at::_weight_int8pack_mm(x.contiguous(), p.a, p.b); break;
    case 5: y = bf16_mm(x, p.a, true); break;
    case 6: y = q4_mm(x, p.a, p.b); break;
    case 7: y = q4i8_mm(x, p.a, p.b, false, false); break;
    default: TORCH_CHECK(false, "unknown product kind ", p.kind);
  }
  return y.size(0) == n ? y : y.narrow(0, 0, n);
}

// out[r] = bf16(x[r] / rms(x[r]) * w), the sum of squares in LANES partial sums.
void rms_norm_rows(const at::BFloat16* x, const at::BFloat16* w, at::BFloat16* out, int64_t rows, int64_t dim,
                   double eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const at::BFloat16* xr = x + r * dim;
    float acc[LANES] = {0};
    int64_t d = 0;
    for (; d + LANES <= dim; d += LANES)
      for (int l = 0; l < LANES; ++l) acc[l] += f32(xr[d + l]) * f32(xr[d + l]);
    for (int l = 0; d < dim; ++d, ++l) acc[l] += f32(xr[d]) * f32(xr[d]);
    for (int w2 = LANES / 2; w2 > 0; w2 /= 2)
      for (int l = 0; l < w2; ++l) acc[l] += acc[l + w2];
    const float inv = 1.0f / std::sqrt(acc[0] / static_cast<float>(dim) + static_cast<float>(eps));
    at::BFloat16* o = out + r * dim;
    for (int64_t i = 0; i < dim; ++i) o[i] = at::BFloat16(f32(xr[i]) * inv * f32(w[i]));
  }
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {  // x: (R, dim) bfloat16
  x = x.contiguous();
  auto out = torch::empty_like(x);
  rms_norm_rows(x.data_ptr<at::BFloat16>(), w.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(),
                x.size(0), x.size(1), eps);
  return out;
}

// RoPE in place on the first `heads` heads of each row of qkv (R, *) bfloat16, half-split
// convention: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s), cos / sin: (R, hs / 2) float32.
void rope_rows(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t heads, int64_t hs) {
  const int64_t R = qkv.size(0), stride = qkv.size(1), half = hs / 2;
  TORCH_CHECK(cos.scalar_type() == torch::kFloat && sin.scalar_type() == torch::kFloat && cos.is_contiguous() &&
              sin.is_contiguous() && cos.size(0) == R && cos.size(1) == half && sin.sizes() == cos.sizes(),
              "rope: cos and sin must be contiguous float32 (R, hs / 2)");
  auto* q = qkv.data_ptr<at::BFloat16>();
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r)
    for (int64_t h = 0; h < heads; ++h) {
      at::BFloat16* x = q + r * stride + h * hs;
      const float* cr = c + r * half;
      const float* sr = s + r * half;
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = f32(x[i]), x2 = f32(x[i + half]);
        x[i] = at::BFloat16(x1 * cr[i] - x2 * sr[i]);
        x[i + half] = at::BFloat16(x2 * cr[i] + x1 * sr[i]);
      }
    }
}

// x: (R, dim) bfloat16 -> q (R, nh, hs), k, v (R, nkv, hs): views of one (R, (nh + 2 nkv) hs) tensor.
std::vector<torch::Tensor> pre_attention(torch::Tensor x, torch::Tensor norm_w, double eps,
                                         std::vector<torch::Tensor> wqkv, std::vector<int64_t> wqkv_i,
                                         c10::optional<torch::Tensor> bias, torch::Tensor cos, torch::Tensor sin,
                                         int64_t nh, int64_t nkv, int64_t hs) {
  auto h = rms_norm(x, norm_w, eps);
  auto qkv = apply(product_from(wqkv, wqkv_i), h);
  if (bias.has_value()) qkv = qkv + *bias;
  qkv = qkv.contiguous();
  rope_rows(qkv, cos, sin, nh + nkv, hs);
  const int64_t R = qkv.size(0);
  return {qkv.narrow(1, 0, nh * hs).view({R, nh, hs}), qkv.narrow(1, nh * hs, nkv * hs).view({R, nkv, hs}),
          qkv.narrow(1, (nh + nkv) * hs, nkv * hs).view({R, nkv, hs})};
}

// exp(x) for x <= 0 in plain float arithmetic that vectorizes (Cephes' expf: x = n ln2 + r, a
// degree-5 polynomial for e^r, 2^n put into the exponent bits): within 2 ulp of expf, and the same
// bits wherever it runs, as a loop over a row's scores or one value at a time.
inline float exp_neg(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float t = x * 1.44269504088896341f;
  const float n = (t + 12582912.0f) - 12582912.0f;  // round to nearest, |t| < 2^22
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

#include "attention.h"

// out[r, i] = bf16(silu(gu[r, i]) * gu[r, H + i]), gu: (R, 2H) bfloat16. The sigmoid from exp_neg of
// -|a| (never overflows; plain float arithmetic, so the loop vectorizes and gives the same bits
// wherever it runs), rows split across threads.
torch::Tensor silu_mul(torch::Tensor gu) {
  gu = gu.contiguous();
  const int64_t R = gu.size(0), H = gu.size(1) / 2;
  auto out = torch::empty({R, H}, gu.options());
  const auto* g = gu.data_ptr<at::BFloat16>();
  auto* o = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, R, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const at::BFloat16* gr = g + r * 2 * H;
      at::BFloat16* orow = o + r * H;
      for (int64_t i = 0; i < H; ++i) {
        const float a = f32(gr[i]), u = f32(gr[H + i]);
        const float e = exp_neg(a >= 0.0f ? -a : a);  // exp(-|a|)
        const float sig = (a >= 0.0f ? 1.0f : e) / (1.0f + e);
        orow[i] = at::BFloat16(a * sig * u);
      }
    }
  });
  return out;
}

// x: (R, dim), y: (R, nh hs) the attention's output, both bfloat16 -> the layer's output (R, dim).
torch::Tensor post_attention(torch::Tensor x, torch::Tensor y, std::vector<torch::Tensor> wo, std::vector<int64_t> wo_i,
                             c10::optional<torch::Tensor> bo, torch::Tensor norm_w, double eps,
                             std::vector<torch::Tensor> w13, std::vector<int64_t> w13_i, std::vector<torch::Tensor> w2,
                             std::vector<int64_t> w2_i) {
  auto o = apply(product_from(wo, wo_i), y);
  if (bo.has_value()) o = o + *bo;
  x = x + o;
  auto gu = apply(product_from(w13, w13_i), rms_norm(x, norm_w, eps));
  return x + apply(product_from(w2, w2_i), silu_mul(gu));
}

// k, v (R, nkv, hs) bfloat16, any strides with the head dim contiguous -> rows `slots` of the
// layer's pools viewed as (n_blocks * block_size, nkv, hs): the step's keys and values, where the
// paged KV's plan puts them.
void write_slots(torch::Tensor kpool, torch::Tensor vpool, const torch::Tensor& slots, const torch::Tensor& k,
                 const torch::Tensor& v) {
  const int64_t R = k.size(0), nkv = k.size(1), hs = k.size(2), n = kpool.size(0) * kpool.size(1);
  TORCH_CHECK(kpool.is_contiguous() && vpool.is_contiguous() && kpool.scalar_type() == torch::kBFloat16 &&
              vpool.scalar_type() == torch::kBFloat16 && kpool.size(2) == nkv && kpool.size(3) == hs &&
              slots.scalar_type() == torch::kLong && slots.numel() == R && k.stride(2) == 1 && v.stride(2) == 1,
              "layer_paged: bfloat16 contiguous pools (n_blocks, block_size, nkv, hs) and one int64 slot a row");
  const int64_t* sp = slots.data_ptr<int64_t>();
  auto* kd = kpool.data_ptr<at::BFloat16>();
  auto* vd = vpool.data_ptr<at::BFloat16>();
  const auto* ks = k.data_ptr<at::BFloat16>();
  const auto* vs = v.data_ptr<at::BFloat16>();
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(sp[r] >= 0 && sp[r] < n, "layer_paged: slot ", sp[r], " outside the pool");
    for (int64_t h = 0; h < nkv; ++h) {
      std::memcpy(kd + (sp[r] * nkv + h) * hs, ks + r * k.stride(0) + h * k.stride(1), hs * sizeof(at::BFloat16));
      std::memcpy(vd + (sp[r] * nkv + h) * hs, vs + r * v.stride(0) + h * v.stride(1), hs * sizeof(at::BFloat16));
    }
  }
}

// A whole layer of a cached step on the paged KV in one call (the Python between the three calls and
// the KV write cost ~45 us a layer): `pre_attention`, the step's keys and values written into the
// pools at `slots`, `paged_attention` over the pools where they lie, `post_attention`. The same
// functions in the same order as the separate calls: the same bits.
torch::Tensor layer_paged(torch::Tensor x, torch::Tensor norm1, double eps, std::vector<torch::Tensor> wqkv,
                          std::vector<int64_t> wqkv_i, c10::optional<torch::Tensor> bqkv, torch::Tensor cos, torch::Tensor sin,
                          int64_t nh, int64_t nkv, int64_t hs, torch::Tensor kpool, torch::Tensor vpool, torch::Tensor slots,
                          torch::Tensor table, c10::optional<torch::Tensor> row_index, int64_t width, int64_t span,
                          c10::optional<torch::Tensor> bias, double scale, bool causal, std::vector<torch::Tensor> wo,
                          std::vector<int64_t> wo_i, c10::optional<torch::Tensor> bo, torch::Tensor norm2,
                          std::vector<torch::Tensor> w13, std::vector<int64_t> w13_i, std::vector<torch::Tensor> w2,
                          std::vector<int64_t> w2_i) {
  auto qkv = pre_attention(x, norm1, eps, wqkv, wqkv_i, bqkv, cos, sin, nh, nkv, hs);  // (R, nh, hs), (R, nkv, hs) x 2
  write_slots(kpool, vpool, slots, qkv[1], qkv[2]);
  auto y = paged_attention(qkv[0], kpool, vpool, table, row_index, width, span, bias, scale, causal, false);  // (R, nh, hs)
  return post_attention(x, y.view({x.size(0), nh * hs}), wo, wo_i, bo, norm2, eps, w13, w13_i, w2, w2_i);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm);
  m.def("bf16_mm", &bf16_mm);
  m.def("q4_mm", &q4_mm);
  m.def("q4i8_mm", &q4i8_mm, py::arg("x"), py::arg("codes"), py::arg("dm"), py::arg("ref") = false, py::arg("emulate_amx") = false);
  m.def("q8i8_mm", &q8i8_mm, py::arg("x"), py::arg("codes"), py::arg("d"), py::arg("ref") = false, py::arg("emulate_amx") = false);
  m.def("amx_emulation", []() { return AMX_EMULATION_BUILT; });
  m.def("amx_self_check_emulated", &amx_self_check_emulated);
  m.def("quantize_rows", &quantize_rows_py);
  m.def("w4a8_path", []() { return std::string(w4a8_path()); });
  m.def("product_path", []() { return product_path(); });
  m.def("pre_attention", &pre_attention);
  m.def("attention", &attention);
  m.def("paged_attention", &paged_attention, py::arg("q"), py::arg("k_pool"), py::arg("v_pool"), py::arg("table"),
        py::arg("row_index"), py::arg("width"), py::arg("span"), py::arg("bias"), py::arg("scale"), py::arg("causal"),
        py::arg("ref") = false);
  m.def("attention_kernel", []() { return std::string(ATTEND_KERNEL); });
  m.def("silu_mul", &silu_mul);
  m.def("post_attention", &post_attention);
  m.def("layer_paged", &layer_paged);
}
