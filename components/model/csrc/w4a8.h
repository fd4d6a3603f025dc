// Integer products of the w4a8 precision: 4-bit layer matrices (ggml's Q4_1: w = d q + m, q in
// 0..15) and the 8-bit LM head (Q8_0: w = d q, q in -128..127) times activations quantized per row
// to int8 in blocks of 32 (one scale a block and the block's sum, as llama.cpp's Q8_1). Included by
// decode_ops.cpp inside its anonymous namespace, after its includes and helpers.
//
// Why integers: a block's sum of 32 products is exact in int32, whatever instructions compute it
// (`vpdpbusd` with AVX512-VNNI or AVX-VNNI, `vpmaddubsw` + `vpmaddwd` with AVX2, `tdpbsud` on AMX's
// int8 tiles, a loop in the scalar reference), and a nibble becomes an int8 with one AND or one shift. What follows is float32
// in a fixed order per output and row, over the blocks in K order:
//     acc = fma(float(isum), d_w * d_x, acc)       then, Q4_1 only,   acc = fma(m_w, s_x, acc)
// with s_x = d_x * float(sum of the block's int8 activations). Every path does exactly these float32
// operations (fma is exact-then-rounded everywhere), so each path equals the scalar reference bit for
// bit, and a row's bits depend on its own data alone: batch invariance by construction.
//
// Layouts (made once at load, components/model/linear.py `native_w4a8_layout` / `native_w8a8_layout`),
// blocks of 16 outputs so that one 64-byte vector holds 16 outputs x 4 inputs, the operand of one
// `vpdpbusd` against 4 int8 activations broadcast to every lane:
// - Q4: codes (N / 16, K / 32, 4, 64) uint8: vector j, lane n, byte i holds output n's code for input
//   4 j + i in its low nibble and for input 16 + 4 j + i in its high nibble; dm (N / 16, K / 32, 2, 16)
//   float16: the 16 outputs' d, then their m.
// - Q8: codes (N / 16, K / 32, 8, 64) uint8 = q + 128: vector j, lane n, byte i holds output n's input
//   4 j + i; d (N / 16, K / 32, 16) float16. The unsigned codes make Σ (q + 128) a, from which
//   128 Σ a is taken back (exact); AVX2, whose byte product saturates past 16 bits, multiplies |q| by
//   a with q's sign instead.

constexpr int64_t IB = 16;  // outputs a block
constexpr int64_t IG = 32;  // inputs a group (a quantization block of the activations and weights)

inline float half_float(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }  // exact

// Rows x (M, K) bfloat16 quantized per block of 32: a = round(x 127 / amax) in -127..127 (to nearest
// even), dx = amax / 127, sx = dx * float(sum a), asum = sum a. One function for every path.
struct QRows {
  torch::Tensor a, dx, sx, asum;  // (M, K) int8, (M, K / 32) float32 x 2, int32
};

QRows quantize_rows(const torch::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), G = K / IG;
  QRows q{torch::empty({M, K}, x.options().dtype(torch::kInt8)), torch::empty({M, G}, x.options().dtype(torch::kFloat)),
          torch::empty({M, G}, x.options().dtype(torch::kFloat)), torch::empty({M, G}, x.options().dtype(torch::kInt))};
  const auto* xp = x.data_ptr<at::BFloat16>();
  auto* ap = q.a.data_ptr<int8_t>();
  float* dp = q.dx.data_ptr<float>();
  float* sp = q.sx.data_ptr<float>();
  int32_t* up = q.asum.data_ptr<int32_t>();
  at::parallel_for(0, M * G, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t rg = lo; rg < hi; ++rg) {
      const at::BFloat16* xb = xp + rg * IG;  // row r = rg / G, group g = rg % G: contiguous
      float amax = 0.0f;
      for (int64_t i = 0; i < IG; ++i) amax = std::max(amax, std::fabs(f32(xb[i])));
      const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
      int32_t s = 0;
      for (int64_t i = 0; i < IG; ++i) {
        const float v = std::nearbyint(f32(xb[i]) * id);  // the default rounding: to nearest even
        const int32_t a = static_cast<int32_t>(std::min(127.0f, std::max(-127.0f, v)));
        ap[rg * IG + i] = static_cast<int8_t>(a);
        s += a;
      }
      dp[rg] = d;
      up[rg] = s;
      sp[rg] = d * static_cast<float>(s);
    }
  });
  return q;
}

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  __builtin_memcpy(&v, p, 4);
  return v;
}

// ---- the scalar reference: the arithmetic every path must reproduce ----
void q4_ref(const QRows& q, const uint8_t* codes, const uint16_t* dm, float* y, int64_t N, int64_t K) {
  const int64_t M = q.a.size(0), G = K / IG;
  const int8_t* a = q.a.data_ptr<int8_t>();
  const float* dx = q.dx.data_ptr<float>();
  const float* sx = q.sx.data_ptr<float>();
  for (int64_t r = 0; r < M; ++r)
    for (int64_t n = 0; n < N; ++n) {
      const int64_t b = n / IB, l = n % IB;
      float acc = 0.0f;
      for (int64_t g = 0; g < G; ++g) {
        const uint8_t* c = codes + (b * G + g) * 256;
        const int8_t* ar = a + r * K + g * IG;
        int32_t isum = 0;
        for (int64_t j = 0; j < 4; ++j)
          for (int64_t i = 0; i < 4; ++i) {
            const uint8_t byte = c[64 * j + 4 * l + i];
            isum += static_cast<int32_t>(byte & 0x0F) * ar[4 * j + i] + static_cast<int32_t>(byte >> 4) * ar[16 + 4 * j + i];
          }
        const uint16_t* dmg = dm + (b * G + g) * 32;
        const float t = half_float(dmg[l]) * dx[r * G + g];
        acc = std::fma(static_cast<float>(isum), t, acc);
        acc = std::fma(half_float(dmg[16 + l]), sx[r * G + g], acc);
      }
      y[r * N + n] = acc;
    }
}

void q8_ref(const QRows& q, const uint8_t* codes, const uint16_t* d, float* y, int64_t N, int64_t K) {
  const int64_t M = q.a.size(0), G = K / IG;
  const int8_t* a = q.a.data_ptr<int8_t>();
  const float* dx = q.dx.data_ptr<float>();
  for (int64_t r = 0; r < M; ++r)
    for (int64_t n = 0; n < N; ++n) {
      const int64_t b = n / IB, l = n % IB;
      float acc = 0.0f;
      for (int64_t g = 0; g < G; ++g) {
        const uint8_t* c = codes + (b * G + g) * 512;
        const int8_t* ar = a + r * K + g * IG;
        int32_t isum = 0;
        for (int64_t j = 0; j < 8; ++j)
          for (int64_t i = 0; i < 4; ++i) isum += (static_cast<int32_t>(c[64 * j + 4 * l + i]) - 128) * ar[4 * j + i];
        acc = std::fma(static_cast<float>(isum), half_float(d[(b * G + g) * 16 + l]) * dx[r * G + g], acc);
      }
      y[r * N + n] = acc;
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// ---- AVX512-VNNI: one zmm = a block's 16 outputs; R rows x B blocks of sums in registers ----
constexpr const char* W4A8_PATH = "avx512_vnni";

// acc += dot4(w, the 4 int8 at p broadcast to every lane), the broadcast folded into the instruction
// (`{1to16}`: GCC emits a separate vpbroadcastd for `_mm512_set1_epi32`, one more vector op a product).
inline __m512i dpbusd_bcast(__m512i acc, __m512i w, const int8_t* p) {
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(p)));
  return acc;
}

template <int R, int B>
inline void q4_tile(const int8_t* a, const float* dx, const float* sx, int64_t K, const uint8_t* cb, const uint16_t* db,
                    int64_t bstride_c, int64_t bstride_d, float* y, int64_t N) {
  const int64_t G = K / IG;
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  __m512 acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < B; ++k) acc[r][k] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    for (int k = 0; k < B; ++k) {
      const uint8_t* c = cb + k * bstride_c + g * 256;
      const uint16_t* dm = db + k * bstride_d + g * 32;
      __m512i lo_sum[R], hi_sum[R];
      for (int r = 0; r < R; ++r) lo_sum[r] = hi_sum[r] = _mm512_setzero_si512();
      for (int j = 0; j < 4; ++j) {
        const __m512i w = _mm512_loadu_si512(c + 64 * j);
        const __m512i lo = _mm512_and_si512(w, m4), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), m4);
        for (int r = 0; r < R; ++r) {
          const int8_t* ar = a + r * K + g * IG;
          lo_sum[r] = dpbusd_bcast(lo_sum[r], lo, ar + 4 * j);
          hi_sum[r] = dpbusd_bcast(hi_sum[r], hi, ar + 16 + 4 * j);
        }
      }
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dm)));
      const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dm + 16)));
      for (int r = 0; r < R; ++r) {
        const __m512 f = _mm512_cvtepi32_ps(_mm512_add_epi32(lo_sum[r], hi_sum[r]));
        acc[r][k] = _mm512_fmadd_ps(f, _mm512_mul_ps(d, _mm512_set1_ps(dx[r * G + g])), acc[r][k]);
        acc[r][k] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[r * G + g]), acc[r][k]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < B; ++k) _mm512_storeu_ps(y + r * N + k * IB, acc[r][k]);
}

template <int R, int B>
inline void q8_tile(const int8_t* a, const float* dx, const int32_t* asum, int64_t K, const uint8_t* cb, const uint16_t* db,
                    int64_t bstride_c, int64_t bstride_d, float* y, int64_t N) {
  const int64_t G = K / IG;
  __m512 acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < B; ++k) acc[r][k] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    for (int k = 0; k < B; ++k) {
      const uint8_t* c = cb + k * bstride_c + g * 512;
      __m512i s0[R], s1[R];
      for (int r = 0; r < R; ++r) s0[r] = s1[r] = _mm512_setzero_si512();
      for (int j = 0; j < 8; j += 2) {
        const __m512i w0 = _mm512_loadu_si512(c + 64 * j), w1 = _mm512_loadu_si512(c + 64 * (j + 1));
        for (int r = 0; r < R; ++r) {
          const int8_t* ar = a + r * K + g * IG;
          s0[r] = dpbusd_bcast(s0[r], w0, ar + 4 * j);
          s1[r] = dpbusd_bcast(s1[r], w1, ar + 4 * j + 4);
        }
      }
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(db + k * bstride_d + g * 16)));
      for (int r = 0; r < R; ++r) {
        const __m512i isum = _mm512_sub_epi32(_mm512_add_epi32(s0[r], s1[r]), _mm512_set1_epi32(128 * asum[r * G + g]));
        acc[r][k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, _mm512_set1_ps(dx[r * G + g])), acc[r][k]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < B; ++k) _mm512_storeu_ps(y + r * N + k * IB, acc[r][k]);
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// ---- AVX2 (AVX-VNNI where built for it): a ymm = 8 outputs, a block done as two halves ----
#if defined(__AVXVNNI__)
constexpr const char* W4A8_PATH = "avx_vnni";
#else
constexpr const char* W4A8_PATH = "avx2";
#endif

// Q4: codes times activations in 16-bit pair sums (at most 2 x 15 x 127 = 3810 a product, 8 of them
// = 30480: no saturation), widened once a group; or VNNI's dot products of four.
template <int R, int B>
inline void q4_tile(const int8_t* a, const float* dx, const float* sx, int64_t K, const uint8_t* cb, const uint16_t* db,
                    int64_t bstride_c, int64_t bstride_d, float* y, int64_t N) {
  const int64_t G = K / IG;
  const __m256i m4 = _mm256_set1_epi8(0x0F);
#if !defined(__AVXVNNI__)
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  for (int h = 0; h < 2 * B; ++h) {  // half h: block h / 2, outputs 8 (h % 2) ..
    const uint8_t* ch = cb + (h / 2) * bstride_c + 32 * (h % 2);
    const uint16_t* dh = db + (h / 2) * bstride_d + 8 * (h % 2);
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      __m256i s[R];
      for (int r = 0; r < R; ++r) s[r] = _mm256_setzero_si256();
      for (int j = 0; j < 4; ++j) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ch + g * 256 + 64 * j));
        const __m256i lo = _mm256_and_si256(w, m4), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), m4);
        for (int r = 0; r < R; ++r) {
          const int8_t* ar = a + r * K + g * IG;
#if defined(__AVXVNNI__)
          s[r] = _mm256_dpbusd_avx_epi32(s[r], lo, _mm256_set1_epi32(load_i32(ar + 4 * j)));
          s[r] = _mm256_dpbusd_avx_epi32(s[r], hi, _mm256_set1_epi32(load_i32(ar + 16 + 4 * j)));
#else
          s[r] = _mm256_add_epi16(s[r], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(load_i32(ar + 4 * j))));
          s[r] = _mm256_add_epi16(s[r], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(load_i32(ar + 16 + 4 * j))));
#endif
        }
      }
      const uint16_t* dm = dh + g * 32;
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dm)));
      const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dm + 16)));
      for (int r = 0; r < R; ++r) {
#if defined(__AVXVNNI__)
        const __m256i isum = s[r];
#else
        const __m256i isum = _mm256_madd_epi16(s[r], ones);
#endif
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d, _mm256_set1_ps(dx[r * G + g])), acc[r]);
        acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(sx[r * G + g]), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * N + (h / 2) * IB + 8 * (h % 2), acc[r]);
  }
}

// Q8: |q| times a with q's sign (at most 2 x 128 x 127 = 32512 a pair: no saturation), widened at
// once; or VNNI on the unsigned codes, 128 sum(a) taken back.
template <int R, int B>
inline void q8_tile(const int8_t* a, const float* dx, const int32_t* asum, int64_t K, const uint8_t* cb, const uint16_t* db,
                    int64_t bstride_c, int64_t bstride_d, float* y, int64_t N) {
  const int64_t G = K / IG;
#if !defined(__AVXVNNI__)
  const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8(static_cast<char>(0x80));
#endif
  for (int h = 0; h < 2 * B; ++h) {
    const uint8_t* ch = cb + (h / 2) * bstride_c + 32 * (h % 2);
    const uint16_t* dh = db + (h / 2) * bstride_d + 8 * (h % 2);
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      __m256i s[R];
      for (int r = 0; r < R; ++r) s[r] = _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ch + g * 512 + 64 * j));
#if defined(__AVXVNNI__)
        for (int r = 0; r < R; ++r)
          s[r] = _mm256_dpbusd_avx_epi32(s[r], w, _mm256_set1_epi32(load_i32(a + r * K + g * IG + 4 * j)));
#else
        const __m256i q = _mm256_xor_si256(w, flip), aq = _mm256_abs_epi8(q);
        for (int r = 0; r < R; ++r) {
          const __m256i sa = _mm256_sign_epi8(_mm256_set1_epi32(load_i32(a + r * K + g * IG + 4 * j)), q);
          s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(_mm256_maddubs_epi16(aq, sa), ones));
        }
#endif
      }
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dh + g * 16)));
      for (int r = 0; r < R; ++r) {
#if defined(__AVXVNNI__)
        const __m256i isum = _mm256_sub_epi32(s[r], _mm256_set1_epi32(128 * asum[r * G + g]));
#else
        const __m256i isum = s[r];
#endif
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d, _mm256_set1_ps(dx[r * G + g])), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * N + (h / 2) * IB + 8 * (h % 2), acc[r]);
  }
}

#else
constexpr const char* W4A8_PATH = "scalar";
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// All rows against blocks [b0, b1): a block's rows R at a time (its weights then come from L1 for
// the passes after the first).
template <bool Q8>
void int_blocks(const QRows& q, const uint8_t* codes, const uint16_t* scales, float* y, int64_t N, int64_t K,
                int64_t b0, int64_t b1) {
  const int64_t M = q.a.size(0), G = K / IG;
  const int8_t* a = q.a.data_ptr<int8_t>();
  const float* dx = q.dx.data_ptr<float>();
  const float* sx = q.sx.data_ptr<float>();
  const int32_t* asum = q.asum.data_ptr<int32_t>();
  const int64_t cs = G * (Q8 ? 512 : 256), ds = G * (Q8 ? 16 : 32);  // a block's codes, scales
  auto run = [&](auto rows, auto blocks, int64_t r, int64_t b) {
    constexpr int R = decltype(rows)::value, B = decltype(blocks)::value;
    if constexpr (Q8)
      q8_tile<R, B>(a + r * K, dx + r * G, asum + r * G, K, codes + b * cs, scales + b * ds, cs, ds, y + r * N + b * IB, N);
    else
      q4_tile<R, B>(a + r * K, dx + r * G, sx + r * G, K, codes + b * cs, scales + b * ds, cs, ds, y + r * N + b * IB, N);
  };
  using I1 = std::integral_constant<int, 1>;
  using I2 = std::integral_constant<int, 2>;
  using I3 = std::integral_constant<int, 3>;
  using I4 = std::integral_constant<int, 4>;
  for (int64_t b = b0; b < b1; ++b)  // one block at a time (measured: two interleaved streams of weights read slower)
    for (int64_t r = 0; r < M;) {
      const int64_t left = M - r;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)  // 3 zmm a row (two integer sums, the float one): up to 8 rows
      if (left >= 8) { run(std::integral_constant<int, 8>{}, I1{}, r, b); r += 8; continue; }
      if (left >= 6) { run(std::integral_constant<int, 6>{}, I1{}, r, b); r += 6; continue; }
#endif
      if (left >= 4) run(I4{}, I1{}, r, b), r += 4;
      else if (left == 3) run(I3{}, I1{}, r, b), r += 3;
      else if (left == 2) run(I2{}, I1{}, r, b), r += 2;
      else run(I1{}, I1{}, r, b), r += 1;
    }
}
constexpr bool W4A8_SIMD = true;
#else
template <bool Q8>
void int_blocks(const QRows&, const uint8_t*, const uint16_t*, float*, int64_t, int64_t, int64_t, int64_t) {}
constexpr bool W4A8_SIMD = false;
#endif

#if defined(__AVX512F__)
// ---- AMX int8 tiles: `tdpbsud` (int8 activations x uint8 codes) over one group of 32 inputs ----
// A tile of up to 16 rows x 16 outputs: A = the rows' int8 activations of group g (rows x 32 bytes,
// read in place, K bytes apart), B = the block's codes of group g in the pair-of-four layout the tiles
// expect (8 rows x 16 outputs x 4 inputs: the w4a8 layout's vectors, nibbles split for Q4), C = the
// int32 block sums, exact as on every path. One group a product, because each group has its own
// scales; C is then stored and scaled in float32 exactly as the AVX512-VNNI path does, so the bits
// equal the scalar reference's. Two groups are in flight (C, A, B in tiles 0 / 1, 2 / 3, 4 / 5).
//
// `Tiles` is the CPU's (AmxTiles) or EmulatedTiles: the instructions' definitions in memory, which
// lets a CPU without AMX check the kernel's layouts and order against the reference.
struct EmulatedTiles {
  struct State {
    TileConfig cfg;
    alignas(64) uint8_t t[8][16][64];
  };
  static State& s() {
    static thread_local State st;
    return st;
  }
  static void config(const TileConfig& c) {
    s().cfg = c;
    std::memset(s().t, 0, sizeof(s().t));
  }
  static void release() {}
  static void zero(int t) { std::memset(s().t[t], 0, sizeof(s().t[t])); }
  static void load(int t, const void* p, int64_t stride) {  // rows past cfg.rows and bytes past colsb read as 0
    State& st = s();
    zero(t);
    for (int r = 0; r < st.cfg.rows[t]; ++r) std::memcpy(st.t[t][r], static_cast<const uint8_t*>(p) + r * stride, st.cfg.colsb[t]);
  }
  static void store(int t, void* p, int64_t stride) {
    State& st = s();
    for (int r = 0; r < st.cfg.rows[t]; ++r) std::memcpy(static_cast<uint8_t*>(p) + r * stride, st.t[t][r], st.cfg.colsb[t]);
  }
  // tdpbsud c, a, b: C[m][n] += sum over k < colsb(A) / 4, i < 4 of int8(A[m][4k + i]) * uint8(B[k][4n + i])
  static void dpbsud(int c, int a, int b) {
    State& st = s();
    for (int m = 0; m < st.cfg.rows[c]; ++m)
      for (int n = 0; n < st.cfg.colsb[c] / 4; ++n) {
        int32_t acc;
        std::memcpy(&acc, st.t[c][m] + 4 * n, 4);
        for (int k = 0; k < st.cfg.colsb[a] / 4; ++k)
          for (int i = 0; i < 4; ++i)
            acc += static_cast<int32_t>(static_cast<int8_t>(st.t[a][m][4 * k + i])) * static_cast<int32_t>(st.t[b][k][4 * n + i]);
        std::memcpy(st.t[c][m] + 4 * n, &acc, 4);
      }
  }
};

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AMX_BF16__)
constexpr bool AMX_INT8_BUILT = true;
struct AmxTiles {  // GCC's tile macros take the tile's number as a literal: one case a tile
  static void config(const TileConfig& c) { _tile_loadconfig(&c); }
  static void release() { _tile_release(); }
#define TILE_CASES(op) \
  switch (t) { op(0) op(1) op(2) op(3) op(4) op(5) op(6) op(7) }
  static void zero(int t) {
#define OP(n) case n: _tile_zero(n); break;
    TILE_CASES(OP)
#undef OP
  }
  static void load(int t, const void* p, int64_t stride) {
#define OP(n) case n: _tile_loadd(n, p, stride); break;
    TILE_CASES(OP)
#undef OP
  }
  static void store(int t, void* p, int64_t stride) {
#define OP(n) case n: _tile_stored(n, p, stride); break;
    TILE_CASES(OP)
#undef OP
  }
#undef TILE_CASES
  static void dpbsud(int c, int, int) {  // c, then its A and B: c + 2 and c + 4
    if (c == 0) _tile_dpbsud(0, 2, 4);
    else _tile_dpbsud(1, 3, 5);
  }
};
#else
constexpr bool AMX_INT8_BUILT = false;
#endif

template <class Tiles, bool Q8>
void amx_int_blocks(const QRows& q, const uint8_t* codes, const uint16_t* scales, float* y, int64_t N, int64_t K,
                    int64_t b0, int64_t b1) {
  const int64_t M = q.a.size(0), G = K / IG;
  const int8_t* a = q.a.data_ptr<int8_t>();
  const float* dx = q.dx.data_ptr<float>();
  const float* sx = q.sx.data_ptr<float>();
  const int32_t* asum = q.asum.data_ptr<int32_t>();
  const int64_t per = Q8 ? 512 : 256, cs = G * per, ds = G * (Q8 ? 16 : 32);
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  alignas(64) uint8_t wbuf[2][512];
  alignas(64) int32_t cbuf[2][16][16];
  int configured = 0;
  for (int64_t r0 = 0; r0 < M; r0 += 16) {
    const int rows = static_cast<int>(std::min<int64_t>(16, M - r0));
    if (rows != configured) {
      TileConfig cfg;
      for (int t = 0; t < 2; ++t) {
        cfg.rows[t] = rows, cfg.colsb[t] = 64;          // C: rows x 16 int32
        cfg.rows[2 + t] = rows, cfg.colsb[2 + t] = IG;  // A: rows x 32 int8
        cfg.rows[4 + t] = 8, cfg.colsb[4 + t] = 64;     // B: 8 x (16 outputs x 4 inputs)
      }
      Tiles::config(cfg);
      configured = rows;
    }
    const int8_t* ar = a + r0 * K;
    for (int64_t b = b0; b < b1; ++b) {
      __m512 acc[16];
      for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
      for (int64_t g0 = 0; g0 < G; g0 += 2) {
        const int n = static_cast<int>(std::min<int64_t>(2, G - g0));
        for (int s = 0; s < n; ++s) {
          const uint8_t* c = codes + b * cs + (g0 + s) * per;
          if (!Q8) {
            for (int j = 0; j < 4; ++j) {
              const __m512i w = _mm512_loadu_si512(c + 64 * j);
              _mm512_store_si512(wbuf[s] + 64 * j, _mm512_and_si512(w, m4));
              _mm512_store_si512(wbuf[s] + 64 * (4 + j), _mm512_and_si512(_mm512_srli_epi16(w, 4), m4));
            }
            c = wbuf[s];
          }
          memory_fence();
          Tiles::zero(s);
          Tiles::load(2 + s, ar + (g0 + s) * IG, K);
          Tiles::load(4 + s, c, 64);
          Tiles::dpbsud(s, 2 + s, 4 + s);
        }
        for (int s = 0; s < n; ++s) Tiles::store(s, cbuf[s], 64);
        memory_fence();
        for (int s = 0; s < n; ++s) {
          const int64_t g = g0 + s;
          if constexpr (Q8) {
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + b * ds + g * 16)));
            for (int r = 0; r < rows; ++r) {
              const int64_t rg = (r0 + r) * G + g;
              const __m512i isum = _mm512_sub_epi32(_mm512_load_si512(cbuf[s][r]), _mm512_set1_epi32(128 * asum[rg]));
              acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, _mm512_set1_ps(dx[rg])), acc[r]);
            }
          } else {
            const uint16_t* dm = scales + b * ds + g * 32;
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dm)));
            const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dm + 16)));
            for (int r = 0; r < rows; ++r) {
              const int64_t rg = (r0 + r) * G + g;
              const __m512 f = _mm512_cvtepi32_ps(_mm512_load_si512(cbuf[s][r]));
              acc[r] = _mm512_fmadd_ps(f, _mm512_mul_ps(d, _mm512_set1_ps(dx[rg])), acc[r]);
              acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[rg]), acc[r]);
            }
          }
        }
      }
      for (int r = 0; r < rows; ++r) _mm512_storeu_ps(y + (r0 + r) * N + b * IB, acc[r]);
    }
  }
  Tiles::release();
}
constexpr bool AMX_EMULATION_BUILT = true;
#else
constexpr bool AMX_INT8_BUILT = false;
constexpr bool AMX_EMULATION_BUILT = false;
#endif

#if defined(__AVX512F__)
// The AMX kernel against the scalar reference on a small problem that fills no tile (17 rows, 3
// groups, Q4 and Q8): bit for bit, else the kernel is not used. The process's first w4a8 product
// runs it once, so a CPU whose tiles disagree with the layouts here falls back to its SIMD path
// rather than compute wrong sums. `Tiles`: AmxTiles, or EmulatedTiles to check the check itself.
template <class Tiles>
bool amx_self_check() {
  const int64_t M = 17, K = 96, G = K / IG, NB = 2, N = NB * IB;
  uint32_t state = 12345u;
  auto next = [&]() { return state = state * 1664525u + 1013904223u; };
  auto x = torch::empty({M, K}, torch::kFloat);
  float* xp = x.data_ptr<float>();
  for (int64_t i = 0; i < M * K; ++i) xp[i] = static_cast<float>(static_cast<int32_t>(next() >> 8) % 2001 - 1000) / 250.0f;
  const QRows q = quantize_rows(x.to(torch::kBFloat16));
  std::vector<uint8_t> c4(NB * G * 256), c8(NB * G * 512);
  std::vector<uint16_t> dm(NB * G * 32), d8(NB * G * 16);
  for (auto& b : c4) b = static_cast<uint8_t>(next() >> 24);
  for (auto& b : c8) b = static_cast<uint8_t>(next() >> 24);
  for (auto& h : dm) h = c10::Half(static_cast<float>(static_cast<int32_t>(next() >> 20) % 200 - 100) / 1000.0f).x;
  for (auto& h : d8) h = c10::Half(static_cast<float>(static_cast<int32_t>(next() >> 20) % 100 + 1) / 1000.0f).x;
  std::vector<float> want(M * N), got(M * N);
  q4_ref(q, c4.data(), dm.data(), want.data(), N, K);
  amx_int_blocks<Tiles, false>(q, c4.data(), dm.data(), got.data(), N, K, 0, NB);
  if (std::memcmp(want.data(), got.data(), want.size() * sizeof(float)) != 0) return false;
  q8_ref(q, c8.data(), d8.data(), want.data(), N, K);
  amx_int_blocks<Tiles, true>(q, c8.data(), d8.data(), got.data(), N, K, 0, NB);
  return std::memcmp(want.data(), got.data(), want.size() * sizeof(float)) == 0;
}
#endif

// The path the integer products take in this process: "amx_int8" where AMX is the products' path
// (product_path), the build has its int8 tiles and the kernel passed its self-check on this CPU;
// else the build's SIMD path (W4A8_PATH). Decided once per process.
const char* w4a8_path() {
  static const bool amx = [] {
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AMX_BF16__)
    if (product_path() != "amx") return false;
    if (amx_self_check<AmxTiles>()) return true;
    std::fprintf(stderr, "warning: the AMX int8 kernel disagrees with its scalar reference on this CPU: "
                         "w4a8 takes its %s path\n", W4A8_PATH);
#endif
    return false;
  }();
  return amx ? "amx_int8" : W4A8_PATH;
}

// The kernels int_mm can take: the process's own, the scalar reference, or the AMX kernel on
// emulated tiles (tests: the AMX kernel's layouts checked on any AVX-512 CPU).
enum class IntKernel { Own, Reference, EmulatedAmx };

// y (M, N) = x (M, K) W^T for the w4a8 layouts; `ref`: the scalar reference. The Q4 product's outputs
// are rounded to bfloat16 once (a layer's activations), the head's stay float32 (logits).
torch::Tensor int_mm(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, bool q8, IntKernel kernel) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && codes.scalar_type() == torch::kUInt8 &&
              (scales.scalar_type() == torch::kHalf || scales.scalar_type() == torch::kShort),
              "w4a8: bfloat16 x, uint8 codes, float16 scales (or their bits as int16)");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), G = K / IG, N = codes.size(0) * IB;
  const int64_t per = q8 ? 512 : 256;
  TORCH_CHECK(K % IG == 0 && codes.is_contiguous() && scales.is_contiguous() && codes.dim() == 4 && codes.size(1) == G &&
              codes.size(2) * codes.size(3) == per && scales.size(0) == codes.size(0) && scales.size(1) == G &&
              scales.numel() == codes.size(0) * G * (q8 ? 16 : 32),
              "w4a8: x (M, K) with K % 32 == 0, codes (N / 16, K / 32, ", per / 64, ", 64), scales (N / 16, K / 32, ...)");
  const QRows q = quantize_rows(x);
  auto y = torch::empty({M, N}, x.options().dtype(torch::kFloat));
  const auto* cp = codes.data_ptr<uint8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr());
  float* yp = y.data_ptr<float>();
  TORCH_CHECK(kernel != IntKernel::EmulatedAmx || AMX_EMULATION_BUILT, "w4a8: the AMX emulation needs an AVX-512 build");
  if (kernel == IntKernel::Reference || !W4A8_SIMD) {
    if (q8) q8_ref(q, cp, sp, yp, N, K);
    else q4_ref(q, cp, sp, yp, N, K);
  } else {
    const bool amx = kernel == IntKernel::Own && std::string(w4a8_path()) == "amx_int8";
    at::parallel_for(0, N / IB, 4, [&](int64_t b0, int64_t b1) {
#if defined(__AVX512F__)
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AMX_BF16__)
      if (amx) {
        if (q8) amx_int_blocks<AmxTiles, true>(q, cp, sp, yp, N, K, b0, b1);
        else amx_int_blocks<AmxTiles, false>(q, cp, sp, yp, N, K, b0, b1);
        return;
      }
#endif
      if (kernel == IntKernel::EmulatedAmx) {
        if (q8) amx_int_blocks<EmulatedTiles, true>(q, cp, sp, yp, N, K, b0, b1);
        else amx_int_blocks<EmulatedTiles, false>(q, cp, sp, yp, N, K, b0, b1);
        return;
      }
#endif
      (void)amx;
      if (q8) int_blocks<true>(q, cp, sp, yp, N, K, b0, b1);
      else int_blocks<false>(q, cp, sp, yp, N, K, b0, b1);
    });
  }
  return q8 ? y : y.to(torch::kBFloat16);
}

bool amx_self_check_emulated() {  // tests: the self-check's own problem, on emulated tiles
#if defined(__AVX512F__)
  return amx_self_check<EmulatedTiles>();
#else
  return false;
#endif
}

IntKernel int_kernel(bool ref, bool emulate_amx) {
  return ref ? IntKernel::Reference : emulate_amx ? IntKernel::EmulatedAmx : IntKernel::Own;
}
torch::Tensor q4i8_mm(torch::Tensor x, torch::Tensor codes, torch::Tensor dm, bool ref, bool emulate_amx) {
  return int_mm(x, codes, dm, false, int_kernel(ref, emulate_amx));
}
torch::Tensor q8i8_mm(torch::Tensor x, torch::Tensor codes, torch::Tensor d, bool ref, bool emulate_amx) {
  return int_mm(x, codes, d, true, int_kernel(ref, emulate_amx));
}

std::vector<torch::Tensor> quantize_rows_py(torch::Tensor x) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && x.dim() == 2 && x.size(1) % IG == 0, "quantize_rows: bfloat16 (M, K), K % 32 == 0");
  const QRows q = quantize_rows(x.contiguous());
  return {q.a, q.dx, q.sx, q.asum};
}
