// y = x @ W^T with W kept block-quantized (Q8_0, Q4_1) or dense float, for the small row
// counts of decode steps; prefill-sized inputs go through dequant_rows + a BLAS matmul.
//
// Two paths, both splitting W's rows over threads (at::parallel_for):
//   M <= 4 (AVX2): each block of 32 weights is widened to floats in registers and used at once
//     by every input row; the block's scale multiplies the row's partial sum once
//     (d * sum(q * x)) and Q4_1's minimum adds m * sum(x), with the block sums of x computed
//     once per call. W is read exactly once and never written anywhere.
//   otherwise: three rows of W are dequantized into a small buffer that stays in L1, then a
//     4x3 register tile of dot products runs over the inputs, so each weight is widened once
//     per call however many rows x has.
// The result equals x @ dequantize(W)^T up to float summation order.
#include "kernels.h"

#include <algorithm>
#include <vector>

namespace rs {
namespace {

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
      const float* wb;
      if (w.fmt == WFormat::F32) {
        wb = static_cast<const float*>(w.qs) + n0 * K;
      } else {
        dequant_rows(w, n0, nr, buf.data());
        wb = buf.data();
      }
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

// One block of one row of W against MR rows of x: the 32 weights are widened to floats once,
// each x row accumulates d * sum(q * x); Q4_1's minimum is added later as m * sum(x).
template <int MR, WFormat F>
inline void block_dot(const WeightView& w, int64_t row, int64_t b, const float* x, int64_t K,
                      __m256 acc[MR]) {
  __m256 q[4];
  if constexpr (F == WFormat::Q4_1)
    widen_q4(static_cast<const uint8_t*>(w.qs) + row * (K / 2) + b * 16, q);
  else
    widen_q8(static_cast<const int8_t*>(w.qs) + row * K + b * kBlock, q);
  const __m256 db = _mm256_broadcast_ss(w.d + row * (K / kBlock) + b);
  for (int i = 0; i < MR; ++i) {
    const float* xp = x + i * K + b * kBlock;
    __m256 t = _mm256_mul_ps(q[0], _mm256_loadu_ps(xp));
    t = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xp + 8), t);
    t = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xp + 16), t);
    t = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xp + 24), t);
    acc[i] = _mm256_fmadd_ps(t, db, acc[i]);
  }
}

// One row of W against MR rows of x; xsum[i * nb + b] = sum of block b of x row i. Blocks
// go in pairs with two accumulators per row, so consecutive blocks do not wait on each other.
template <int MR, WFormat F>
inline void small_row(const float* x, int64_t K, const float* xsum, const WeightView& w,
                      int64_t row, float* y, int64_t ldy, bool accumulate) {
  const int64_t nb = K / kBlock;
  __m256 acc0[MR], acc1[MR];
  for (int i = 0; i < MR; ++i) acc0[i] = acc1[i] = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    block_dot<MR, F>(w, row, b, x, K, acc0);
    block_dot<MR, F>(w, row, b + 1, x, K, acc1);
  }
  if (b < nb) block_dot<MR, F>(w, row, b, x, K, acc0);
  for (int i = 0; i < MR; ++i) {
    float s = hsum256(_mm256_add_ps(acc0[i], acc1[i]));
    if constexpr (F == WFormat::Q4_1) {  // + sum_b m_b * sum(x in block b)
      const float* m = w.m + row * nb;
      const float* xs = xsum + i * nb;
      __m256 mv = _mm256_setzero_ps();
      int64_t j = 0;
      for (; j + 8 <= nb; j += 8)
        mv = _mm256_fmadd_ps(_mm256_loadu_ps(m + j), _mm256_loadu_ps(xs + j), mv);
      s += hsum256(mv);
      for (; j < nb; ++j) s += m[j] * xs[j];
    }
    y[i * ldy + row] = accumulate ? y[i * ldy + row] + s : s;
  }
}

template <int MR>
void gemm_small_mr(const float* x, const float* xsum, const WeightView& w, float* y,
                   bool accumulate) {
  at::parallel_for(0, w.n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      if (w.fmt == WFormat::Q4_1)
        small_row<MR, WFormat::Q4_1>(x, w.k, xsum, w, n, y, w.n, accumulate);
      else
        small_row<MR, WFormat::Q8_0>(x, w.k, xsum, w, n, y, w.n, accumulate);
    }
  });
}

void gemm_small(const float* x, int64_t M, const WeightView& w, float* y, bool accumulate) {
  const int64_t blocks = M * (w.k / kBlock);  // rows are whole blocks: one flat loop
  thread_local std::vector<float> xsum;
  xsum.resize(w.fmt == WFormat::Q4_1 ? blocks : 0);
  for (int64_t i = 0; i < (int64_t)xsum.size(); ++i) {
    const float* p = x + i * kBlock;
    xsum[i] = hsum256(_mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)),
                                    _mm256_add_ps(_mm256_loadu_ps(p + 16), _mm256_loadu_ps(p + 24))));
  }
  switch (M) {
    case 1: gemm_small_mr<1>(x, xsum.data(), w, y, accumulate); break;
    case 2: gemm_small_mr<2>(x, xsum.data(), w, y, accumulate); break;
    case 3: gemm_small_mr<3>(x, xsum.data(), w, y, accumulate); break;
    default: gemm_small_mr<4>(x, xsum.data(), w, y, accumulate); break;
  }
}
#endif

}  // namespace

void dequant_rows(const WeightView& w, int64_t row0, int64_t rows, float* out) {
  const int64_t K = w.k, nb = K / kBlock;
  if (w.fmt == WFormat::F32) {
    std::memcpy(out, static_cast<const float*>(w.qs) + row0 * K, rows * K * sizeof(float));
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

void qgemm(const float* x, int64_t M, const WeightView& w, float* y, bool accumulate) {
  if (M <= 0) return;
#ifdef RS_AVX2
  if (M <= 4 && w.fmt != WFormat::F32) return gemm_small(x, M, w, y, accumulate);
#endif
  gemm_buffered(x, M, w, y, accumulate);
}

}  // namespace rs
