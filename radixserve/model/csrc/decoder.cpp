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
// QWeights (block-quantized or dense float); the pool keeps its format (float32, bfloat16,
// float16 values, or int8 codes with their scales: KVType), laid out
// [layers, kv_heads, slots, row]; an int8 pool may keep some layers in a float pool apart.
//
// Raw pointers only: bindings.cpp owns the tensors and checks every input first.
#include <algorithm>

#include "kernels.h"

namespace rs {
namespace {

// Where layer l's KV lives: its pool, the layer's index in it, the slots to use there, and
// the rows' format.
struct LayerPool {
  void* k;
  void* v;
  int64_t slots, index;
  const int64_t* ctx;
  const int64_t* out_slots;
  KVType type;
  int64_t group, row_bytes;
};

LayerPool layer_pool(const DecoderWeights& w, const DecodeBatch& batch, int64_t l) {
  const bool apart = batch.w_k_pool != nullptr;
  const bool in_window = apart && w.windows[l] > 0;
  const bool floats = !batch.is_float.empty();
  const bool in_float = floats && batch.is_float[l];
  int64_t index = 0;  // layers before l in the same pool
  for (int64_t j = 0; j < l; ++j) {
    if (floats)
      index += bool(batch.is_float[j]) == in_float;
    else
      index += !apart || ((w.windows[j] > 0) == in_window);
  }
  if (in_float)
    return {batch.f_k_pool, batch.f_v_pool, batch.slots, index, batch.ctx, batch.out_slots, batch.f_type, 0,
            batch.f_row_bytes};
  if (in_window)
    return {batch.w_k_pool, batch.w_v_pool, batch.w_slots, index, batch.w_ctx, batch.w_out_slots,
            batch.kv_type, batch.kv_group, batch.row_bytes};
  return {batch.k_pool, batch.v_pool, batch.slots, index, batch.ctx, batch.out_slots,
          batch.kv_type, batch.kv_group, batch.row_bytes};
}

// attn[b, head] = softmax(q . K / sqrt(dim)) V over the slots ctx[b, :lens[b]] (a windowed
// layer: the last `window` of them), each row its own context (flash_attention.cpp)
void attention(const DecoderWeights& w, int64_t l, const DecodeBatch& batch, const float* qkv,
               float* attn, DecoderScratch& s) {
  const LayerPool lp = layer_pool(w, batch, l);
  const int64_t B = batch.size, window = w.windows[l];
  s.ctx_start.resize(B);
  s.seq_start.resize(B + 1);
  s.lo.resize(B);
  for (int64_t b = 0; b < B; ++b) {
    s.ctx_start[b] = b * batch.ctx_stride;
    s.seq_start[b] = b;
    s.lo[b] = window > 0 ? std::max<int64_t>(0, batch.lens[b] - window) : 0;
  }
  s.seq_start[B] = B;
  AttnRows a;
  a.q = qkv;
  a.q_stride = (w.heads + 2 * w.kv_heads) * w.dim;
  a.out = attn;
  a.out_stride = w.heads * w.dim;
  a.rows = B;
  a.heads = w.heads;
  a.kv_heads = w.kv_heads;
  a.dim = w.dim;
  a.ctx = lp.ctx;
  a.ctx_start = s.ctx_start.data();
  a.seq_start = s.seq_start.data();
  a.seqs = B;
  a.lo = s.lo.data();
  a.hi = batch.lens;
  a.scale = w.scale;
  const int64_t layer_bytes = w.kv_heads * lp.slots * lp.row_bytes;
  KVLayer kv;
  kv.k = static_cast<const uint8_t*>(lp.k) + lp.index * layer_bytes;
  kv.v = static_cast<const uint8_t*>(lp.v) + lp.index * layer_bytes;
  kv.type = lp.type;
  kv.group = lp.group;
  kv.row_bytes = lp.row_bytes;
  kv.slots = lp.slots;
  flash_attention(a, kv);
}

template <typename T>
void store_values(const float* x, int64_t D, uint8_t* out) {
  for (int64_t i = 0; i < D; ++i) reinterpret_cast<T*>(out)[i] = from_float<T>(x[i]);
}

// one K or V row of D values into the pool in the layer's format
void store_row(const float* x, int64_t D, const LayerPool& lp, uint8_t* out) {
  switch (lp.type) {
    case KVType::I8: encode_kv_row_i8(x, D, lp.group, out); break;
    case KVType::F32: store_values<float>(x, D, out); break;
    case KVType::BF16: store_values<c10::BFloat16>(x, D, out); break;
    case KVType::F16: store_values<c10::Half>(x, D, out); break;
  }
}

// Each of n heads of x [n, D] in place in its stored order: x'[c] = x[order[c]] / scale[c] (keys)
// or * scale[c] (queries); order, scale [heads / rep, D] (rep heads share them: the query heads
// of a KV head). The scales are powers of two: exact.
void reorder_heads(float* x, int64_t n, int64_t rep, int64_t D, const int64_t* order,
                   const float* scale, bool keys) {
  float tmp[256];  // head_dim <= 256 (native_decode.supported)
  for (int64_t h = 0; h < n; ++h) {
    float* head = x + h * D;
    const int64_t* o = order + (h / rep) * D;
    const float* s = scale + (h / rep) * D;
    std::copy(head, head + D, tmp);
    for (int64_t c = 0; c < D; ++c) head[c] = keys ? tmp[o[c]] / s[c] : tmp[o[c]] * s[c];
  }
}

// q, k of one row after the QKV matmul: bias, per-head norms, RoPE; then K and V to the pool
// (an int8 key order: q and k in the stored order first)
void qkv_row(const DecoderWeights& w, int64_t l, const DecodeBatch& batch, int64_t b, float* row,
             const LayerPool& lp) {
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
  if (lp.type == KVType::I8 && batch.key_order != nullptr) {
    const int64_t* order = batch.key_order + l * w.kv_heads * D;
    const float* scale = batch.key_scale + l * w.kv_heads * D;
    reorder_heads(row, w.heads, w.heads / w.kv_heads, D, order, scale, false);
    reorder_heads(row + q_size, w.kv_heads, 1, D, order, scale, true);
  }
  for (int64_t h = 0; h < w.kv_heads; ++h) {
    const int64_t off = ((lp.index * w.kv_heads + h) * lp.slots + lp.out_slots[b]) * lp.row_bytes;
    store_row(row + q_size + h * D, D, lp, static_cast<uint8_t*>(lp.k) + off);
    store_row(row + q_size + kv_size + h * D, D, lp, static_cast<uint8_t*>(lp.v) + off);
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

void layers(const DecoderWeights& w, const DecodeBatch& batch, DecoderScratch& s, const Gemm& gemm) {
  const int64_t B = batch.size, D = w.dim, H = w.hidden, I = w.inter;
  const int64_t qkv_n = (w.heads + 2 * w.kv_heads) * D;
  const bool sandwich = !w.out_norms.empty();
  for (int64_t l = 0; l < w.layers; ++l) {
    rms_norm_rows(s.h.data(), w.norms[2 * l], B, H, w.eps, s.x.data());
    gemm(s.x.data(), B, w.qkv[l], s.qkv.data(), false);
    const LayerPool lp = layer_pool(w, batch, l);
    at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) qkv_row(w, l, batch, b, s.qkv.data() + b * qkv_n, lp);
    });
    attention(w, l, batch, s.qkv.data(), s.attn.data(), s);
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
  layers(w, batch, s, gemm);
  rms_norm_rows(s.h.data(), w.norms.back(), B, H, w.eps, s.x.data());
  gemm(s.x.data(), B, w.lm_head, logits, false);
}

}  // namespace rs
