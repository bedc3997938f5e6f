// Shared pieces of radixserve's native CPU kernels: weight formats, small vector helpers.
//
// Everything is compiled with -march=native. Code that uses x86 intrinsics sits behind
// RS_AVX2 (AVX2 + FMA + F16C) and has a plain C++ twin for any other CPU; vector-extension
// types (GCC/Clang) compile to whatever registers the CPU has.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define RS_AVX2 1
#endif

namespace rs {

// Block-quantized weights. Two formats hold codes and float scales apart, one block of 32
// consecutive inputs per scale:
//   Q8_0: w = d * q, q int8                 (qs: int8 [N, K], d: [N, K/32])
//   Q4_1: w = d * q + m, q in 0..15         (qs: uint8 [N, K/2], d, m: [N, K/32]); in each
//         block's 16 bytes, byte j holds input j (low nibble) and input j + 16 (high nibble),
//         GGUF's own layout
// The others are GGUF block formats kept as the file's bytes (qs: uint8 [N, row_bytes], each
// row its blocks back to back; d, m unused; block_formats.cpp has their layouts):
//   Q5_0, Q5_1 (32 inputs a block), Q2_K, Q3_K, Q4_K, Q5_K, Q6_K (256 a block)
//   F32:  dense float [N, K]
//   Stack: the rows of `parts` one after another (a fused QKV or gate/up matrix whose pieces
//          come in different formats, or in GGUF bytes that are not copied to be joined)
enum class WFormat : int {
  F32 = 0, Q8_0 = 1, Q4_1 = 2, Q5_0 = 3, Q5_1 = 4, Q2_K = 5, Q3_K = 6, Q4_K = 7, Q5_K = 8,
  Q6_K = 9, Stack = 10
};
constexpr int64_t kBlock = 32;

struct WeightView {
  WFormat fmt = WFormat::F32;
  int64_t n = 0, k = 0;
  const void* qs = nullptr;
  const float* d = nullptr;
  const float* m = nullptr;
  int64_t row_bytes = 0;                // GGUF block formats: bytes of one row
  const WeightView* parts = nullptr;    // Stack: the pieces, top to bottom
  int64_t num_parts = 0;
};

// Calls fn(piece, row in piece, row in w) for rows [begin, end) of w (a Stack's pieces).
template <typename Fn>
inline void for_rows(const WeightView& w, int64_t begin, int64_t end, Fn&& fn) {
  if (w.fmt != WFormat::Stack) {
    for (int64_t n = begin; n < end; ++n) fn(w, n, n);
    return;
  }
  int64_t off = 0;
  for (int64_t p = 0; p < w.num_parts; off += w.parts[p].n, ++p) {
    const int64_t lo = std::max(begin, off), hi = std::min(end, off + w.parts[p].n);
    for (int64_t n = lo; n < hi; ++n) fn(w.parts[p], n - off, n);
  }
}

// Whether ok(format) holds for W's format, or for every piece's of a Stack.
template <typename Fn>
inline bool every_piece(const WeightView& w, Fn&& ok) {
  if (w.fmt != WFormat::Stack) return ok(w.fmt);
  for (int64_t p = 0; p < w.num_parts; ++p)
    if (!every_piece(w.parts[p], ok)) return false;
  return true;
}

// The IEEE half at p (unaligned), as a float.
inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// Q4_K / Q5_K: scale and min of sub-block j from the block's 12 packed scale bytes.
inline void scale_min_k4(const uint8_t* s, int j, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// GGUF block formats (block_formats.cpp): inputs and bytes of one block, 0 for others.
int64_t block_inputs(WFormat f);
int64_t block_bytes(WFormat f);
// One row of a GGUF-block-format W as floats (vector code where the CPU has it, unless
// reference: the plain C++ twin, kept for the tests).
void dequant_gguf_row(const WeightView& w, int64_t row, float* out, bool reference = false);
// The largest row count of x the integer dot products serve for W (0: none; quant_gemm.cpp).
int64_t integer_rows(const WeightView& w);

// x's rows rounded per block of 32 for the integer dot products: q = round(x / d) with
// d = max|x| / 32767 (int16), and the exact float sum of each block.
struct XBlocks {
  const int16_t* q;
  const float* d;
  const float* sum;
};
// y[i * ldy] (+)= x row i . W row `row`, for the M rows of x, W in a GGUF block format with
// integer dot products (integer_rows > 0); AVX2 builds only.
void gguf_row_dot(const XBlocks& x, int64_t M, const WeightView& w, int64_t row, float* y,
                  int64_t ldy, bool accumulate);

// y[M, N] = x[M, K] @ W^T, or y += that when accumulate; x, y row-major and contiguous.
// int8_rows: x may be rounded to int8 per block: 8 rows or more through gemm_int8_lanes
// instead of the float path, fewer through gemm_int8_few instead of the int16 dot products
// (GGUF block formats only); the decoder and the prompt path ask for it while
// use_int8_lanes says so. rows_alone: every row of x gets the numbers it gets alone, whatever
// M (the few-row kernels, which compute each row on its own, for any M).
void qgemm(const float* x, int64_t M, const WeightView& w, float* y, bool accumulate,
           bool int8_rows = false, bool rows_alone = false);
// The same for M >= 8 with float FMAs over lanes of x's rows (lane_gemm.cpp; qgemm picks it).
void gemm_lanes(const float* x, int64_t M, const WeightView& w, float* y, bool accumulate);
// The same for M >= 8 with x rounded to int8 per block and W's codes as bytes (int8_lanes.cpp),
// for W whose every piece int8_lanes_ok accepts. use_int8_lanes: whether the decoder asks for
// it (on unless RADIXSERVE_INT8_LANES=0; set >= 0 turns it off or on, -1 only asks).
bool use_int8_lanes(int set);
bool int8_lanes_ok(const WeightView& w);
void gemm_int8_lanes(const float* x, int64_t M, const WeightView& w, float* y, bool accumulate);
// The same for few rows (int8_few_rows.cpp: 1..7, or any number with rows_alone; each row
// on its own), for W whose every piece int8_few_ok accepts (GGUF's Q5_0, Q5_1, Q4_K, Q5_K,
// Q6_K on AVX2 builds); qgemm takes it when int8_rows.
bool int8_few_ok(const WeightView& w);
void gemm_int8_few(const float* x, int64_t M, const WeightView& w, float* y, bool accumulate);
// Rows [row0, row0 + rows) of W as floats, row-major into out.
void dequant_rows(const WeightView& w, int64_t row0, int64_t rows, float* out);
// The same rows as floats without a copy where W already is float32 (a pointer into W);
// otherwise dequantized into buf (rows * K floats), which is returned.
const float* weight_rows(const WeightView& w, int64_t row0, int64_t rows, float* buf);

// How a KV pool stores a row (one token's K or V of one head): cache/kv_format.py's
// KVFormat.kernel_code. F32 / BF16 / F16: head_dim values; I8: head_dim int8 codes, then one
// float16 scale per `group` channels (value = code * scale).
enum class KVType : int { F32 = 0, BF16 = 1, F16 = 2, I8 = 3 };

// One layer's K and V in a pool: [kv_heads, slots, row_bytes] each.
struct KVLayer {
  const uint8_t* k = nullptr;
  const uint8_t* v = nullptr;
  KVType type = KVType::F32;
  int64_t group = 0;  // I8: channels per scale (a multiple of 16)
  int64_t row_bytes = 0;
  int64_t slots = 0;  // rows per head
};

// Query rows over ranges of their contexts (flash_attention.cpp):
//   out[r, h, :] = softmax_j(scale * q[r, h, :] . K[c(j)]) V[c(j)] for j in [lo[r], hi[r]),
// c(j) = ctx[ctx_start[s] + j], s the context of row r: rows [seq_start[s], seq_start[s+1]).
// q, out: float32, row r's heads at q + r * q_stride (out + r * out_stride), head_dim apart.
// A row with an empty range gets zeros.
struct AttnRows {
  const float* q = nullptr;
  int64_t q_stride = 0;
  float* out = nullptr;
  int64_t out_stride = 0;
  int64_t rows = 0, heads = 0, kv_heads = 0, dim = 0;  // dim: a multiple of 16
  const int64_t* ctx = nullptr;
  const int64_t* ctx_start = nullptr;  // [seqs]
  const int64_t* seq_start = nullptr;  // [seqs + 1]
  int64_t seqs = 0;
  const int64_t* lo = nullptr;  // [rows]
  const int64_t* hi = nullptr;
  float scale = 1.f;
};
void flash_attention(const AttnRows& a, const KVLayer& kv);
// The I8 row of x [dim], as cache/kv_format.py encodes it (bit for bit).
void encode_kv_row_i8(const float* x, int64_t dim, int64_t group, uint8_t* row);
constexpr int64_t kAttnMaxDim = 256;

// Row-wise layer pieces (rowwise.cpp), float32, rows contiguous: RMSNorm of `rows` rows into
// out; rotate-half RoPE in place of `heads` vectors of one row at one position (cos/sin: that
// position's table row); SiLU(gate) * up of rows laid out [gate | up] into out [rows, inter].
// dim, inter and head_dim / 2 are multiples of 8.
void rms_norm_rows(const float* x, const float* w, int64_t rows, int64_t dim, float eps,
                   float* out);
void rope_row(float* v, int64_t heads, int64_t dim, const float* cos, const float* sin);
void silu_mul_rows(const float* gate_up, int64_t rows, int64_t inter, float* out);
// GELU (tanh approximation)(gate) * up, laid out as silu_mul_rows's (Gemma's GeGLU).
void gelu_tanh_mul_rows(const float* gate_up, int64_t rows, int64_t inter, float* out);
// out += RMSNorm(x) * w, row by row (Gemma's norm of a sublayer's output before the residual).
void add_rms_norm_rows(const float* x, const float* w, int64_t rows, int64_t dim, float eps,
                       float* out);
// The index of the largest of n values, the first one on ties; a NaN counts as the largest
// (the first NaN wins): torch.argmax's answer, for greedy sampling.
int64_t argmax_row(const float* x, int64_t n);

// The layer stack of a Llama-family model for a batch of decode tokens (decoder.cpp), with
// Qwen3's and Gemma 3's additions (empty or default for Llama).
struct DecoderWeights {
  int64_t layers = 0, hidden = 0, heads = 0, kv_heads = 0, dim = 0, inter = 0, max_pos = 0;
  float eps = 1e-5f;
  float scale = 0.f;        // of the attention scores
  float embed_scale = 1.f;  // of the embeddings (Gemma: sqrt(hidden))
  bool gelu = false;        // the MLP: GELU-tanh(gate) * up, else SiLU(gate) * up
  std::vector<WeightView> qkv, o, gate_up, down;  // per layer
  std::vector<const float*> norms;                // before attention, before the MLP per layer;
                                                  // then the final
  std::vector<const float*> qkv_bias;             // per layer, nullptr where none
  std::vector<const float*> qk_norms;             // q's, k's [dim] per layer; empty: none
  std::vector<const float*> out_norms;            // of attention's, the MLP's output per
                                                  // layer (Gemma); empty: none
  std::vector<int64_t> windows;                   // keys a layer sees per layer, 0: all
  WeightView embed, lm_head;
  const float* cos = nullptr;  // [max_pos, dim]
  const float* sin = nullptr;
  const float* local_cos = nullptr;  // the windowed layers' tables (their own RoPE base)
  const float* local_sin = nullptr;
};

struct DecodeBatch {
  int64_t size = 0;                     // B
  const int64_t* ids = nullptr;         // [B]
  const int64_t* positions = nullptr;   // [B]
  const int64_t* out_slots = nullptr;   // [B]
  const int64_t* ctx = nullptr;         // [B, ctx_stride]: each sequence's slots
  int64_t ctx_stride = 0;
  const int64_t* lens = nullptr;        // [B]
  void* k_pool = nullptr;               // [layers, kv_heads, slots, row_bytes] of kv_type
  void* v_pool = nullptr;
  int64_t slots = 0;
  KVType kv_type = KVType::F32;
  int64_t kv_group = 0;                 // I8: channels per scale
  int64_t row_bytes = 0;
  // I8 layers: how their keys' channels are stored (KVFormat's KeyOrder), null: as computed.
  // [layers, kv_heads, dim]: stored channel c of a head is its channel key_order[c] divided by
  // key_scale[c] (a power of two); queries are taken in their KV head's order times the same
  // scales, so every q_c k_c is unchanged
  const int64_t* key_order = nullptr;
  const float* key_scale = nullptr;
  // the sequences the rows belong to (a sequence verifying a draft has a row per token):
  // the matmuls round x to int8 from 8 sequences on, as the same sequences decoded one
  // token each would, so a row's logits do not depend on how many draft rows share the step
  int64_t sequences = 0;
  // Window layers kept apart (KVPool with a window map): their KV lives in these pools, at
  // the window slots w_out_slots / w_ctx (the same shapes as out_slots / ctx), and k_pool
  // holds the other layers only. w_k_pool null: every layer is in k_pool.
  void* w_k_pool = nullptr;  // [window layers, kv_heads, w_slots, row_bytes]
  void* w_v_pool = nullptr;
  int64_t w_slots = 0;
  const int64_t* w_out_slots = nullptr;
  const int64_t* w_ctx = nullptr;
  // An int8 pool's float layers (KVShape.float_layers) kept apart: their KV lives in these
  // pools, at the same slots, in f_type; k_pool holds the other layers only. is_float[l]:
  // layer l is one of them (empty: none). Never with window pools.
  void* f_k_pool = nullptr;  // [float layers, kv_heads, slots, f_row_bytes]
  void* f_v_pool = nullptr;
  KVType f_type = KVType::F32;
  int64_t f_row_bytes = 0;
  std::vector<char> is_float;
};

// Scratch buffers of one decoder; one step at a time per scratch.
struct DecoderScratch {
  std::vector<float> h, x, qkv, attn, gu, act;
  std::vector<int64_t> ctx_start, seq_start, lo;  // attention's rows, one context each
};

// logits [B, vocab] of one step; the batch's inputs must be valid (bindings.cpp checks).
void decode_step(const DecoderWeights& w, const DecodeBatch& batch, DecoderScratch& s,
                 float* logits);

#ifdef RS_AVX2
// The int32 sums of 32 int16 products w . x (w0, w1: inputs 0..15 and 16..31; x at xp) in
// 8 lanes: with AVX-512 VNNI the second half accumulates in the same instruction.
inline __m256i dot_int16x32(__m256i w0, __m256i w1, const int16_t* xp) {
  const __m256i* p = reinterpret_cast<const __m256i*>(xp);
  const __m256i first = _mm256_madd_epi16(w0, _mm256_loadu_si256(p));
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(first, w1, _mm256_loadu_si256(p + 1));
#else
  return _mm256_add_epi32(first, _mm256_madd_epi16(w1, _mm256_loadu_si256(p + 1)));
#endif
}
#endif

// --- x rounded to int8, W's codes as bytes (int8_lanes.cpp, int8_rows.cpp) -------------
// One block of 32 inputs at p rounded to int8 on its own grid: codes[i] = round(p[i] / d)
// (ties to even) with d = max|p| / 127, returned; sums: the codes' sums over inputs 0..15
// and 16..31. Both int8 paths round x with this, so they see the same x.
inline float round_block_int8(const float* p, int8_t* codes, int sums[2]) {
  sums[0] = sums[1] = 0;
#ifdef RS_AVX2
  __m256 xv[4], amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    xv[i] = _mm256_loadu_ps(p + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(_mm256_set1_ps(-0.f), xv[i]));
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  const float d = _mm_cvtss_f32(m) / 127.f;
  const __m256 inv = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
  __m256i w[4];  // rounded to nearest even, as nearbyint
  for (int i = 0; i < 4; ++i) w[i] = _mm256_cvtps_epi32(_mm256_mul_ps(xv[i], inv));
  const __m256i h0 = _mm256_add_epi32(w[0], w[1]), h1 = _mm256_add_epi32(w[2], w[3]);
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(w[0], w[1]), _mm256_packs_epi32(w[2], w[3]));
  // packs interleaves 128-bit lanes: bytes come as 0-3 8-11 16-19 24-27 4-7 12-15 ...
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes),
                      _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  alignas(32) int32_t part[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(part), h0);
  for (int i = 0; i < 8; ++i) sums[0] += part[i];
  _mm256_store_si256(reinterpret_cast<__m256i*>(part), h1);
  for (int i = 0; i < 8; ++i) sums[1] += part[i];
#else
  float amax = 0.f;
  for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(p[i]));
  const float d = amax / 127.f;
  const float inv = d > 0.f ? 1.f / d : 0.f;
  for (int i = 0; i < kBlock; ++i) {
    codes[i] = static_cast<int8_t>(std::nearbyint(p[i] * inv));  // ties to even
    sums[i / 16] += codes[i];
  }
#endif
  return d;
}

#ifdef RS_AVX2
inline __m256i load32(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline void store32(void* p, __m256i v) { _mm256_storeu_si256(static_cast<__m256i*>(p), v); }

// 16 bytes of nibble pairs: the low nibbles, then the high ones
// (the bytes in both halves, the upper half shifted right by 4 bits per 64-bit lane: byte
// i then holds its own high nibble in its low bits)
inline __m256i nibbles(const uint8_t* p) {
  const __m256i raw = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_and_si256(_mm256_srlv_epi64(raw, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(0x0F));
}

// byte i: 16 where bit i of bits is set, else 0
inline __m256i bits_to_16s(uint32_t bits) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  return _mm256_maskz_mov_epi8(static_cast<__mmask32>(bits), _mm256_set1_epi8(16));
#else
  const __m256i spread = _mm256_shuffle_epi8(  // byte i holds byte i / 8 of bits
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
  const __m256i bit = _mm256_set1_epi64x(0x8040201008040201);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
#endif
}

// The 32 codes of one block of GGUF's formats as bytes (input i in byte i; layouts in
// block_formats.cpp), for the integer paths: Q5_0 / Q5_1's from its nibbles qs and fifth bits
// qh; block j of the Q4_K / Q5_K super-block at p (4-bit q, Q5_K with its fifth bit); block j
// of the Q6_K super-block at p (6-bit q, 4 bits from ql and 2 from qh).
inline __m256i q5_codes(const uint8_t* qs, uint32_t qh) {
  return _mm256_or_si256(nibbles(qs), bits_to_16s(qh));
}
inline __m256i k45_codes(const uint8_t* p, int j, bool q5) {
  const uint8_t* qs = p + (q5 ? 48 : 16) + 32 * (j / 2);
  const __m256i v = _mm256_and_si256(_mm256_srli_epi16(load32(qs), 4 * (j & 1)), _mm256_set1_epi8(0x0F));
  if (!q5) return v;
  const __m256i fifth = _mm256_and_si256(_mm256_srli_epi16(load32(p + 16), j), _mm256_set1_epi8(1));
  return _mm256_or_si256(v, _mm256_slli_epi16(fifth, 4));
}
inline __m256i q6k_codes(const uint8_t* p, int j) {
  const int h = j / 4, t = j % 4;
  const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(load32(p + 64 * h + 32 * (t & 1)), 4 * (t >> 1)),
                                      _mm256_set1_epi8(0x0F));
  const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(load32(p + 128 + 32 * h), 2 * t), _mm256_set1_epi8(3));
  return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
}

// unsigned bytes u8 times signed bytes s8, four products summed into each int32 lane of acc
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
inline __m256i dot4(__m256i acc, __m256i u8, __m256i s8) { return _mm256_dpbusd_epi32(acc, u8, s8); }
#elif defined(__AVXVNNI__)
inline __m256i dot4(__m256i acc, __m256i u8, __m256i s8) { return _mm256_dpbusd_avx_epi32(acc, u8, s8); }
#else  // pairs of products in int16: exact while codes stay below 129 (int8_lanes_ok)
inline __m256i dot4(__m256i acc, __m256i u8, __m256i s8) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u8, s8), _mm256_set1_epi16(1)));
}
#endif
#endif

// --- scalar conversions --------------------------------------------------------------
inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
template <typename T>
inline T from_float(float x) { return static_cast<T>(x); }

// bfloat16 is the top half of a float: widen a vector of them and shift, all in registers.
// VF/VU16/VU32: vector types of as many floats, uint16s and uint32s.
template <typename VF, typename VU16, typename VU32>
inline VF widen_bf16(const c10::BFloat16* p) {
  VU16 raw;
  std::memcpy(&raw, p, sizeof(raw));
  VU32 wide = __builtin_convertvector(raw, VU32) << 16;
  VF out;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
}

// --- 8-wide float vectors (one AVX register, or what the CPU has) ----------------------
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

inline v8 load8(const float* p) {
  v8 out;
  std::memcpy(&out, p, sizeof(out));
  return out;
}
inline void store8(float* p, v8 v) { std::memcpy(p, &v, sizeof(v)); }
inline v8 splat8(float x) { return v8{x, x, x, x, x, x, x, x}; }
inline float hsum8(v8 a) {
#ifdef RS_AVX2
  __m256 v;
  std::memcpy(&v, &a, sizeof(v));
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
#else
  float s = 0.f;
  for (int i = 0; i < 8; ++i) s += a[i];
  return s;
#endif
}

// exp(x) for x <= 0 (softmax, SiLU of any sign via exp(-|x|)): Cody-Waite range reduction
// to 2^n * e^r with |r| <= ln2/2 and a degree-6 polynomial, ~1 ulp; below -87 gives 0.
inline v8 exp8(v8 x) {
  const v8 lo = splat8(-87.3f), hi = splat8(88.3f);
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  v8 n = x * splat8(1.44269504088896341f);
  // round to nearest
  n = __builtin_convertvector(__builtin_convertvector(n + (n < splat8(0.f) ? splat8(-0.5f) : splat8(0.5f)), v8i), v8);
  v8 r = x - n * splat8(0.693359375f);
  r = r - n * splat8(-2.12194440e-4f);
  v8 p = splat8(1.9875691500E-4f);
  p = p * r + splat8(1.3981999507E-3f);
  p = p * r + splat8(8.3334519073E-3f);
  p = p * r + splat8(4.1665795894E-2f);
  p = p * r + splat8(1.6666665459E-1f);
  p = p * r + splat8(5.0000001201E-1f);
  p = p * r * r + r + splat8(1.f);
  v8i bits = (__builtin_convertvector(n, v8i) + 127) << 23;
  v8 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  v8 out = p * scale;
  return x <= lo ? splat8(0.f) : out;
}

}  // namespace rs
