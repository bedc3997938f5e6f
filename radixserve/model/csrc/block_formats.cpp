// GGUF's block formats read straight from the file's bytes: dequantization and the integer
// dot products of the few-row matmul path (quant_gemm.cpp dispatches here).
//
// Layouts (little-endian; f16 is an IEEE half; "input i" counts within the block):
//   Q5_0  22 B / 32:  f16 d | u32 qh | 16 B qs            w = d * (q - 16)
//   Q5_1  24 B / 32:  f16 d | f16 m | u32 qh | 16 B qs    w = d * q + m
//         q = low nibble of qs[i] (input i < 16) or high nibble of qs[i - 16], plus bit i of
//         qh as its fifth bit
//   Q4_K 144 B / 256: f16 d | f16 dmin | 12 B scales | 128 B qs
//   Q5_K 176 B / 256: f16 d | f16 dmin | 12 B scales | 32 B qh | 128 B qs
//         eight sub-blocks of 32, each with a 6-bit scale sc and min m packed in the 12 bytes;
//         w = d * sc * q - dmin * m. Sub-block j's codes: qs[32 * (j / 2) + i], low nibble
//         for even j, high for odd; Q5_K adds bit j of qh[i] as the fifth bit
//   Q6_K 210 B / 256: 128 B ql | 64 B qh | 16 int8 scales | f16 d
//         w = d * sc[e / 16] * (q - 32), q = four bits of ql and two of qh (see unpack)
//   Q2_K  84 B / 256: 16 B scales | 64 B qs | f16 d | f16 dmin   (2-bit, scale/min per 16)
//   Q3_K 110 B / 256: 32 B hmask | 64 B qs | 12 B scales | f16 d (3-bit, 6-bit scale per 16)
//
// Vector code (AVX2, with AVX-512 mask instructions where present) unpacks a block of 32
// inputs into two int16 vectors with one float scale and one float min (w = scale * code +
// min). The integer dot products meet those codes with x rounded to int16 per block of 32
// (quant_gemm.cpp's XBlocks): two madds per block and row of x, scaled by both blocks'
// scales, the mins added as min * sum(x in block). Q6_K's per-16 scales are multiplied into
// its codes (|code| <= 4096, so a block's int32 sum cannot overflow). Q2_K and Q3_K are
// dequantized only (the float paths); every format has a plain C++ twin.
#include "kernels.h"

namespace rs {
namespace {

inline uint32_t u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Q3_K: the signed 6-bit scale of group g (of 16 inputs)
inline int scale_q3k(const uint8_t* s, int g) {
  const int low = (s[g & 7] >> (4 * (g >> 3))) & 0xF;
  const int high = (s[8 + (g & 3)] >> (2 * (g >> 2))) & 3;
  return (low | (high << 4)) - 32;
}

// --- plain C++: one format block into floats -------------------------------------------
void dequant_block_ref(WFormat f, const uint8_t* b, float* out) {
  switch (f) {
    case WFormat::Q5_0:
    case WFormat::Q5_1: {
      const bool q51 = f == WFormat::Q5_1;
      const float d = half_at(b), m = q51 ? half_at(b + 2) : -16.f * d;
      const uint32_t qh = u32(b + (q51 ? 4 : 2));
      const uint8_t* qs = b + (q51 ? 8 : 6);
      for (int i = 0; i < 16; ++i) {
        out[i] = d * ((qs[i] & 0xF) | (((qh >> i) & 1) << 4)) + m;
        out[i + 16] = d * ((qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4)) + m;
      }
      break;
    }
    case WFormat::Q4_K:
    case WFormat::Q5_K: {
      const bool q5 = f == WFormat::Q5_K;
      const float d = half_at(b), dmin = half_at(b + 2);
      const uint8_t* qh = b + 16;
      const uint8_t* qs = b + (q5 ? 48 : 16);
      for (int j = 0; j < 8; ++j) {
        int sc, m;
        scale_min_k4(b + 4, j, sc, m);
        for (int i = 0; i < 32; ++i) {
          int q = (qs[32 * (j / 2) + i] >> (4 * (j & 1))) & 0xF;
          if (q5) q |= ((qh[i] >> j) & 1) << 4;
          out[32 * j + i] = d * sc * q - dmin * m;
        }
      }
      break;
    }
    case WFormat::Q6_K: {
      const uint8_t *ql = b, *qh = b + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      const float d = half_at(b + 208);
      for (int e = 0; e < 256; ++e) {
        const int h = e >> 7, r = e & 127;
        const int lo = (ql[64 * h + (r & 63)] >> (4 * (r >> 6))) & 0xF;
        const int hi = (qh[32 * h + (r & 31)] >> (2 * (r >> 5))) & 3;
        out[e] = d * sc[e >> 4] * ((lo | (hi << 4)) - 32);
      }
      break;
    }
    case WFormat::Q2_K: {
      const uint8_t *sc = b, *qs = b + 16;
      const float d = half_at(b + 80), dmin = half_at(b + 82);
      for (int e = 0; e < 256; ++e) {
        const int h = e >> 7, r = e & 127;
        const int q = (qs[32 * h + (r & 31)] >> (2 * (r >> 5))) & 3;
        const int s = sc[e >> 4];
        out[e] = d * (s & 0xF) * q - dmin * (s >> 4);
      }
      break;
    }
    case WFormat::Q3_K: {
      const uint8_t *hmask = b, *qs = b + 32, *sc = b + 96;
      const float d = half_at(b + 108);
      for (int e = 0; e < 256; ++e) {
        const int h = e >> 7, r = e & 127;
        const int low = (qs[32 * h + (r & 31)] >> (2 * (r >> 5))) & 3;
        const int high = (hmask[e & 31] >> (e >> 5)) & 1;
        out[e] = d * scale_q3k(sc, e >> 4) * (low - (high ? 0 : 4));
      }
      break;
    }
    default: break;
  }
}

#ifdef RS_AVX2
#if defined(__AVX512BW__) && defined(__AVX512VL__)
#define RS_AVX512_MASKS 1
#endif

// 32 bytes of codes (input i in byte i) widened to int16: inputs 0..15 and 16..31
inline void widen_codes(__m256i codes, __m256i& w0, __m256i& w1) {
  w0 = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(codes));
  w1 = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(codes, 1));
}

// Q5_0 / Q5_1: nibbles of 16 bytes, then the fifth bits from qh. Q5_0 subtracts 16 where the
// bit is clear (q - 16); Q5_1 adds 16 where it is set (q).
template <bool Q51>
inline void unpack_q5(const uint8_t* qs, uint32_t qh, __m256i& w0, __m256i& w1) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0x0F);
  w0 = _mm256_cvtepu8_epi16(_mm_and_si128(raw, mask));
  w1 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), mask));
  const __m256i sixteen = _mm256_set1_epi16(16);
#ifdef RS_AVX512_MASKS
  const __mmask16 k0 = static_cast<__mmask16>(qh), k1 = static_cast<__mmask16>(qh >> 16);
  if constexpr (Q51) {
    w0 = _mm256_mask_add_epi16(w0, k0, w0, sixteen);
    w1 = _mm256_mask_add_epi16(w1, k1, w1, sixteen);
  } else {
    w0 = _mm256_mask_sub_epi16(w0, static_cast<__mmask16>(~k0), w0, sixteen);
    w1 = _mm256_mask_sub_epi16(w1, static_cast<__mmask16>(~k1), w1, sixteen);
  }
#else
  const __m256i bits = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048,
                                         4096, 8192, 16384, static_cast<int16_t>(0x8000));
  const __m256i h0 = _mm256_set1_epi16(static_cast<int16_t>(qh & 0xFFFF));
  const __m256i h1 = _mm256_set1_epi16(static_cast<int16_t>(qh >> 16));
  const __m256i s0 = _mm256_and_si256(_mm256_cmpeq_epi16(_mm256_and_si256(h0, bits), bits), sixteen);
  const __m256i s1 = _mm256_and_si256(_mm256_cmpeq_epi16(_mm256_and_si256(h1, bits), bits), sixteen);
  w0 = _mm256_add_epi16(w0, s0);
  w1 = _mm256_add_epi16(w1, s1);
  if constexpr (!Q51) {
    w0 = _mm256_sub_epi16(w0, sixteen);
    w1 = _mm256_sub_epi16(w1, sixteen);
  }
#endif
}

// Block b (32 inputs) of one row in format F: codes w0, w1 and w = scale * code + min.
// K-quant rows keep their super-block's scales between calls (blocks go in order).
template <WFormat F>
struct Unpack {
  const uint8_t* row;
  float scale[8], min[8];

  inline void block(int64_t b, __m256i& w0, __m256i& w1, float& s, float& mn) {
    if constexpr (F == WFormat::Q5_0) {
      const uint8_t* p = row + b * 22;
      unpack_q5<false>(p + 6, u32(p + 2), w0, w1);
      s = half_at(p);
      mn = 0.f;
    } else if constexpr (F == WFormat::Q5_1) {
      const uint8_t* p = row + b * 24;
      unpack_q5<true>(p + 8, u32(p + 4), w0, w1);
      s = half_at(p);
      mn = half_at(p + 2);
    } else if constexpr (F == WFormat::Q4_K || F == WFormat::Q5_K) {
      constexpr int64_t bytes = F == WFormat::Q4_K ? 144 : 176;
      const uint8_t* p = row + (b / 8) * bytes;
      const int j = static_cast<int>(b % 8);
      if (j == 0) {
        const float d = half_at(p), dmin = half_at(p + 2);
        for (int i = 0; i < 8; ++i) {
          int sc, m;
          scale_min_k4(p + 4, i, sc, m);
          scale[i] = d * sc;
          min[i] = -dmin * m;
        }
      }
      widen_codes(k45_codes(p, j, F == WFormat::Q5_K), w0, w1);
      s = scale[j];
      mn = min[j];
    } else {  // Q6_K
      const uint8_t* p = row + (b / 8) * 210;
      const int c = static_cast<int>(b % 8);
      widen_codes(q6k_codes(p, c), w0, w1);
      const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192) + 2 * c;
      const __m256i off = _mm256_set1_epi16(32);
      w0 = _mm256_mullo_epi16(_mm256_sub_epi16(w0, off), _mm256_set1_epi16(sc[0]));
      w1 = _mm256_mullo_epi16(_mm256_sub_epi16(w1, off), _mm256_set1_epi16(sc[1]));
      s = half_at(p + 208);
      mn = 0.f;
    }
  }
};

inline __m256 low_float(__m256i w) { return _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(w))); }
inline __m256 high_float(__m256i w) { return _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(w, 1))); }

template <WFormat F>
void dequant_row_vec(const uint8_t* row, int64_t K, float* out) {
  Unpack<F> u{row, {}, {}};
  __m256i w[2];
  float s, mn;
  for (int64_t b = 0; b < K / kBlock; ++b, out += kBlock) {
    u.block(b, w[0], w[1], s, mn);
    const __m256 sv = _mm256_set1_ps(s), mv = _mm256_set1_ps(mn);
    for (int h = 0; h < 2; ++h) {
      _mm256_storeu_ps(out + 16 * h, _mm256_fmadd_ps(low_float(w[h]), sv, mv));
      _mm256_storeu_ps(out + 16 * h + 8, _mm256_fmadd_ps(high_float(w[h]), sv, mv));
    }
  }
}

// Block b of one row against MR rows of x into acc (the mins into msum).
template <int MR, WFormat F>
inline void block_dot(Unpack<F>& u, const XBlocks& x, int64_t K, int64_t b, __m256 acc[MR],
                      float msum[MR]) {
  const int64_t nb = K / kBlock;
  __m256i w0, w1;
  float s, mn;
  u.block(b, w0, w1, s, mn);
  const __m256 sw = _mm256_set1_ps(s);
  for (int i = 0; i < MR; ++i) {
    const int16_t* xp = x.q + i * K + b * kBlock;
    const __m256i dot = dot_int16x32(w0, w1, xp);
    const __m256 scale = _mm256_mul_ps(sw, _mm256_broadcast_ss(x.d + i * nb + b));
    acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[i]);
    if constexpr (F == WFormat::Q5_1 || F == WFormat::Q4_K || F == WFormat::Q5_K)
      msum[i] += mn * x.sum[i * nb + b];
  }
}

// One row of W against MR rows of x; blocks in pairs with two accumulators per row of x, so
// consecutive blocks' FMAs do not wait on each other (every format has an even block count
// per row but Q5_0/Q5_1, whose odd last block goes alone).
template <int MR, WFormat F>
void row_dot(const XBlocks& x, int64_t K, const uint8_t* row, float* y, int64_t ldy,
             bool accumulate) {
  const int64_t nb = K / kBlock;
  Unpack<F> u{row, {}, {}};
  __m256 acc0[MR], acc1[MR];
  float msum[MR] = {};
  for (int i = 0; i < MR; ++i) acc0[i] = acc1[i] = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    block_dot<MR, F>(u, x, K, b, acc0, msum);
    block_dot<MR, F>(u, x, K, b + 1, acc1, msum);
  }
  if (b < nb) block_dot<MR, F>(u, x, K, b, acc0, msum);
  for (int i = 0; i < MR; ++i) {
    __m256 v = _mm256_add_ps(acc0[i], acc1[i]);
    __m128 t = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    t = _mm_add_ps(t, _mm_movehl_ps(t, t));
    t = _mm_add_ss(t, _mm_movehdup_ps(t));
    const float out = _mm_cvtss_f32(t) + msum[i];
    y[i * ldy] = accumulate ? y[i * ldy] + out : out;
  }
}

template <WFormat F>
void rows_dot(const XBlocks& x, int64_t M, int64_t K, const uint8_t* row, float* y,
              int64_t ldy, bool accumulate) {
  const int64_t nb = K / kBlock;
  for (int64_t i = 0; i < M; i += 4) {
    const XBlocks xi{x.q + i * K, x.d + i * nb, x.sum + i * nb};
    float* yi = y + i * ldy;
    switch (std::min<int64_t>(M - i, 4)) {
      case 1: row_dot<1, F>(xi, K, row, yi, ldy, accumulate); break;
      case 2: row_dot<2, F>(xi, K, row, yi, ldy, accumulate); break;
      case 3: row_dot<3, F>(xi, K, row, yi, ldy, accumulate); break;
      default: row_dot<4, F>(xi, K, row, yi, ldy, accumulate); break;
    }
  }
}
#endif  // RS_AVX2

}  // namespace

int64_t block_inputs(WFormat f) {
  switch (f) {
    case WFormat::Q5_0:
    case WFormat::Q5_1: return 32;
    case WFormat::Q2_K:
    case WFormat::Q3_K:
    case WFormat::Q4_K:
    case WFormat::Q5_K:
    case WFormat::Q6_K: return 256;
    default: return 0;
  }
}

int64_t block_bytes(WFormat f) {
  switch (f) {
    case WFormat::Q5_0: return 22;
    case WFormat::Q5_1: return 24;
    case WFormat::Q2_K: return 84;
    case WFormat::Q3_K: return 110;
    case WFormat::Q4_K: return 144;
    case WFormat::Q5_K: return 176;
    case WFormat::Q6_K: return 210;
    default: return 0;
  }
}

void dequant_gguf_row(const WeightView& w, int64_t row, float* out, bool reference) {
  const uint8_t* p = static_cast<const uint8_t*>(w.qs) + row * w.row_bytes;
#ifdef RS_AVX2
  if (!reference) {
    switch (w.fmt) {
      case WFormat::Q5_0: return dequant_row_vec<WFormat::Q5_0>(p, w.k, out);
      case WFormat::Q5_1: return dequant_row_vec<WFormat::Q5_1>(p, w.k, out);
      case WFormat::Q4_K: return dequant_row_vec<WFormat::Q4_K>(p, w.k, out);
      case WFormat::Q5_K: return dequant_row_vec<WFormat::Q5_K>(p, w.k, out);
      case WFormat::Q6_K: return dequant_row_vec<WFormat::Q6_K>(p, w.k, out);
      default: break;  // Q2_K, Q3_K: the plain code
    }
  }
#endif
  const int64_t inputs = block_inputs(w.fmt), bytes = block_bytes(w.fmt);
  for (int64_t b = 0; b < w.k / inputs; ++b) dequant_block_ref(w.fmt, p + b * bytes, out + b * inputs);
}

void gguf_row_dot(const XBlocks& x, int64_t M, const WeightView& w, int64_t row, float* y,
                  int64_t ldy, bool accumulate) {
#ifdef RS_AVX2
  const uint8_t* p = static_cast<const uint8_t*>(w.qs) + row * w.row_bytes;
  switch (w.fmt) {
    case WFormat::Q5_0: return rows_dot<WFormat::Q5_0>(x, M, w.k, p, y, ldy, accumulate);
    case WFormat::Q5_1: return rows_dot<WFormat::Q5_1>(x, M, w.k, p, y, ldy, accumulate);
    case WFormat::Q4_K: return rows_dot<WFormat::Q4_K>(x, M, w.k, p, y, ldy, accumulate);
    case WFormat::Q5_K: return rows_dot<WFormat::Q5_K>(x, M, w.k, p, y, ldy, accumulate);
    case WFormat::Q6_K: return rows_dot<WFormat::Q6_K>(x, M, w.k, p, y, ldy, accumulate);
    default: break;
  }
#endif
  (void)x, (void)M, (void)w, (void)row, (void)y, (void)ldy, (void)accumulate;
}

}  // namespace rs
