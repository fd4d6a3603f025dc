// Attention over the cache for the fused kernels: included by decode_ops.cpp inside its anonymous
// namespace, after its includes and common helpers (f32, LANES, exp_neg).
//
// Two entry points share the kernels: `attention` reads keys and values laid out per sequence
// (B, nkv, S, hs) (the contiguous KV's slabs, or any copy), `paged_attention` reads the paged KV's
// pool in place through each sequence's block table (no gathered copy). Each (row, head) walks the
// slots it may see, compacted, in slot order, with one kernel's arithmetic: which memory a slot's
// key lies in never changes a bit, so both entry points give a row the same output.
//
// The bfloat16 kernels for head dims 64 and 128 (`attend_heads_bf16`, AVX-512 or AVX2 + FMA) share
// one order of arithmetic, which `attend_head_ref` spells out one value at a time:
// - a score: 16 lanes, lane l the FMA chain over dims l, l + 16, ... (its first term a plain
//   product), the lanes summed by halves (l += l + 8, + 4, + 2, + 1), then fma(sum, scale, bias);
// - the row's softmax (`softmax_scores`, one compiled copy for every kernel);
// - each output dim's FMA chain over the slots in order from 0, times 1 / sum, rounded to bfloat16.
// AVX-512 holds the 16 lanes in one register, AVX2 in two (dims l and l + 8 of each 16): the same
// sums, so an AVX2-only CPU and an AVX-512 one give the same bits, and tests hold each vector
// kernel to the reference bit for bit (tests/test_paged_attention.py).

// The row's softmax over its n scores, in place: the max, exp_neg of each score's distance to it,
// their sum in slot order; returns 1 / sum. Not inlined: the vector kernels and the reference run
// this one compiled copy, so how the compiler vectorizes or contracts exp_neg cannot part them.
__attribute__((noinline)) float softmax_scores(float* sc, int64_t n) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) mx = sc[j] > mx ? sc[j] : mx;
  for (int64_t j = 0; j < n; ++j) sc[j] = exp_neg(sc[j] - mx);
  float sum = 0.0f;
  for (int64_t j = 0; j < n; ++j) sum += sc[j];
  return 1.0f / sum;
}

// One (row, head) for any cache dtype and head dim (float32 / float64 caches, head dims the vector
// kernels do not cover, CPUs without AVX2): each dot product in LANES partial sums over the head
// dim. Slot j's key lies at K + rows[j] * ks, its value at V + rows[j] * vs; bv[j] its additive bias
// (bv null: 0). q: hs float32; scores: n; out: hs.
template <typename KT>
void attend_row(const float* q, const KT* K, const KT* V, int64_t ks, int64_t vs, const int64_t* rows,
                const float* bv, int64_t n, int64_t hs, float scale, float* scores, float* out) {
  for (int64_t j = 0; j < n; ++j) {
    const KT* k = K + rows[j] * ks;
    float acc[LANES] = {0};
    int64_t d = 0;
    for (; d + LANES <= hs; d += LANES)
      for (int l = 0; l < LANES; ++l) acc[l] += q[d + l] * f32(k[d + l]);
    for (int l = 0; d < hs; ++d, ++l) acc[l] += q[d] * f32(k[d]);
    for (int w2 = LANES / 2; w2 > 0; w2 /= 2)
      for (int l = 0; l < w2; ++l) acc[l] += acc[l + w2];
    scores[j] = acc[0] * scale + (bv ? bv[j] : 0.0f);
  }
  const float inv = softmax_scores(scores, n);
  for (int64_t d = 0; d < hs; ++d) out[d] = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    const KT* v = V + rows[j] * vs;
    const float p = scores[j];
    for (int64_t d = 0; d < hs; ++d) out[d] += p * f32(v[d]);
  }
  for (int64_t d = 0; d < hs; ++d) out[d] *= inv;
}

// The bfloat16 vector kernels' arithmetic (above), one value at a time, for one head of hs = 16 HV
// dims (HV >= 2): what tests compare `attend_heads_bf16` with. Every FMA is an explicit std::fma and
// every other product and sum a lone operation, so no compiler contraction can change it.
void attend_head_ref(const float* q, const at::BFloat16* K, const at::BFloat16* V, int64_t ks, int64_t vs,
                     const int64_t* rows, const float* bv, int64_t n, int64_t hs, float scale, float* scores,
                     float* out) {
  for (int64_t j = 0; j < n; ++j) {
    const at::BFloat16* k = K + rows[j] * ks;
    float a[16];
    for (int l = 0; l < 16; ++l) a[l] = q[l] * f32(k[l]);
    for (int64_t c = 16; c < hs; c += 16)
      for (int l = 0; l < 16; ++l) a[l] = std::fma(q[c + l], f32(k[c + l]), a[l]);
    for (int w2 = 8; w2 > 0; w2 /= 2)
      for (int l = 0; l < w2; ++l) a[l] += a[l + w2];
    scores[j] = std::fma(a[0], scale, bv ? bv[j] : 0.0f);
  }
  const float inv = softmax_scores(scores, n);
  for (int64_t d = 0; d < hs; ++d) out[d] = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    const at::BFloat16* v = V + rows[j] * vs;
    const float p = scores[j];
    for (int64_t d = 0; d < hs; ++d) out[d] = std::fma(p, f32(v[d]), out[d]);
  }
  for (int64_t d = 0; d < hs; ++d) out[d] = out[d] * inv;
}

#if defined(__AVX512F__)
#define ATTEND_VECTOR "avx512"
inline __m512 bf16x16(const at::BFloat16* p) {  // 16 bfloat16 -> float32, exactly
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// G query heads sharing one bfloat16 kv head of 16 HV dims, each key and value converted once for
// the G heads and the outputs kept in registers; a head's 16 lanes are one register.
// q: G x hs float32; scores: G x n; out: G x hs.
template <int HV, int G>
void attend_heads_v(const float* q, const at::BFloat16* K, const at::BFloat16* V, int64_t ks, int64_t vs,
                    const int64_t* rows, const float* bv, int64_t n, float scale, float* scores, float* out) {
  constexpr int64_t hs = 16 * HV;
  __m512 qv[G][HV];
  for (int gi = 0; gi < G; ++gi)
    for (int c = 0; c < HV; ++c) qv[gi][c] = _mm512_loadu_ps(q + gi * hs + 16 * c);
  for (int64_t j = 0; j < n; ++j) {
    const at::BFloat16* k = K + rows[j] * ks;
    __m512 kv[HV];
    for (int c = 0; c < HV; ++c) kv[c] = bf16x16(k + 16 * c);
    const float b = bv ? bv[j] : 0.0f;
    for (int gi = 0; gi < G; ++gi) {
      __m512 acc = _mm512_mul_ps(qv[gi][0], kv[0]);
      for (int c = 1; c < HV; ++c) acc = _mm512_fmadd_ps(qv[gi][c], kv[c], acc);
      scores[gi * n + j] = std::fma(_mm512_reduce_add_ps(acc), scale, b);  // lanes by halves: + 8, + 4, + 2, + 1
    }
  }
  float inv[G];
  for (int gi = 0; gi < G; ++gi) inv[gi] = softmax_scores(scores + gi * n, n);
  __m512 o[G][HV];
  for (int gi = 0; gi < G; ++gi)
    for (int c = 0; c < HV; ++c) o[gi][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const at::BFloat16* v = V + rows[j] * vs;
    __m512 vv[HV];
    for (int c = 0; c < HV; ++c) vv[c] = bf16x16(v + 16 * c);
    for (int gi = 0; gi < G; ++gi) {
      const __m512 p = _mm512_set1_ps(scores[gi * n + j]);
      for (int c = 0; c < HV; ++c) o[gi][c] = _mm512_fmadd_ps(p, vv[c], o[gi][c]);
    }
  }
  for (int gi = 0; gi < G; ++gi)
    for (int c = 0; c < HV; ++c) _mm512_storeu_ps(out + gi * hs + 16 * c, _mm512_mul_ps(o[gi][c], _mm512_set1_ps(inv[gi])));
}
#elif defined(__AVX2__) && defined(__FMA__)
#define ATTEND_VECTOR "avx2"
inline __m256 bf16x8(const at::BFloat16* p) {  // 8 bfloat16 -> float32, exactly
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

// The 16 lanes (lo: 0..7, hi: 8..15) summed as _mm512_reduce_add_ps sums them: l += l + 8, + 4, + 2, + 1.
inline float hsum16(__m256 lo, __m256 hi) {
  const __m256 t = _mm256_add_ps(lo, hi);
  __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  u = _mm_add_ps(u, _mm_movehl_ps(u, u));
  return _mm_cvtss_f32(u) + _mm_cvtss_f32(_mm_shuffle_ps(u, u, 1));
}

// The AVX-512 kernel's sums in 8-lane registers: a head's 16 lanes are two (dims l and l + 8 of
// each 16). AVX2 has 16 registers: q stays in memory (each FMA loads its operand), the scores keep
// 2 G chains in flight, and the value sums run over the slots once per DV 16-dim chunks of the
// output (2 G DV accumulators), each pass reading a disjoint part of every value row.
// q: G x hs float32; scores: G x n; out: G x hs.
template <int HV, int G>
void attend_heads_v(const float* q, const at::BFloat16* K, const at::BFloat16* V, int64_t ks, int64_t vs,
                    const int64_t* rows, const float* bv, int64_t n, float scale, float* scores, float* out) {
  constexpr int64_t hs = 16 * HV;
  for (int64_t j = 0; j < n; ++j) {
    const at::BFloat16* k = K + rows[j] * ks;
    __m256 a[G][2];
    {
      const __m256 k0 = bf16x8(k), k1 = bf16x8(k + 8);
      for (int gi = 0; gi < G; ++gi) {
        a[gi][0] = _mm256_mul_ps(_mm256_loadu_ps(q + gi * hs), k0);
        a[gi][1] = _mm256_mul_ps(_mm256_loadu_ps(q + gi * hs + 8), k1);
      }
    }
    for (int c = 1; c < HV; ++c) {
      const __m256 k0 = bf16x8(k + 16 * c), k1 = bf16x8(k + 16 * c + 8);
      for (int gi = 0; gi < G; ++gi) {
        a[gi][0] = _mm256_fmadd_ps(_mm256_loadu_ps(q + gi * hs + 16 * c), k0, a[gi][0]);
        a[gi][1] = _mm256_fmadd_ps(_mm256_loadu_ps(q + gi * hs + 16 * c + 8), k1, a[gi][1]);
      }
    }
    const float b = bv ? bv[j] : 0.0f;
    for (int gi = 0; gi < G; ++gi) scores[gi * n + j] = std::fma(hsum16(a[gi][0], a[gi][1]), scale, b);
  }
  float inv[G];
  for (int gi = 0; gi < G; ++gi) inv[gi] = softmax_scores(scores + gi * n, n);
  constexpr int DV = G <= 2 ? 2 : 1;  // 16-dim chunks a pass: at most 8 accumulators
  for (int c0 = 0; c0 < HV; c0 += DV) {
    __m256 o[G][2 * DV];
    for (int gi = 0; gi < G; ++gi)
      for (int i = 0; i < 2 * DV; ++i) o[gi][i] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      const at::BFloat16* v = V + rows[j] * vs + 16 * c0;
      __m256 vv[2 * DV];
      for (int i = 0; i < 2 * DV; ++i) vv[i] = bf16x8(v + 8 * i);
      for (int gi = 0; gi < G; ++gi) {
        const __m256 p = _mm256_broadcast_ss(scores + gi * n + j);
        for (int i = 0; i < 2 * DV; ++i) o[gi][i] = _mm256_fmadd_ps(p, vv[i], o[gi][i]);
      }
    }
    for (int gi = 0; gi < G; ++gi)
      for (int i = 0; i < 2 * DV; ++i)
        _mm256_storeu_ps(out + gi * hs + 16 * c0 + 8 * i, _mm256_mul_ps(o[gi][i], _mm256_set1_ps(inv[gi])));
  }
}
#endif

#if defined(ATTEND_VECTOR)
// The G query heads of one bfloat16 kv head (hs = 16 HV), at most 4 a pass: their accumulators stay
// in registers. Each head's arithmetic is `attend_head_ref`'s whatever G.
template <int HV>
void attend_heads_bf16(int64_t G, const float* q, const at::BFloat16* K, const at::BFloat16* V, int64_t ks, int64_t vs,
                       const int64_t* rows, const float* bv, int64_t n, float scale, float* scores, float* out) {
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    const int64_t m = G - g0 < 4 ? G - g0 : 4;
    const float* qg = q + g0 * 16 * HV;
    float* og = out + g0 * 16 * HV;
    float* sg = scores + g0 * n;
    switch (m) {
      case 1: attend_heads_v<HV, 1>(qg, K, V, ks, vs, rows, bv, n, scale, sg, og); break;
      case 2: attend_heads_v<HV, 2>(qg, K, V, ks, vs, rows, bv, n, scale, sg, og); break;
      case 3: attend_heads_v<HV, 3>(qg, K, V, ks, vs, rows, bv, n, scale, sg, og); break;
      default: attend_heads_v<HV, 4>(qg, K, V, ks, vs, rows, bv, n, scale, sg, og); break;
    }
  }
}
constexpr const char* ATTEND_KERNEL = ATTEND_VECTOR;
#else
constexpr const char* ATTEND_KERNEL = "scalar";
#endif

// gc query heads (q: gc x hs float32, consecutive) sharing one kv head, over the n compacted slots
// (`attend_row`'s arguments), into out (gc x hs float32); scores: gc x n. `ref`: the scalar
// reference instead of the vector kernel, where a vector kernel applies (else the same kernel).
template <typename KT>
void attend_group(int64_t gc, const float* q, const KT* K, const KT* V, int64_t ks, int64_t vs, const int64_t* rows,
                  const float* bv, int64_t n, int64_t hs, float scale, bool ref, float* scores, float* out) {
  if constexpr (std::is_same<KT, at::BFloat16>::value) {
    if (hs == 64 || hs == 128) {
      if (ref) {
        for (int64_t gi = 0; gi < gc; ++gi)
          attend_head_ref(q + gi * hs, K, V, ks, vs, rows, bv, n, hs, scale, scores, out + gi * hs);
        return;
      }
#if defined(ATTEND_VECTOR)
      if (hs == 64) attend_heads_bf16<4>(gc, q, K, V, ks, vs, rows, bv, n, scale, scores, out);
      else attend_heads_bf16<8>(gc, q, K, V, ks, vs, rows, bv, n, scale, scores, out);
      return;
#endif
    }
  }
  for (int64_t gi = 0; gi < gc; ++gi)
    attend_row<KT>(q + gi * hs, K, V, ks, vs, rows, bv, n, hs, scale, scores, out + gi * hs);
}

// Query heads a work item takes: a (row, kv head) with its g query heads, which share each key and
// value; one (row, head) where that leaves a thread idle. A head's arithmetic is the same either way.
inline int64_t heads_an_item(int64_t rows, int64_t nkv, int64_t g) {
  return rows * nkv >= 2 * at::get_num_threads() ? g : 1;
}

// The slots a row (b, t) of a step of width T over S slots may see, in slot order, as the kernels
// take them: slot s's storage row (`row_of(s)`) and bias (bv, when the step has a bias). brow: the
// row's (S,) bias or null (every slot, or with `causal` those up to the row's own: a prompt block
// after S - T cached slots); a masked slot is exactly -inf and left out. Returns the count.
template <typename RowOf>
inline int64_t compact_slots(const float* brow, int64_t S, int64_t T, int64_t t, bool causal, RowOf row_of,
                             int64_t* rows, float* bv) {
  int64_t n = 0;
  const int64_t last = causal ? S - T + t : S - 1;
  for (int64_t s = 0; s <= last; ++s)
    if (!brow || brow[s] != -std::numeric_limits<float>::infinity()) {
      rows[n] = row_of(s);
      if (brow) bv[n] = brow[s];
      ++n;
    }
  return n;
}

// q: (B, T, nh, hs) bfloat16 (any strides, last dim contiguous); k, v: (B, nkv, S, hs) (bfloat16,
// float32 or float64; any strides, last dim contiguous); bias: (B, 1, T, S) float additive (0 / -inf)
// or None (every slot, or with `causal` the slots up to the row's own); a masked slot must be
// exactly -inf (it is left out of the row's sums, not weighted). Returns (B, T, nh, hs)
// bfloat16. Each (b, t, head) row attends to its allowed slots.
template <typename KT>
torch::Tensor attention_impl(torch::Tensor q, torch::Tensor k, torch::Tensor v, c10::optional<torch::Tensor> bias,
                             double scale, bool causal) {
  const int64_t B = q.size(0), T = q.size(1), nh = q.size(2), hs = q.size(3);
  const int64_t nkv = k.size(1), S = k.size(2), g = nh / nkv;
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "attention: the head dim must be contiguous");
  TORCH_CHECK(k.size(0) == B && v.size(0) == B && k.size(3) == hs && v.sizes() == k.sizes() && nh % nkv == 0,
              "attention: q (B, T, nh, hs) and k, v (B, nkv, S, hs) do not fit");
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 4 && bias->size(0) == B && bias->size(2) == T && bias->size(3) == S),
              "attention: bias must be (B, 1, T, S) (0 or -inf)");
  auto out = torch::empty({B, T, nh, hs}, q.options());
  torch::Tensor bf;
  if (bias.has_value()) bf = bias->to(torch::kFloat).contiguous();
  const float* bp = bias.has_value() ? bf.data_ptr<float>() : nullptr;
  const auto* qp = q.data_ptr<at::BFloat16>();
  const KT* kp = k.data_ptr<KT>();
  const KT* vp = v.data_ptr<KT>();
  auto* op = out.data_ptr<at::BFloat16>();
  const auto qs = q.strides(), kst = k.strides(), vst = v.strides();
  const int64_t gc = heads_an_item(B * T, nkv, g), chunks = nh / gc;
  at::parallel_for(0, B * T * chunks, 1, [&](int64_t lo, int64_t hi) {
    std::vector<int64_t> rows(S);
    std::vector<float> bv(S), scores(S * gc), qf(hs * gc), of(hs * gc);
    int64_t compacted = -1;  // the (b, t) whose allowed slots rows / bv hold
    int64_t n = 0;
    for (int64_t item = lo; item < hi; ++item) {
      const int64_t bt = item / chunks, h0 = (item % chunks) * gc, b = bt / T, t = bt % T;
      const float* brow = bp ? bp + (b * T + t) * S : nullptr;
      if (bt != compacted) {
        n = compact_slots(brow, S, T, t, causal, [](int64_t s) { return s; }, rows.data(), bv.data());
        compacted = bt;
      }
      for (int64_t gi = 0; gi < gc; ++gi) {
        const at::BFloat16* qr = qp + b * qs[0] + t * qs[1] + (h0 + gi) * qs[2];
        for (int64_t d = 0; d < hs; ++d) qf[gi * hs + d] = f32(qr[d]);
      }
      const int64_t kh = h0 / g;
      attend_group<KT>(gc, qf.data(), kp + b * kst[0] + kh * kst[1], vp + b * vst[0] + kh * vst[1], kst[2], vst[2],
                       rows.data(), brow ? bv.data() : nullptr, n, hs, static_cast<float>(scale), false, scores.data(),
                       of.data());
      at::BFloat16* o = op + ((b * T + t) * nh + h0) * hs;
      for (int64_t d = 0; d < hs * gc; ++d) o[d] = at::BFloat16(of[d]);
    }
  });
  return out;
}

torch::Tensor attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, c10::optional<torch::Tensor> bias,
                        double scale, bool causal) {
  TORCH_CHECK(q.scalar_type() == torch::kBFloat16, "attention: q must be bfloat16");
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "attention: k and v must share a dtype");
  switch (k.scalar_type()) {
    case torch::kBFloat16: return attention_impl<at::BFloat16>(q, k, v, bias, scale, causal);
    case torch::kFloat: return attention_impl<float>(q, k, v, bias, scale, causal);
    case torch::kDouble: return attention_impl<double>(q, k, v, bias, scale, causal);
    default: TORCH_CHECK(false, "attention: unsupported cache dtype ", k.scalar_type());
  }
}

// Attention reading the paged KV's pool in place (components/kv/paged.py). q: (R, nh, hs) bfloat16,
// the step's rows packed (last dim contiguous); k_pool, v_pool: (n_blocks, block_size, nkv, hs) one
// layer's keys and values (bfloat16, float32 or float64; each block's slots consecutive: stride(0) =
// block_size * stride(1)); table: (B, nb) int64 or int32, sequence b's slot s in block table[b, s /
// block_size] at offset s % block_size; row_index: (R,) row r's flat index b T + t in the step's
// padded (B, T) layout, or None (one sequence: row r is t = r, R = T); span: S, the slots the step's
// bias covers (nb block_size at most); bias / causal as `attention`'s, (B, 1, T, S). Returns (R, nh,
// hs) bfloat16: row r equals, bit for bit, row (b, t) of `attention` over the sequences' slots
// gathered into (B, nkv, S, hs). ref: the scalar reference of the vector kernels.
template <typename KT>
torch::Tensor paged_attention_impl(torch::Tensor q, torch::Tensor kpool, torch::Tensor vpool, torch::Tensor table,
                                   c10::optional<torch::Tensor> row_index, int64_t T, int64_t S,
                                   c10::optional<torch::Tensor> bias, double scale, bool causal, bool ref) {
  TORCH_CHECK(q.dim() == 3 && kpool.dim() == 4 && table.dim() == 2, "paged_attention: q (R, nh, hs), pools "
              "(n_blocks, block_size, nkv, hs) and table (B, nb) expected");
  const int64_t R = q.size(0), nh = q.size(1), hs = q.size(2);
  const int64_t NB = kpool.size(0), bs = kpool.size(1), nkv = kpool.size(2), g = nh / nkv;
  const int64_t B = table.size(0), nb = table.size(1);
  TORCH_CHECK(q.stride(2) == 1 && kpool.stride(3) == 1 && vpool.stride(3) == 1, "paged_attention: the head dim must be contiguous");
  TORCH_CHECK(kpool.size(3) == hs && vpool.sizes() == kpool.sizes() && nh % nkv == 0,
              "paged_attention: q (R, nh, hs) and the pools (n_blocks, block_size, nkv, hs) do not fit");
  TORCH_CHECK(kpool.stride(0) == bs * kpool.stride(1) && vpool.stride(0) == bs * vpool.stride(1),
              "paged_attention: a block's slots must be consecutive (stride(0) == block_size * stride(1))");
  TORCH_CHECK(S >= 1 && S <= nb * bs && T >= 1, "paged_attention: span must be within the table's blocks");
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 4 && bias->size(0) == B && bias->size(2) == T && bias->size(3) == S),
              "paged_attention: bias must be (B, 1, T, span) (0 or -inf)");
  TORCH_CHECK(!causal || T <= S, "paged_attention: a causal block longer than its span");
  auto tab_t = table.to(torch::kLong).contiguous();
  const int64_t* tab = tab_t.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * nb; ++i)
    TORCH_CHECK(tab[i] >= 0 && tab[i] < NB, "paged_attention: block ", tab[i], " outside the pool of ", NB);
  torch::Tensor ri_t;
  const int64_t* ri = nullptr;
  if (row_index.has_value()) {
    ri_t = row_index->to(torch::kLong).contiguous();
    TORCH_CHECK(ri_t.dim() == 1 && ri_t.size(0) == R, "paged_attention: row_index must be (R,)");
    ri = ri_t.data_ptr<int64_t>();
    for (int64_t r = 0; r < R; ++r)
      TORCH_CHECK(ri[r] >= 0 && ri[r] < B * T, "paged_attention: row_index ", ri[r], " outside (B, T)");
  } else {
    TORCH_CHECK(B == 1 && R == T, "paged_attention: without row_index, one sequence of T = R rows");
  }
  auto out = torch::empty({R, nh, hs}, q.options());
  torch::Tensor bf;
  if (bias.has_value()) bf = bias->to(torch::kFloat).contiguous();
  const float* bp = bias.has_value() ? bf.data_ptr<float>() : nullptr;
  const auto* qp = q.data_ptr<at::BFloat16>();
  const KT* kp = kpool.data_ptr<KT>();
  const KT* vp = vpool.data_ptr<KT>();
  auto* op = out.data_ptr<at::BFloat16>();
  const auto qs = q.strides(), kst = kpool.strides(), vst = vpool.strides();
  TORCH_CHECK(kst[1] == vst[1], "paged_attention: the key and value pools must share their layout");
  const int64_t gc = heads_an_item(R, nkv, g), chunks = nh / gc;
  at::parallel_for(0, R * chunks, 1, [&](int64_t lo, int64_t hi) {
    std::vector<int64_t> rows(S);  // a slot's row of the pool's (n_blocks block_size) slots
    std::vector<float> bv(S), scores(S * gc), qf(hs * gc), of(hs * gc);
    int64_t compacted = -1;  // the row whose allowed slots rows / bv hold
    int64_t n = 0;
    const float* brow = nullptr;
    for (int64_t item = lo; item < hi; ++item) {
      const int64_t r = item / chunks, h0 = (item % chunks) * gc;
      if (r != compacted) {
        const int64_t bt = ri ? ri[r] : r, b = bt / T, t = bt % T;
        const int64_t* tb = tab + b * nb;
        brow = bp ? bp + bt * S : nullptr;
        n = compact_slots(brow, S, T, t, causal, [tb, bs](int64_t s) { return tb[s / bs] * bs + s % bs; },
                          rows.data(), bv.data());
        compacted = r;
      }
      for (int64_t gi = 0; gi < gc; ++gi) {
        const at::BFloat16* qr = qp + r * qs[0] + (h0 + gi) * qs[1];
        for (int64_t d = 0; d < hs; ++d) qf[gi * hs + d] = f32(qr[d]);
      }
      const int64_t kh = h0 / g;
      attend_group<KT>(gc, qf.data(), kp + kh * kst[2], vp + kh * vst[2], kst[1], vst[1], rows.data(),
                       brow ? bv.data() : nullptr, n, hs, static_cast<float>(scale), ref, scores.data(), of.data());
      at::BFloat16* o = op + (r * nh + h0) * hs;
      for (int64_t d = 0; d < hs * gc; ++d) o[d] = at::BFloat16(of[d]);
    }
  });
  return out;
}

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor table,
                              c10::optional<torch::Tensor> row_index, int64_t width, int64_t span,
                              c10::optional<torch::Tensor> bias, double scale, bool causal, bool ref) {
  TORCH_CHECK(q.scalar_type() == torch::kBFloat16, "paged_attention: q must be bfloat16");
  TORCH_CHECK(k_pool.scalar_type() == v_pool.scalar_type(), "paged_attention: the pools must share a dtype");
  TORCH_CHECK(table.scalar_type() == torch::kLong || table.scalar_type() == torch::kInt,
              "paged_attention: the block table must be int64 or int32");
  switch (k_pool.scalar_type()) {
    case torch::kBFloat16:
      return paged_attention_impl<at::BFloat16>(q, k_pool, v_pool, table, row_index, width, span, bias, scale, causal, ref);
    case torch::kFloat:
      return paged_attention_impl<float>(q, k_pool, v_pool, table, row_index, width, span, bias, scale, causal, ref);
    case torch::kDouble:
      return paged_attention_impl<double>(q, k_pool, v_pool, table, row_index, width, span, bias, scale, causal, ref);
    default: TORCH_CHECK(false, "paged_attention: unsupported cache dtype ", k_pool.scalar_type());
  }
}
