// y = x @ W^T with W kept block-quantized (Q8_0, Q4_1 here; GGUF's block formats in
// block_formats.cpp), a Stack of those, or dense float, for the small row counts of decode
// steps; prefill-sized inputs go through dequant_rows + a BLAS matmul.
//
// Three paths, all splitting W's rows over threads (at::parallel_for):
//   few rows (AVX2, quantized W; see qgemm for the thresholds): integer dot products, x's rows 4 at a time against each row
//     of W while it is in L1. Each 32-input block of x is rounded to
//     int16 with its own scale, and each weight block, widened to int16, meets it in madd
//     instructions (16 multiply-adds each), scaled by both blocks' scales; Q4_1's minimum adds
//     m * sum(x) with the exact float sums. 1.5x faster than widening the weights to floats
//     here. llama.cpp rounds x to int8 instead (another 1.3x): that moved the default model's
//     matmuls by 0.5-2.6% (its activations have outliers 10-18x their RMS, which take a
//     block's whole int8 range), and its logits by several percent; int16 moves them by ~1e-5.
//   fewer than 8 rows otherwise (dense W, or no AVX2): three rows of W are dequantized into a
//     small buffer that stays in L1, then a 4x3 register tile of float dot products runs over
//     the inputs. This equals x @ dequantize(W)^T up to float summation order.
//   8 rows or more otherwise: gemm_lanes (lane_gemm.cpp), float FMAs with the vector lanes
//     over x's rows, the same function up to summation order; or, when the caller allows it
//     (the decoder's batches), gemm_int8_lanes (int8_lanes.cpp) with x rounded to int8.
#include "kernels.h"

#ifndef RS_SMALL_ROWS  // a build flag only for timing experiments
#define RS_SMALL_ROWS 64
#endif

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <string>
#include <vector>

namespace rs {
namespace {

constexpr int64_t kSmallRows = RS_SMALL_ROWS;
constexpr int64_t kLaneRows = 8;  // a vector of rows: fewer would leave lanes idle

void dequant_block(const WeightView& w, int64_t row, int64_t b, float* out) {
  const int64_t nb = w.k / kBlock;
  const float d = w.d[row * nb + b];
  if (w.fmt == WFormat::Q8_0) {
    const int8_t* q = static_cast<const int8_t*>(w.qs) + row * w.k + b * kBlock;
    for (int i = 0; i < kBlock; ++i) out[i] = d * q[i];
  } else {  // Q4_1
    const uint8_t* q = static_cast<const uint8_t*>(w.qs) + row * (w.k / 2) + b * (kBlock / 2);
    const float m = w.m[row * nb + b];
    for (int i = 0; i < kBlock / 2; ++i) {
      out[i] = d * (q[i] & 0x0F) + m;
      out[i + kBlock / 2] = d * (q[i] >> 4) + m;
    }
  }
}

template <int MR, int NR>
inline void micro_tile(const float* x, int64_t K, const float* wb, int64_t ldw, float* y,
                       int64_t ldy, bool accumulate) {
  v8 acc[MR][NR] = {};
  for (int64_t k = 0; k < K; k += 8) {
    v8 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = load8(wb + j * ldw + k);
    for (int i = 0; i < MR; ++i) {
      const v8 xv = load8(x + i * K + k);
      for (int j = 0; j < NR; ++j) acc[i][j] += xv * wv[j];
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      const float s = hsum8(acc[i][j]);
      y[i * ldy + j] = accumulate ? y[i * ldy + j] + s : s;
    }
}

template <int NR>
void tile_rows(const float* x, int64_t M, int64_t K, const float* wb, int64_t ldw, float* y,
               int64_t ldy, bool accumulate) {
  int64_t i = 0;
  for (; i + 4 <= M; i += 4) micro_tile<4, NR>(x + i * K, K, wb, ldw, y + i * ldy, ldy, accumulate);
  switch (M - i) {
    case 3: micro_tile<3, NR>(x + i * K, K, wb, ldw, y + i * ldy, ldy, accumulate); break;
    case 2: micro_tile<2, NR>(x + i * K, K, wb, ldw, y + i * ldy, ldy, accumulate); break;
    case 1: micro_tile<1, NR>(x + i * K, K, wb, ldw, y + i * ldy, ldy, accumulate); break;
    default: break;
  }
}

void gemm_buffered(const float* x, int64_t M, const WeightView& w, float* y, bool accumulate) {
  constexpr int64_t NR = 3;
  const int64_t N = w.n, K = w.k, tiles = (N + NR - 1) / NR;
  at::parallel_for(0, tiles, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(w.fmt == WFormat::F32 ? 0 : NR * K);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * NR, nr = std::min(NR, N - n0);
      const float* wb = weight_rows(w, n0, nr, buf.data());
      float* yt = y + n0;
      if (nr == 3) tile_rows<3>(x, M, K, wb, K, yt, N, accumulate);
      else if (nr == 2) tile_rows<2>(x, M, K, wb, K, yt, N, accumulate);
      else tile_rows<1>(x, M, K, wb, K, yt, N, accumulate);
    }
  });
}

#ifdef RS_AVX2
inline void widen_q4(const uint8_t* p, __m256 q[4]) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(raw, mask);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
  q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
  q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(lo, lo)));
  q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
  q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(hi, hi)));
}

inline void widen_q8(const int8_t* p, __m256 q[4]) {
  for (int i = 0; i < 4; ++i)
    q[i] = _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * i))));
}

inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The rows of x rounded per block of 32 for the integer dot products: q = round(x / d) with
// d = max|x| / 32767, plus the exact float sum of each block.
struct QuantizedRows {
  std::vector<int16_t> q;
  std::vector<float> d, sum;
};

void quantize_rows(const float* x, int64_t M, int64_t K, QuantizedRows& out) {
  const int64_t blocks = M * K / kBlock;  // rows are whole blocks: one flat loop
  out.q.resize(M * K);
  out.d.resize(blocks);
  out.sum.resize(blocks);
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t b = 0; b < blocks; ++b) {
    const float* p = x + b * kBlock;
    __m256 v[4], amax = _mm256_setzero_ps(), total = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(p + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
      total = _mm256_add_ps(total, v[i]);
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float d = _mm_cvtss_f32(m) / 32767.f;
    const __m256 inv = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
    out.d[b] = d;
    out.sum[b] = hsum256(total);
    for (int i = 0; i < 4; i += 2) {
      // packs works within 128-bit lanes; the permute puts the 16 words back in order
      const __m256i w = _mm256_packs_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv)),
                                           _mm256_cvtps_epi32(_mm256_mul_ps(v[i + 1], inv)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.q.data() + b * kBlock + 8 * i),
                          _mm256_permute4x64_epi64(w, 0xD8));
    }
  }
}

// One block of one row of W against MR rows of x: the weight codes widened to int16 once,
// then per row two madds (32 multiply-adds into 8 int32 sums), scaled by both blocks' scales.
// Q4_1's minimum is added later as m * sum(x) with the exact float sums.
template <int MR, WFormat F>
inline void block_dot(const uint8_t* wq_ptr, const float* dw_ptr, const XBlocks& x, int64_t b,
                      int64_t K, __m256 acc[MR]) {
  const int64_t nb = K / kBlock;
  __m256i w0, w1;  // inputs 0..15 and 16..31 of the block as int16
  if constexpr (F == WFormat::Q4_1) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wq_ptr));
    const __m128i mask = _mm_set1_epi8(0x0F);
    w0 = _mm256_cvtepu8_epi16(_mm_and_si128(raw, mask));
    w1 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), mask));
  } else {
    w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wq_ptr)));
    w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wq_ptr + 16)));
  }
  const __m256 dw = _mm256_broadcast_ss(dw_ptr);
  for (int i = 0; i < MR; ++i) {
    const int16_t* xp = x.q + i * K + b * kBlock;
    const __m256i dot = dot_int16x32(w0, w1, xp);
    const __m256 scale = _mm256_mul_ps(dw, _mm256_broadcast_ss(x.d + i * nb + b));
    acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[i]);
  }
}

// One row of W against MR rows of x. Blocks go in pairs with two accumulators per row, so
// consecutive blocks' FMAs do not wait on each other.
template <int MR, WFormat F>
inline void small_row(const XBlocks& x, const WeightView& w, int64_t row, float* y, int64_t ldy,
                      bool accumulate) {
  const int64_t K = w.k, nb = K / kBlock;
  constexpr int64_t bytes = F == WFormat::Q4_1 ? kBlock / 2 : kBlock;
  const uint8_t* qs = static_cast<const uint8_t*>(w.qs) + row * nb * bytes;
  const float* d = w.d + row * nb;
  __m256 acc0[MR], acc1[MR];
  for (int i = 0; i < MR; ++i) acc0[i] = acc1[i] = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    block_dot<MR, F>(qs + b * bytes, d + b, x, b, K, acc0);
    block_dot<MR, F>(qs + (b + 1) * bytes, d + b + 1, x, b + 1, K, acc1);
  }
  if (b < nb) block_dot<MR, F>(qs + b * bytes, d + b, x, b, K, acc0);
  for (int i = 0; i < MR; ++i) {
    float s = hsum256(_mm256_add_ps(acc0[i], acc1[i]));
    if constexpr (F == WFormat::Q4_1) {  // + sum_b m_b * sum(x in block b)
      const float* m = w.m + row * nb;
      const float* xs = x.sum + i * nb;
      __m256 mv = _mm256_setzero_ps();
      int64_t j = 0;
      for (; j + 8 <= nb; j += 8)
        mv = _mm256_fmadd_ps(_mm256_loadu_ps(m + j), _mm256_loadu_ps(xs + j), mv);
      s += hsum256(mv);
      for (; j < nb; ++j) s += m[j] * xs[j];
    }
    y[i * ldy] = accumulate ? y[i * ldy] + s : s;
  }
}

// One row of a Q8_0 / Q4_1 W against x's rows, 4 at a time while it is in L1.
template <WFormat F>
void split_row_dot(const XBlocks& x, int64_t M, const WeightView& w, int64_t row, float* y,
                   int64_t ldy, bool accumulate) {
  const int64_t nb = w.k / kBlock;
  for (int64_t i = 0; i < M; i += 4) {
    const XBlocks xi{x.q + i * w.k, x.d + i * nb, x.sum + i * nb};
    float* yi = y + i * ldy;
    switch (std::min<int64_t>(M - i, 4)) {
      case 1: small_row<1, F>(xi, w, row, yi, ldy, accumulate); break;
      case 2: small_row<2, F>(xi, w, row, yi, ldy, accumulate); break;
      case 3: small_row<3, F>(xi, w, row, yi, ldy, accumulate); break;
      default: small_row<4, F>(xi, w, row, yi, ldy, accumulate); break;
    }
  }
}

// Rows of W (of any format with integer dot products, or a Stack of them) split over threads.
void gemm_small(const float* x, int64_t M, const WeightView& w, float* y, bool accumulate) {
  thread_local QuantizedRows rows;
  quantize_rows(x, M, w.k, rows);
  const XBlocks xb{rows.q.data(), rows.d.data(), rows.sum.data()};
  at::parallel_for(0, w.n, 16, [&](int64_t begin, int64_t end) {
    for_rows(w, begin, end, [&](const WeightView& part, int64_t row, int64_t n) {
      float* yn = y + n;
      if (part.fmt == WFormat::Q8_0) split_row_dot<WFormat::Q8_0>(xb, M, part, row, yn, w.n, accumulate);
      else if (part.fmt == WFormat::Q4_1) split_row_dot<WFormat::Q4_1>(xb, M, part, row, yn, w.n, accumulate);
      else gguf_row_dot(xb, M, part, row, yn, w.n, accumulate);
    });
  });
}
#endif

}  // namespace

const float* weight_rows(const WeightView& w, int64_t row0, int64_t rows, float* buf) {
  if (w.fmt == WFormat::F32) return static_cast<const float*>(w.qs) + row0 * w.k;
  dequant_rows(w, row0, rows, buf);
  return buf;
}

void dequant_rows(const WeightView& w, int64_t row0, int64_t rows, float* out) {
  const int64_t K = w.k, nb = K / kBlock;
  if (w.fmt == WFormat::F32) {
    std::memcpy(out, static_cast<const float*>(w.qs) + row0 * K, rows * K * sizeof(float));
    return;
  }
  if (w.fmt == WFormat::Stack) {
    for_rows(w, row0, row0 + rows, [&](const WeightView& part, int64_t row, int64_t n) {
      dequant_rows(part, row, 1, out + (n - row0) * K);
    });
    return;
  }
  if (block_inputs(w.fmt) > 0) {
    for (int64_t r = 0; r < rows; ++r) dequant_gguf_row(w, row0 + r, out + r * K);
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row = row0 + r;
#ifdef RS_AVX2
    __m256 q[4];
    for (int64_t b = 0; b < nb; ++b) {
      const __m256 d = _mm256_broadcast_ss(w.d + row * nb + b);
      float* o = out + r * K + b * kBlock;
      if (w.fmt == WFormat::Q4_1) {
        widen_q4(static_cast<const uint8_t*>(w.qs) + row * (K / 2) + b * 16, q);
        const __m256 m = _mm256_broadcast_ss(w.m + row * nb + b);
        for (int i = 0; i < 4; ++i) _mm256_storeu_ps(o + 8 * i, _mm256_fmadd_ps(q[i], d, m));
      } else {
        widen_q8(static_cast<const int8_t*>(w.qs) + row * K + b * kBlock, q);
        for (int i = 0; i < 4; ++i) _mm256_storeu_ps(o + 8 * i, _mm256_mul_ps(q[i], d));
      }
    }
#else
    for (int64_t b = 0; b < nb; ++b) dequant_block(w, row, b, out + r * K + b * kBlock);
#endif
  }
}

bool use_int8_lanes(int set) {
  static std::atomic<int> on{[] {
    const char* env = std::getenv("RADIXSERVE_INT8_LANES");
    return env == nullptr || std::string(env) != "0" ? 1 : 0;
  }()};
  if (set >= 0) on = set;
  return on != 0;
}

int64_t integer_rows(const WeightView& w) {
  switch (w.fmt) {
    // measured on the default model's matrices (Zen 3, one core): from 8 rows on, the float
    // lanes beat the integer dot products on Q4_1 by 1.1-1.7x; on Q8_0 (the LM head) the
    // integer path stays ahead up to 64 rows
    case WFormat::Q8_0: return kSmallRows;
    case WFormat::Q4_1:
    case WFormat::Q5_0:
    case WFormat::Q5_1:
    case WFormat::Q4_K:
    case WFormat::Q5_K:
    case WFormat::Q6_K: return kLaneRows - 1;
    case WFormat::Stack: {
      int64_t rows = kSmallRows;
      for (int64_t p = 0; p < w.num_parts; ++p) rows = std::min(rows, integer_rows(w.parts[p]));
      return rows;
    }
    default: return 0;  // F32, Q2_K, Q3_K: the float paths
  }
}

void qgemm(const float* x, int64_t M, const WeightView& w, float* y, bool accumulate,
           bool int8_rows, bool rows_alone) {
  if (M <= 0) return;
  const bool lanes = M >= kLaneRows && !rows_alone;  // else each row is computed on its own
  if (int8_rows && lanes && int8_lanes_ok(w)) return gemm_int8_lanes(x, M, w, y, accumulate);
  if (int8_rows && !lanes && int8_few_ok(w)) return gemm_int8_few(x, M, w, y, accumulate);
#ifdef RS_AVX2
  if (M <= integer_rows(w) || (!lanes && integer_rows(w) > 0)) return gemm_small(x, M, w, y, accumulate);
#endif
  if (!lanes) return gemm_buffered(x, M, w, y, accumulate);
  gemm_lanes(x, M, w, y, accumulate);
}

}  // namespace rs
