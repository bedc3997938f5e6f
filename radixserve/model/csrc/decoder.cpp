// The whole Llama layer stack for a batch of decode tokens, in one native call.
//
// A decode step of a small model is mostly per-op overhead when driven op by op from Python
// (about 20 small ops per layer); here each layer is: RMSNorm -> QKV matmul (+bias) -> RoPE
// -> K/V written to the pool -> attention over each sequence's slots -> output matmul added
// to the residual -> RMSNorm -> gate/up matmul -> SiLU(gate) * up -> down matmul added to the
// residual; then the final norm and the LM head. Qwen3 and Gemma 3 add to it (each where its
// weights are given): q and k RMS-normed per head before RoPE; the embeddings scaled; the
// outputs of attention and of the MLP RMS-normed before the residual add; GELU-tanh for SiLU;
// layers attending over a window of the last W keys only (a decode token at context index
// i sees i - W < j <= i), with their own RoPE tables. The arithmetic matches llama.py's and
// gemma3.py's forward:
// float32 activations, rotate-half RoPE from float32 tables, softmax in float32; the matmuls'
// inputs are rounded to int8 per block, as llama.cpp does for every matmul, unless
// RADIXSERVE_INT8_LANES=0: in batches of 8 sequences or more (DecodeBatch::sequences, not
// rows; gemm_int8_lanes) for every block format, in smaller ones for GGUF's Q5_0 / Q5_1 /
// K-quants (gemm_int8_few; Q8_0 and Q4_1 keep int16 there). A sequence may bring several
// rows (a grammar draft being verified: a row per token, each with its own position, slot and
// context up to that slot): a layer writes every row's K/V to the pool before any row
// attends, so a row sees the rows before it. Weights are
// QWeights (block-quantized or dense float); the pool keeps its dtype (float32, bfloat16,
// float16), laid out [layers, kv_heads, slots, head_dim].
//
// Raw pointers only: bindings.cpp owns the tensors and checks every input first.
#include <algorithm>

#include "kernels.h"

namespace rs {
namespace {

template <typename T>
inline v8 load8_as_float(const T* p) {
  v8 out;
  for (int i = 0; i < 8; ++i) out[i] = to_float(p[i]);
  return out;
}
template <>
inline v8 load8_as_float<float>(const float* p) { return load8(p); }
template <>
inline v8 load8_as_float<c10::BFloat16>(const c10::BFloat16* p) {
  typedef uint16_t v8u16 __attribute__((vector_size(16)));
  typedef uint32_t v8u32 __attribute__((vector_size(32)));
  return widen_bf16<v8, v8u16, v8u32>(p);
}

// in place: softmax of n scores
void softmax(float* s, int64_t n) {
  float mx = -INFINITY;
  for (int64_t j = 0; j < n; ++j) mx = std::max(mx, s[j]);
  v8 total = {};
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const v8 e = exp8(load8(s + j) - splat8(mx));
    store8(s + j, e);
    total += e;
  }
  float sum = hsum8(total);
  for (; j < n; ++j) sum += (s[j] = std::exp(s[j] - mx));
  const float inv = 1.f / sum;
  for (j = 0; j < n; ++j) s[j] *= inv;
}


// A sequence's slots lie apart in the pool (a batch's sequences take one slot each per step),
// so every K or V row is its own trip to memory, which the hardware prefetchers do not
// foresee; asking for the row this many ahead keeps several trips in flight.
constexpr int64_t kPrefetchAhead = 12;

template <typename T>
inline void prefetch_row(const T* row, int64_t D) {
  const char* p = reinterpret_cast<const char*>(row);
  const int64_t bytes = D * static_cast<int64_t>(sizeof(T));
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off);
}

// One (sequence, KV head) of decode attention with C = head_dim / 8 known at compile time,
// so a K row and each query head's output stay in registers: scores of the G query heads
// against each K row, softmax, then each head's weighted sum of V rows.
template <int C, typename T>
void attend(const float* q, const T* kbase, const T* vbase, const int64_t* slots, int64_t n,
            int64_t G, float scale, float* scores, float* out) {
  constexpr int64_t D = 8 * C;
  for (int64_t j = 0; j < n; ++j) {
    if (j + kPrefetchAhead < n) {
      prefetch_row(kbase + slots[j + kPrefetchAhead] * D, D);
      prefetch_row(vbase + slots[j + kPrefetchAhead] * D, D);  // for the second pass
    }
    const T* k = kbase + slots[j] * D;
    v8 kv[C];
    for (int c = 0; c < C; ++c) kv[c] = load8_as_float(k + 8 * c);
    for (int64_t g = 0; g < G; ++g) {
      v8 acc = load8(q + g * D) * kv[0];
      for (int c = 1; c < C; ++c) acc += load8(q + g * D + 8 * c) * kv[c];
      scores[g * n + j] = hsum8(acc) * scale;
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* p = scores + g * n;
    softmax(p, n);
    v8 acc[C] = {};
    for (int64_t j = 0; j < n; ++j) {
      const T* v = vbase + slots[j] * D;
      const v8 pj = splat8(p[j]);
      for (int c = 0; c < C; ++c) acc[c] += pj * load8_as_float(v + 8 * c);
    }
    for (int c = 0; c < C; ++c) store8(out + g * D + 8 * c, acc[c]);
  }
}

// The same for any head_dim (a multiple of 8), with the outputs accumulated in memory.
template <typename T>
void attend_any(const float* q, const T* kbase, const T* vbase, const int64_t* slots, int64_t n,
                int64_t G, int64_t D, float scale, float* scores, float* out) {
  for (int64_t j = 0; j < n; ++j) {
    const T* k = kbase + slots[j] * D;
    for (int64_t g = 0; g < G; ++g) {
      v8 acc = {};
      for (int64_t i = 0; i < D; i += 8) acc += load8(q + g * D + i) * load8_as_float(k + i);
      scores[g * n + j] = hsum8(acc) * scale;
    }
  }
  std::fill(out, out + G * D, 0.f);
  for (int64_t g = 0; g < G; ++g) {
    float* p = scores + g * n;
    softmax(p, n);
    for (int64_t j = 0; j < n; ++j) {
      const T* v = vbase + slots[j] * D;
      for (int64_t i = 0; i < D; i += 8)
        store8(out + g * D + i, load8(out + g * D + i) + splat8(p[j]) * load8_as_float(v + i));
    }
  }
}

// Where layer l's KV lives: its pool, the layer's index in it, and the slots to use there.
struct LayerPool {
  void* k;
  void* v;
  int64_t slots, index;
  const int64_t* ctx;
  const int64_t* out_slots;
};

LayerPool layer_pool(const DecoderWeights& w, const DecodeBatch& batch, int64_t l) {
  const bool apart = batch.w_k_pool != nullptr;
  const bool in_window = apart && w.windows[l] > 0;
  int64_t index = 0;  // layers before l in the same pool
  for (int64_t j = 0; j < l; ++j) index += !apart || ((w.windows[j] > 0) == in_window);
  if (in_window) return {batch.w_k_pool, batch.w_v_pool, batch.w_slots, index, batch.w_ctx, batch.w_out_slots};
  return {batch.k_pool, batch.v_pool, batch.slots, index, batch.ctx, batch.out_slots};
}

// attn[b, head] = softmax(q . K / sqrt(dim)) V over the slots ctx[b, :lens[b]]; one task
// per (sequence, KV head), sharing each K/V row read among that head's query heads.
template <typename T>
void attention(const DecoderWeights& w, int64_t l, const DecodeBatch& batch, const float* qkv,
               float* attn) {
  const LayerPool lp = layer_pool(w, batch, l);
  const int64_t G = w.heads / w.kv_heads, D = w.dim, B = batch.size, S = lp.slots;
  const int64_t qkv_n = (w.heads + 2 * w.kv_heads) * D;
  const float scale = w.scale;
  const int64_t window = w.windows[l];
  const T* kp = static_cast<const T*>(lp.k);
  const T* vp = static_cast<const T*>(lp.v);
  at::parallel_for(0, B * w.kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;  // a plain local: no TLS lookup in the loops below
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / w.kv_heads, h = task % w.kv_heads;
      // a windowed layer reads the last `window` slots of the context only
      const int64_t start = window > 0 ? std::max<int64_t>(0, batch.lens[b] - window) : 0;
      const int64_t n = batch.lens[b] - start;
      scores.resize(G * n);
      const float* q = qkv + b * qkv_n + h * G * D;
      const T* kbase = kp + (lp.index * w.kv_heads + h) * S * D;
      const T* vbase = vp + (lp.index * w.kv_heads + h) * S * D;
      const int64_t* sl = lp.ctx + b * batch.ctx_stride + start;
      float* o = attn + b * w.heads * D + h * G * D;
      switch (D) {  // head_dim is a multiple of 16 up to 256 (checked by the bindings)
        case 64: attend<8>(q, kbase, vbase, sl, n, G, scale, scores.data(), o); break;
        case 128: attend<16>(q, kbase, vbase, sl, n, G, scale, scores.data(), o); break;
        case 32: attend<4>(q, kbase, vbase, sl, n, G, scale, scores.data(), o); break;
        case 16: attend<2>(q, kbase, vbase, sl, n, G, scale, scores.data(), o); break;
        default: attend_any(q, kbase, vbase, sl, n, G, D, scale, scores.data(), o);
      }
    }
  });
}

// q, k of one row after the QKV matmul: bias, per-head norms, RoPE; then K and V to the pool
template <typename T>
void qkv_row(const DecoderWeights& w, int64_t l, const DecodeBatch& batch, int64_t b, float* row,
             const LayerPool& lp) {
  T* kp = static_cast<T*>(lp.k);
  T* vp = static_cast<T*>(lp.v);
  const int64_t D = w.dim, q_size = w.heads * D, kv_size = w.kv_heads * D;
  if (const float* bias = w.qkv_bias[l])
    for (int64_t i = 0; i < q_size + 2 * kv_size; ++i) row[i] += bias[i];
  if (!w.qk_norms.empty()) {  // in place: each head's sum of squares is taken first
    rms_norm_rows(row, w.qk_norms[2 * l], w.heads, D, w.eps, row);
    rms_norm_rows(row + q_size, w.qk_norms[2 * l + 1], w.kv_heads, D, w.eps, row + q_size);
  }
  const bool local = w.windows[l] > 0 && w.local_cos != nullptr;
  const float* cos = (local ? w.local_cos : w.cos) + batch.positions[b] * D;
  const float* sin = (local ? w.local_sin : w.sin) + batch.positions[b] * D;
  rope_row(row, w.heads + w.kv_heads, D, cos, sin);  // q, then k
  for (int64_t h = 0; h < w.kv_heads; ++h) {
    const int64_t off = ((lp.index * w.kv_heads + h) * lp.slots + lp.out_slots[b]) * D;
    for (int64_t i = 0; i < D; ++i) {
      kp[off + i] = from_float<T>(row[q_size + h * D + i]);
      vp[off + i] = from_float<T>(row[q_size + kv_size + h * D + i]);
    }
  }
}

// How a step's matmuls run: int8 activations or not, and whether each row is computed on its
// own. qgemm picks its kernel by row count; a batch of fewer than 8 sequences with more rows
// (a draft's) takes the kernels of a batch of those sequences, one row each, whose rows are
// computed independently (rows_alone), in one call: each row gets the numbers it gets alone,
// and each weight is read once for all of them.
struct Gemm {
  bool int8, alone;
  void operator()(const float* x, int64_t B, const WeightView& w, float* y, bool accumulate) const {
    qgemm(x, B, w, y, accumulate, int8, alone);
  }
};

// h += x @ W^T, or (Gemma) h += RMSNorm(x @ W^T) * norm, through the scratch row buffer y
void add_output(const float* x, int64_t B, const WeightView& wv, const float* norm, float eps,
                float* h, float* y, int64_t H, const Gemm& gemm) {
  if (norm == nullptr) {
    gemm(x, B, wv, h, true);
    return;
  }
  gemm(x, B, wv, y, false);
  add_rms_norm_rows(y, norm, B, H, eps, h);
}

template <typename T>
void layers(const DecoderWeights& w, const DecodeBatch& batch, DecoderScratch& s, const Gemm& gemm) {
  const int64_t B = batch.size, D = w.dim, H = w.hidden, I = w.inter;
  const int64_t qkv_n = (w.heads + 2 * w.kv_heads) * D;
  const bool sandwich = !w.out_norms.empty();
  for (int64_t l = 0; l < w.layers; ++l) {
    rms_norm_rows(s.h.data(), w.norms[2 * l], B, H, w.eps, s.x.data());
    gemm(s.x.data(), B, w.qkv[l], s.qkv.data(), false);
    const LayerPool lp = layer_pool(w, batch, l);
    at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) qkv_row<T>(w, l, batch, b, s.qkv.data() + b * qkv_n, lp);
    });
    attention<T>(w, l, batch, s.qkv.data(), s.attn.data());
    add_output(s.attn.data(), B, w.o[l], sandwich ? w.out_norms[2 * l] : nullptr, w.eps,
               s.h.data(), s.x.data(), H, gemm);
    rms_norm_rows(s.h.data(), w.norms[2 * l + 1], B, H, w.eps, s.x.data());
    gemm(s.x.data(), B, w.gate_up[l], s.gu.data(), false);
    at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
      const float* gu = s.gu.data() + b0 * 2 * I;
      float* act = s.act.data() + b0 * I;
      if (w.gelu)
        gelu_tanh_mul_rows(gu, b1 - b0, I, act);
      else
        silu_mul_rows(gu, b1 - b0, I, act);
    });
    add_output(s.act.data(), B, w.down[l], sandwich ? w.out_norms[2 * l + 1] : nullptr, w.eps,
               s.h.data(), s.x.data(), H, gemm);
  }
}

}  // namespace

void decode_step(const DecoderWeights& w, const DecodeBatch& batch, DecoderScratch& s,
                 float* logits) {
  const int64_t B = batch.size, H = w.hidden;
  s.h.resize(B * H);
  s.x.resize(B * H);
  s.qkv.resize(B * (w.heads + 2 * w.kv_heads) * w.dim);
  s.attn.resize(B * w.heads * w.dim);
  s.gu.resize(B * 2 * w.inter);
  s.act.resize(B * w.inter);
  for (int64_t b = 0; b < B; ++b) dequant_rows(w.embed, batch.ids[b], 1, s.h.data() + b * H);
  if (w.embed_scale != 1.f)
    for (float& v : s.h) v *= w.embed_scale;
  const bool many = batch.sequences >= 8;
  const Gemm gemm{use_int8_lanes(-1), !many};
  switch (batch.kv_type) {
    case KVType::F32: layers<float>(w, batch, s, gemm); break;
    case KVType::BF16: layers<c10::BFloat16>(w, batch, s, gemm); break;
    case KVType::F16: layers<c10::Half>(w, batch, s, gemm); break;
  }
  rms_norm_rows(s.h.data(), w.norms.back(), B, H, w.eps, s.x.data());
  gemm(s.x.data(), B, w.lm_head, logits, false);
}

}  // namespace rs
