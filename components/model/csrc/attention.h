// Attention over the cache for the fused kernels: included by decode_ops.cpp inside its anonymous
// namespace, after its includes and common helpers (f32, LANES, exp_neg).
template <typename KT>
void attend_row(const float* q, const KT* K, const KT* V, int64_t ks, int64_t vs, const float* bias,
                const int64_t* idx, int64_t n, int64_t hs, float scale, float* scores, float* out) {
  // scores over the compacted slots, each dot product in LANES partial sums over the head dim
  for (int64_t j = 0; j < n; ++j) {
    const KT* k = K + idx[j] * ks;
    float acc[LANES] = {0};
    int64_t d = 0;
    for (; d + LANES <= hs; d += LANES)
      for (int l = 0; l < LANES; ++l) acc[l] += q[d + l] * f32(k[d + l]);
    for (int l = 0; d < hs; ++d, ++l) acc[l] += q[d] * f32(k[d]);
    for (int w2 = LANES / 2; w2 > 0; w2 /= 2)
      for (int l = 0; l < w2; ++l) acc[l] += acc[l + w2];
    scores[j] = acc[0] * scale + (bias ? bias[idx[j]] : 0.0f);
  }
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) mx = scores[j] > mx ? scores[j] : mx;
  for (int64_t j = 0; j < n; ++j) scores[j] = exp_neg(scores[j] - mx);
  float sum = 0.0f;
  for (int64_t j = 0; j < n; ++j) sum += scores[j];
  for (int64_t d = 0; d < hs; ++d) out[d] = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    const KT* v = V + idx[j] * vs;
    const float p = scores[j];
    for (int64_t d = 0; d < hs; ++d) out[d] += p * f32(v[d]);
  }
  const float inv = 1.0f / sum;
  for (int64_t d = 0; d < hs; ++d) out[d] *= inv;
}

#if defined(__AVX512F__)
inline __m512 bf16x16(const at::BFloat16* p) {  // 16 bfloat16 -> float32, exactly
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// attend_row for G query heads sharing one bfloat16 kv head of 16 HV dims, with each key and value
// converted once for the G heads and the outputs kept in registers. Per head the same arithmetic as
// attend_row: a score is the 16 lanes' FMA chain over the head dim, summed by halves; then the
// row's exp, sum and value sums in slot order. q: G x hs float32; scores: G x n; out: G x hs.
template <int HV, int G>
void attend_heads_bf16(const float* q, const at::BFloat16* K, const at::BFloat16* V, int64_t ks, int64_t vs,
                       const float* bias, const int64_t* idx, int64_t n, float scale, float* scores, float* out) {
  constexpr int64_t hs = 16 * HV;
  __m512 qv[G][HV];
  for (int gi = 0; gi < G; ++gi)
    for (int c = 0; c < HV; ++c) qv[gi][c] = _mm512_loadu_ps(q + gi * hs + 16 * c);
  for (int64_t j = 0; j < n; ++j) {
    const at::BFloat16* k = K + idx[j] * ks;
    __m512 kv[HV];
    for (int c = 0; c < HV; ++c) kv[c] = bf16x16(k + 16 * c);
    const float b = bias ? bias[idx[j]] : 0.0f;
    for (int gi = 0; gi < G; ++gi) {
      __m512 acc = _mm512_mul_ps(qv[gi][0], kv[0]);
      for (int c = 1; c < HV; ++c) acc = _mm512_fmadd_ps(qv[gi][c], kv[c], acc);
      scores[gi * n + j] = _mm512_reduce_add_ps(acc) * scale + b;
    }
  }
  float inv[G];
  for (int gi = 0; gi < G; ++gi) {
    float* sc = scores + gi * n;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n; ++j) mx = sc[j] > mx ? sc[j] : mx;
    for (int64_t j = 0; j < n; ++j) sc[j] = exp_neg(sc[j] - mx);
    float sum = 0.0f;
    for (int64_t j = 0; j < n; ++j) sum += sc[j];
    inv[gi] = 1.0f / sum;
  }
  __m512 o[G][HV];
  for (int gi = 0; gi < G; ++gi)
    for (int c = 0; c < HV; ++c) o[gi][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const at::BFloat16* v = V + idx[j] * vs;
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

template <int HV>
void attend_heads_bf16(int G, const float* q, const at::BFloat16* K, const at::BFloat16* V, int64_t ks, int64_t vs,
                       const float* bias, const int64_t* idx, int64_t n, float scale, float* scores, float* out) {
  for (int g0 = 0; g0 < G; g0 += 4) {  // at most 4 heads a pass: their accumulators stay in registers
    const int m = G - g0 < 4 ? G - g0 : 4;
    const float* qg = q + g0 * 16 * HV;
    float* og = out + g0 * 16 * HV;
    float* sg = scores + g0 * n;
    switch (m) {
      case 1: attend_heads_bf16<HV, 1>(qg, K, V, ks, vs, bias, idx, n, scale, sg, og); break;
      case 2: attend_heads_bf16<HV, 2>(qg, K, V, ks, vs, bias, idx, n, scale, sg, og); break;
      case 3: attend_heads_bf16<HV, 3>(qg, K, V, ks, vs, bias, idx, n, scale, sg, og); break;
      default: attend_heads_bf16<HV, 4>(qg, K, V, ks, vs, bias, idx, n, scale, sg, og); break;
    }
  }
}
#endif

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
  // Items: a (row, kv head) with its g query heads, which share each key and value; one (row, head)
  // where that leaves a thread idle. A head's arithmetic is the same either way.
  const int64_t gc = B * T * nkv >= 2 * at::get_num_threads() ? g : 1, chunks = nh / gc;
  int hv = 0;  // the vectorized kernel's 16-dim blocks per head, where it applies
#if defined(__AVX512F__)
  if (std::is_same<KT, at::BFloat16>::value && (hs == 64 || hs == 128)) hv = hs / 16;
#endif
  at::parallel_for(0, B * T * chunks, 1, [&](int64_t lo, int64_t hi) {
    std::vector<int64_t> idx(S);
    std::vector<float> scores(S * gc), qf(hs * gc), of(hs * gc);
    int64_t compacted = -1;  // the (b, t) whose allowed slots idx holds
    int64_t n = 0;
    for (int64_t item = lo; item < hi; ++item) {
      const int64_t bt = item / chunks, h0 = (item % chunks) * gc, b = bt / T, t = bt % T;
      const float* brow = bp ? bp + (b * T + t) * S : nullptr;
      if (bt != compacted) {
        n = 0;
        const int64_t last = causal ? S - T + t : S - 1;  // causal: a prompt block after S - T cached slots
        for (int64_t s = 0; s <= last; ++s)
          if (!brow || brow[s] != -std::numeric_limits<float>::infinity()) idx[n++] = s;
        compacted = bt;
      }
      for (int64_t gi = 0; gi < gc; ++gi) {
        const at::BFloat16* qr = qp + b * qs[0] + t * qs[1] + (h0 + gi) * qs[2];
        for (int64_t d = 0; d < hs; ++d) qf[gi * hs + d] = f32(qr[d]);
      }
      const int64_t kh = h0 / g;
      const KT* kb = kp + b * kst[0] + kh * kst[1];
      const KT* vb = vp + b * vst[0] + kh * vst[1];
#if defined(__AVX512F__)
      if (hv == 4)
        attend_heads_bf16<4>(gc, qf.data(), reinterpret_cast<const at::BFloat16*>(kb), reinterpret_cast<const at::BFloat16*>(vb),
                             kst[2], vst[2], brow, idx.data(), n, static_cast<float>(scale), scores.data(), of.data());
      else if (hv == 8)
        attend_heads_bf16<8>(gc, qf.data(), reinterpret_cast<const at::BFloat16*>(kb), reinterpret_cast<const at::BFloat16*>(vb),
                             kst[2], vst[2], brow, idx.data(), n, static_cast<float>(scale), scores.data(), of.data());
      else
#endif
        for (int64_t gi = 0; gi < gc; ++gi)
          attend_row<KT>(qf.data() + gi * hs, kb, vb, kst[2], vst[2], brow, idx.data(), n, hs,
                         static_cast<float>(scale), scores.data(), of.data() + gi * hs);
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
