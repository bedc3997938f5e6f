// The few-row integer path for GGUF's block formats (Q5_0, Q5_1, Q4_K, Q5_K, Q6_K): y[M, N]
// (+)= x[M, K] @ W^T for 1..7 rows of x, with x rounded to int8 per block of 32 inputs
// (round_block_int8, the batched path's rounding) and W's codes unpacked to unsigned bytes in
// registers, 32 at a time, met by byte dot products (vpdpbusd with VNNI, two instructions on
// plain AVX2). This is the decode path of one or a few sequences on such files.
//
// Per block b of 32 inputs and row r of x, dot4 gives 8 int32 sums: lanes 0..3 over inputs
// 0..15, lanes 4..7 over 16..31. With W's w = s_h * code + c_h on half h (its scale s_h and
// min c_h, the format's code offset folded into c_h) and x = dx_b * xcode:
//   y += sum over lanes of (s_h dx_b) * dot  +  sum over halves of c_h * (dx_b * xsum_h)
// The first costs one FMA per block on a vector of lane scales; the second one FMA per eight
// halves. Rows go eight blocks at a time (a K-quant super-block, whose packed scales and mins
// are unpacked once into 16 per-half floats, or eight Q5 blocks, whose scales are converted
// together); a Q5 row's last nb % 8 blocks go one by one.
//
// llama.cpp rounds x to int8 for these formats too (per 256 inputs for the K-quants; per 32
// here keeps an outlier's block apart from the rest). Each row of x is computed on its own, in
// the same order whatever M, so a row's result does not depend on the rows beside it.
#include "kernels.h"

namespace rs {

#ifdef RS_AVX2
namespace {

// x's rows rounded to int8: codes [M][K]; per half-block h (16 inputs), its block's dx and
// dx times the half's code sum, [M][2 nb] each
constexpr int64_t kPassRows = 16;  // rows of x that meet a row of W unpacked once

struct XRows {
  std::vector<int8_t> q;
  std::vector<float> dx, xsum;
};

void round_rows(const float* x, int64_t M, int64_t K, XRows& out) {
  const int64_t nb = K / kBlock;
  out.q.resize(M * K);
  out.dx.resize(M * 2 * nb);
  out.xsum.resize(M * 2 * nb);
  for (int64_t i = 0; i < M * nb; ++i) {
    int sums[2];
    const float d = round_block_int8(x + i * kBlock, out.q.data() + i * kBlock, sums);
    out.dx[2 * i] = out.dx[2 * i + 1] = d;
    out.xsum[2 * i] = d * sums[0];
    out.xsum[2 * i + 1] = d * sums[1];
  }
}

// Eight blocks of a row (a K-quant super-block, or eight Q5 blocks): their codes, and their
// 16 halves' scales and mins as two vectors each (halves 0..7, 8..15)
struct SuperBlock {
  __m256i codes[8];
  __m256 s[2], c[2];
};

// 8 byte values (one per lane) as floats times f
inline __m256 bytes_times(uint64_t bytes, float f) {
  const __m256i wide = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(bytes)));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(wide), _mm256_set1_ps(f));
}

// per-block values (one per lane) spread over the halves: blocks 0..3, then 4..7
inline void per_half(__m256 block_values, __m256 out[2]) {
  out[0] = _mm256_permutevar8x32_ps(block_values, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
  out[1] = _mm256_permutevar8x32_ps(block_values, _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7));
}

// Q4_K / Q5_K: the 12 scale bytes hold 6-bit scales sc[8] and mins m[8] (scale_min_k4): the
// low 6 bits of bytes 0..3 (sc 0..3) and 4..7 (m 0..3); sc 4..7 / m 4..7 take the low / high
// nibbles of bytes 8..11 and, as bits 4..5, the top two bits of bytes 0..3 / 4..7.
template <bool Q5>
inline void unpack_k45(const uint8_t* p, SuperBlock& sb) {
  const float d = half_at(p), dmin = half_at(p + 2);
  uint32_t a[3];
  std::memcpy(a, p + 4, 12);
  const uint32_t low6 = 0x3F3F3F3F, low4 = 0x0F0F0F0F, low2 = 0x03030303;
  const uint32_t sc_lo = a[0] & low6, m_lo = a[1] & low6;
  const uint32_t sc_hi = (a[2] & low4) | (((a[0] >> 6) & low2) << 4);
  const uint32_t m_hi = ((a[2] >> 4) & low4) | (((a[1] >> 6) & low2) << 4);
  per_half(bytes_times(sc_lo | static_cast<uint64_t>(sc_hi) << 32, d), sb.s);
  per_half(bytes_times(m_lo | static_cast<uint64_t>(m_hi) << 32, -dmin), sb.c);
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) sb.codes[j] = k45_codes(p, j, Q5);
}

// Q6_K: 128 B low nibbles | 64 B two high bits | 16 int8 scales (one per 16 inputs) | f16 d;
// w = d * sc * (q - 32)
inline void unpack_q6k(const uint8_t* p, SuperBlock& sb) {
  const float d = half_at(p + 208);
  const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 192));
  const __m256 dv = _mm256_set1_ps(d), offset = _mm256_set1_ps(-32.f);
  sb.s[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)), dv);
  sb.s[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))), dv);
  sb.c[0] = _mm256_mul_ps(sb.s[0], offset);
  sb.c[1] = _mm256_mul_ps(sb.s[1], offset);
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) sb.codes[j] = q6k_codes(p, j);
}

// Q5_0 / Q5_1 (22 / 24 B a block: f16 d | [f16 m] | u32 fifth bits | 16 B nibbles): block
// 0's codes, d and the min (-16 d for Q5_0's w = d * (q - 16); m for Q5_1's w = d * q + m)
template <bool Q51>
inline __m256i q5_block(const uint8_t* p, uint16_t& d, uint16_t& m) {
  uint32_t qh;
  std::memcpy(&qh, p + (Q51 ? 4 : 2), 4);
  std::memcpy(&d, p, 2);
  if constexpr (Q51) std::memcpy(&m, p + 2, 2);
  return q5_codes(p + (Q51 ? 8 : 6), qh);
}

// eight consecutive Q5_0 / Q5_1 blocks of `bytes` each from p, their scales converted together
template <bool Q51>
inline void unpack_q5x8(const uint8_t* p, int64_t bytes, SuperBlock& sb) {
  alignas(16) uint16_t d[8], m[8] = {};
  for (int j = 0; j < 8; ++j) sb.codes[j] = q5_block<Q51>(p + j * bytes, d[j], m[j]);
  const __m256 dv = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(d)));
  per_half(dv, sb.s);
  per_half(Q51 ? _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(m)))
               : _mm256_mul_ps(dv, _mm256_set1_ps(-16.f)),
           sb.c);
}

// lanes 0..3 take half 2t of the block, lanes 4..7 half 2t + 1 (t: the block within a vector)
struct Picks {
  __m256i at[4] = {_mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3),
                   _mm256_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5), _mm256_setr_epi32(6, 6, 6, 6, 7, 7, 7, 7)};
};

// One group of eight blocks (unpacked in sb) against rows r0..r0+MR of x, into their sums
template <int MR>
__attribute__((always_inline)) inline void group_rows(const SuperBlock& sb, const XRows& x, int64_t r0, int64_t K, int64_t g,
                       const Picks& pick, __m256 (&acc)[MR][2], __m256 (&mins)[MR]) {
  const int64_t nb = K / kBlock;
  for (int r = 0; r < MR; ++r) {
    const int64_t h0 = (r0 + r) * 2 * nb + 16 * g;
    const __m256 lane0 = _mm256_mul_ps(sb.s[0], _mm256_loadu_ps(x.dx.data() + h0));
    const __m256 lane1 = _mm256_mul_ps(sb.s[1], _mm256_loadu_ps(x.dx.data() + h0 + 8));
    mins[r] = _mm256_fmadd_ps(sb.c[0], _mm256_loadu_ps(x.xsum.data() + h0), mins[r]);
    mins[r] = _mm256_fmadd_ps(sb.c[1], _mm256_loadu_ps(x.xsum.data() + h0 + 8), mins[r]);
    const int8_t* xq = x.q.data() + (r0 + r) * K + 256 * g;
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const __m256i dot = dot4(_mm256_setzero_si256(), sb.codes[j], load32(xq + 32 * j));
      const __m256 scale = _mm256_permutevar8x32_ps(j < 4 ? lane0 : lane1, pick.at[j % 4]);
      acc[r][j & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[r][j & 1]);
    }
  }
}

// rows t..t+MR of the sums of row_dot_many, as group_rows' arrays
template <int MR>
inline void group_rows_at(const SuperBlock& sb, const XRows& x, int64_t r0, int64_t K, int64_t g,
                          const Picks& pick, __m256 (*acc)[2], __m256* mins) {
  group_rows<MR>(sb, x, r0, K, g, pick, *reinterpret_cast<__m256(*)[MR][2]>(acc),
                 *reinterpret_cast<__m256(*)[MR]>(mins));
}

template <WFormat F>
__attribute__((always_inline)) inline void unpack_group(const uint8_t* row, int64_t g, int64_t bytes,
                                                        SuperBlock& sb) {
  constexpr bool q5 = F == WFormat::Q5_0 || F == WFormat::Q5_1;
  if constexpr (q5) unpack_q5x8<F == WFormat::Q5_1>(row + 8 * g * bytes, bytes, sb);
  else if constexpr (F == WFormat::Q6_K) unpack_q6k(row + g * bytes, sb);
  else unpack_k45<F == WFormat::Q5_K>(row + g * bytes, sb);
}

// A Q5 row's last nb % 8 blocks, one by one, against rows r0..r0+M of x; then each row's sum
template <WFormat F>
inline void finish_rows(const XRows& x, int64_t r0, int64_t M, int64_t K, const uint8_t* row,
                        __m256 (*acc)[2], const __m256* mins, float* y, int64_t ldy, bool accumulate) {
  constexpr bool q5 = F == WFormat::Q5_0 || F == WFormat::Q5_1, q51 = F == WFormat::Q5_1;
  const int64_t bytes = block_bytes(F);
  const int64_t nb = K / kBlock, groups = nb / 8;
  float tail_mins[kPassRows] = {};
  if constexpr (q5) {
    for (int64_t b = 8 * groups; b < nb; ++b) {
      uint16_t dbits, mbits = 0;
      const __m256i codes = q5_block<q51>(row + b * bytes, dbits, mbits);
      const float d = static_cast<float>(c10::Half(dbits, c10::Half::from_bits()));
      const float c = q51 ? static_cast<float>(c10::Half(mbits, c10::Half::from_bits())) : -16.f * d;
      for (int64_t r = 0; r < M; ++r) {
        const int64_t h = (r0 + r) * 2 * nb + 2 * b;
        const __m256i dot = dot4(_mm256_setzero_si256(), codes, load32(x.q.data() + (r0 + r) * K + 32 * b));
        acc[r][b & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * x.dx[h]), acc[r][b & 1]);
        tail_mins[r] += c * x.xsum[h] + c * x.xsum[h + 1];
      }
    }
  }
  for (int64_t r = 0; r < M; ++r) {
    const float out = hsum8((v8)acc[r][0] + (v8)acc[r][1]) + hsum8((v8)mins[r]) + tail_mins[r];
    float& dst = y[r * ldy];
    dst = accumulate ? dst + out : out;
  }
}

// A row of W in format F against rows r0..r0+MR of x, their sums in registers: eight blocks at
// a time (a K-quant super-block, or eight Q5 blocks), then a Q5 row's last nb % 8 blocks.
template <int MR, WFormat F>
void row_dot(const XRows& x, int64_t r0, int64_t K, const uint8_t* row, float* y, int64_t ldy,
             bool accumulate) {
  const int64_t groups = K / kBlock / 8, bytes = block_bytes(F);  // (a call: not per group)
  const Picks pick;
  __m256 acc[MR][2], mins[MR];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = mins[r] = _mm256_setzero_ps();
  SuperBlock sb;
  for (int64_t g = 0; g < groups; ++g) {
    unpack_group<F>(row, g, bytes, sb);
    group_rows<MR>(sb, x, r0, K, g, pick, acc, mins);
  }
  finish_rows<F>(x, r0, MR, K, row, acc, mins, y, ldy, accumulate);
}

// The same for rows r0..r0+M of x, M up to kPassRows: each group of eight blocks unpacked
// once for all of them, met by four rows at a time (each row's steps as in row_dot)
template <WFormat F>
void row_dot_many(const XRows& x, int64_t r0, int64_t M, int64_t K, const uint8_t* row,
                  float* y, int64_t ldy, bool accumulate) {
  const int64_t groups = K / kBlock / 8, bytes = block_bytes(F);  // (a call: not per group)
  const Picks pick;
  __m256 acc[kPassRows][2], mins[kPassRows];
  for (int64_t r = 0; r < M; ++r) acc[r][0] = acc[r][1] = mins[r] = _mm256_setzero_ps();
  SuperBlock sb;
  for (int64_t g = 0; g < groups; ++g) {
    unpack_group<F>(row, g, bytes, sb);
    int64_t t = 0;
    for (; t + 4 <= M; t += 4) group_rows_at<4>(sb, x, r0 + t, K, g, pick, acc + t, mins + t);
    switch (M - t) {
      case 3: group_rows_at<3>(sb, x, r0 + t, K, g, pick, acc + t, mins + t); break;
      case 2: group_rows_at<2>(sb, x, r0 + t, K, g, pick, acc + t, mins + t); break;
      case 1: group_rows_at<1>(sb, x, r0 + t, K, g, pick, acc + t, mins + t); break;
      default: break;
    }
  }
  finish_rows<F>(x, r0, M, K, row, acc, mins, y, ldy, accumulate);
}

template <WFormat F>
void rows_dot(const XRows& x, int64_t r0, int64_t M, int64_t K, const uint8_t* row, float* y,
              int64_t ldy, bool accumulate) {
  switch (M) {
    case 1: return row_dot<1, F>(x, r0, K, row, y, ldy, accumulate);
    case 2: return row_dot<2, F>(x, r0, K, row, y, ldy, accumulate);
    case 3: return row_dot<3, F>(x, r0, K, row, y, ldy, accumulate);
    case 4: return row_dot<4, F>(x, r0, K, row, y, ldy, accumulate);
    default: return row_dot_many<F>(x, r0, M, K, row, y, ldy, accumulate);
  }
}

// A row of W against rows r0..r0+M of x (M up to kPassRows)
void format_rows_dot(const XRows& x, int64_t r0, int64_t M, const WeightView& w, int64_t row,
                     float* y, int64_t ldy, bool accumulate) {
  const uint8_t* p = static_cast<const uint8_t*>(w.qs) + row * w.row_bytes;
  switch (w.fmt) {
    case WFormat::Q5_0: return rows_dot<WFormat::Q5_0>(x, r0, M, w.k, p, y, ldy, accumulate);
    case WFormat::Q5_1: return rows_dot<WFormat::Q5_1>(x, r0, M, w.k, p, y, ldy, accumulate);
    case WFormat::Q4_K: return rows_dot<WFormat::Q4_K>(x, r0, M, w.k, p, y, ldy, accumulate);
    case WFormat::Q5_K: return rows_dot<WFormat::Q5_K>(x, r0, M, w.k, p, y, ldy, accumulate);
    case WFormat::Q6_K: return rows_dot<WFormat::Q6_K>(x, r0, M, w.k, p, y, ldy, accumulate);
    default: return;  // int8_few_ok admits no other format
  }
}

}  // namespace
#endif

bool int8_few_ok(const WeightView& w) {
#ifdef RS_AVX2
  return every_piece(w, [](WFormat f) {
    return f == WFormat::Q5_0 || f == WFormat::Q5_1 || f == WFormat::Q4_K || f == WFormat::Q5_K ||
           f == WFormat::Q6_K;
  });
#else
  (void)w;
  return false;
#endif
}

void gemm_int8_few(const float* x, int64_t M, const WeightView& w, float* y, bool accumulate) {
#ifdef RS_AVX2
  thread_local XRows rows;
  round_rows(x, M, w.k, rows);
  const XRows& xr = rows;
  at::parallel_for(0, w.n, 16, [&](int64_t begin, int64_t end) {
    for_rows(w, begin, end, [&](const WeightView& part, int64_t row, int64_t n) {
      for (int64_t r0 = 0; r0 < M; r0 += kPassRows)
        format_rows_dot(xr, r0, std::min(M - r0, kPassRows), part, row, y + r0 * w.n + n, w.n, accumulate);
    });
  });
#else
  (void)x, (void)M, (void)w, (void)y, (void)accumulate;
#endif
}

}  // namespace rs
