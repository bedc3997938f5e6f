// The batched integer path of qgemm (quant_gemm.cpp): y[M, N] (+)= x[M, K] @ W^T for 8 rows of
// x or more with W's codes as unsigned bytes and x rounded to int8, four-way byte dot
// products (VNNI's vpdpbusd; two instructions on plain AVX2; plain C++ elsewhere).
//
// x. Each block of 32 inputs of each row is rounded to int8 with its own scale
// (dx = max|x| / 127), and laid out with a vector's 8 int32 lanes over 8 rows of x: lane l of
// the vector for (block b, group g) holds inputs 4g..4g+3 of row l. Per block and half-block
// (16 inputs) the exact sum of the row's int8 codes, times dx, is kept too.
// W. A tile of rows of W is unpacked once into one byte per input (code 0..255), a scale per
// half-block and a min per half-block: w = scale * code + min. Q8_0's int8 q is code q + 128
// with min -128 d; Q5_0's q - 16 is code q with min -16 d; Q6_K's (q - 32) * sc has a scale
// per 16 inputs, hence the halves; Q4_K/Q5_K/Q4_1/Q5_1 have real mins.
// Dot. For each block, each group's 4 code bytes are broadcast and meet the 8 rows' 4 int8
// inputs (8 int32 sums per instruction, no horizontal sums), then
//   y += scale * dx * int_sum + min * dx * code_sum(x)
// per block (or half-block), in float. Per weight, that is M/8 byte dot products plus one
// unpack, against M/8 float FMAs and a dequantization on the float lanes path.
//
// Rounding x to int8 is what llama.cpp does for these formats; it moves a matmul's output by
// up to ~1% of its scale where one input is an outlier 10-20x the others (that input's block
// keeps 7 bits), so this path serves batches (decode of several sequences) only, and the
// single-sequence path keeps int16 (quant_gemm.cpp).
#include <algorithm>

#include "kernels.h"

namespace rs {
namespace {

constexpr int64_t kTileRows = 4;  // rows of W per register tile
constexpr int64_t kLanes = 8;     // rows of x per vector

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// x rounded to int8 in the lane layout (see the top of the file); rows M..Mp are zero
struct XLanes {
  std::vector<int8_t> q;   // [Mp/8][nb][8 groups][8 rows][4]
  std::vector<float> d;    // [Mp/8][nb][8 rows]
  std::vector<float> s;    // [Mp/8][nb][3][8 rows]: dx * code sums of inputs 0..15, 16..31, all
  std::vector<int32_t> n;  // the same sums of codes, negated, without dx
};

void quantize_lanes(const float* x, int64_t M, int64_t K, XLanes& out) {
  const int64_t nb = K / kBlock, groups = (M + kLanes - 1) / kLanes;
  out.q.assign(groups * nb * kBlock * kLanes, 0);
  out.d.assign(groups * nb * kLanes, 0.f);
  out.s.assign(groups * nb * 3 * kLanes, 0.f);
  out.n.assign(groups * nb * 3 * kLanes, 0);
  for (int64_t r = 0; r < M; ++r) {
    const int64_t v = r / kLanes, l = r % kLanes;
    for (int64_t b = 0; b < nb; ++b) {
      const float* p = x + r * K + b * kBlock;
      alignas(32) int8_t codes[kBlock];
      int sums[2];
      const float d = round_block_int8(p, codes, sums);
      const int64_t vb = v * nb + b;
      int8_t* q = out.q.data() + vb * kBlock * kLanes + l * 4;
      for (int g = 0; g < 8; ++g) std::memcpy(q + g * kBlock, codes + 4 * g, 4);
      out.d[vb * kLanes + l] = d;
      float* s = out.s.data() + vb * 3 * kLanes + l;
      int32_t* n = out.n.data() + vb * 3 * kLanes + l;
      const int total = sums[0] + sums[1];
      s[0] = d * sums[0], s[kLanes] = d * sums[1], s[2 * kLanes] = d * total;
      n[0] = -sums[0], n[kLanes] = -sums[1], n[2 * kLanes] = -total;
    }
  }
}

// --- W's rows as bytes ------------------------------------------------------------------

inline void set_block(float* s, float* c, int64_t b, float scale, float min) {
  s[2 * b] = s[2 * b + 1] = scale;
  c[2 * b] = c[2 * b + 1] = min;
}

// Row `row` of one piece (not a Stack) into codes [K], scales and mins [2 * K / 32]; returns
// the offset o of w = scale * (code - o) + min (0, 16, 32 or 128)
int unpack_row(const WeightView& w, int64_t row, uint8_t* q, float* s, float* c) {
  const int64_t K = w.k, nb = K / kBlock;
  const uint8_t* p = static_cast<const uint8_t*>(w.qs) + row * w.row_bytes;
  switch (w.fmt) {
    case WFormat::Q8_0: {
      const uint8_t* src = static_cast<const uint8_t*>(w.qs) + row * K;
#ifdef RS_AVX2
      for (int64_t k = 0; k < K; k += kBlock)
        store32(q + k, _mm256_xor_si256(load32(src + k), _mm256_set1_epi8(-128)));
#else
      for (int64_t k = 0; k < K; ++k) q[k] = src[k] ^ 0x80;  // int8 q + 128
#endif
      for (int64_t b = 0; b < nb; ++b) {
        const float d = w.d[row * nb + b];
        set_block(s, c, b, d, 0.f);
      }
      return 128;
    }
    case WFormat::Q4_1: {
      const uint8_t* src = static_cast<const uint8_t*>(w.qs) + row * (K / 2);
      for (int64_t b = 0; b < nb; ++b) {
#ifdef RS_AVX2
        store32(q + 32 * b, nibbles(src + 16 * b));
#else
        for (int i = 0; i < 16; ++i) {
          q[32 * b + i] = src[16 * b + i] & 0xF;
          q[32 * b + 16 + i] = src[16 * b + i] >> 4;
        }
#endif
        set_block(s, c, b, w.d[row * nb + b], w.m[row * nb + b]);
      }
      break;
    }
    case WFormat::Q5_0:
    case WFormat::Q5_1: {
      const bool q51 = w.fmt == WFormat::Q5_1;
      const int64_t bytes = q51 ? 24 : 22;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = p + b * bytes;
        uint32_t qh;
        std::memcpy(&qh, blk + (q51 ? 4 : 2), 4);
        const uint8_t* qs = blk + (q51 ? 8 : 6);
#ifdef RS_AVX2
        store32(q + 32 * b, q5_codes(qs, qh));
#else
        for (int i = 0; i < 16; ++i) {
          q[32 * b + i] = (qs[i] & 0xF) | (((qh >> i) & 1) << 4);
          q[32 * b + 16 + i] = (qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
        }
#endif
        const float d = half_at(blk);
        set_block(s, c, b, d, q51 ? half_at(blk + 2) : 0.f);
      }
      return q51 ? 0 : 16;
    }
    case WFormat::Q4_K:
    case WFormat::Q5_K: {
      const bool q5 = w.fmt == WFormat::Q5_K;
      for (int64_t sb = 0; sb < K / 256; ++sb) {
        const uint8_t* blk = p + sb * (q5 ? 176 : 144);
        const float d = half_at(blk), dmin = half_at(blk + 2);
        const uint8_t* qh = blk + 16;
        const uint8_t* qs = blk + (q5 ? 48 : 16);
        for (int j = 0; j < 8; ++j) {
          int sc, m;
          scale_min_k4(blk + 4, j, sc, m);
          uint8_t* out = q + 256 * sb + 32 * j;
#ifdef RS_AVX2
          store32(out, k45_codes(blk, j, q5));
#else
          for (int i = 0; i < 32; ++i) {
            out[i] = (qs[32 * (j / 2) + i] >> (4 * (j & 1))) & 0xF;
            if (q5) out[i] |= ((qh[i] >> j) & 1) << 4;
          }
#endif
          set_block(s, c, 8 * sb + j, d * sc, -dmin * m);
        }
      }
      break;
    }
    case WFormat::Q6_K: {
      for (int64_t sb = 0; sb < K / 256; ++sb) {
        const uint8_t *ql = p + sb * 210, *qh = ql + 128;
        const int8_t* sc = reinterpret_cast<const int8_t*>(ql + 192);
        const float d = half_at(ql + 208);
#ifdef RS_AVX2
        for (int blk = 0; blk < 8; ++blk) store32(q + 256 * sb + 32 * blk, q6k_codes(ql, blk));
#else
        for (int e = 0; e < 256; ++e) {
          const int h = e >> 7, r = e & 127;
          const int lo = (ql[64 * h + (r & 63)] >> (4 * (r >> 6))) & 0xF;
          const int hi = (qh[32 * h + (r & 31)] >> (2 * (r >> 5))) & 3;
          q[256 * sb + e] = static_cast<uint8_t>(lo | (hi << 4));
        }
#endif
        for (int h = 0; h < 16; ++h) {  // (q - 32) * d * sc: per 16 inputs
          s[16 * sb + h] = d * sc[h];
          c[16 * sb + h] = 0.f;
        }
      }
      return 32;
    }
    default: break;
  }
  return 0;
}

// Unpacked rows of a tile of W: codes [rows][K], scales and mins [rows][2 nb], the shift
// that makes each row's offset (1 << shift, or 32: none); halves: a scale per 16 inputs
// (some row is Q6_K); mins: some row has real mins.
struct RowsCodes {
  std::vector<uint8_t> q;
  std::vector<float> s, c;
  int shift[kTileRows] = {};
  bool halves = false, mins = false;
};

// --- the dot products -------------------------------------------------------------------
#ifdef RS_AVX2

// One block (or half-block: groups G0..G1 of 4 inputs) of W rows n0..n0+NR against x's lane
// groups v0..v0+MV, into f. The int32 sums start at -offset * sum(x codes), so that the
// unsigned codes give the signed ones' products; Mins: some row has a real min.
template <int NR, int MV, int G0, int G1, bool Mins>
inline void block_part(const XLanes& x, int64_t v0, int64_t b, const uint8_t* q, const float* s,
                       const float* c, const __m256i shift[NR], int64_t K, __m256 f[NR][MV]) {
  constexpr int which = G1 - G0 == 8 ? 2 : G0 / 4;  // x's code sums: inputs 0..15, 16..31, all
  const int64_t nb = K / kBlock, e = 2 * b + (G0 >= 4 ? 1 : 0);
  const int8_t* xq = x.q.data();
  __m256i acc[NR][MV];
  for (int v = 0; v < MV; ++v) {
    const __m256i neg = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
        x.n.data() + (((v0 + v) * nb + b) * 3 + which) * kLanes));
    for (int j = 0; j < NR; ++j) acc[j][v] = _mm256_sllv_epi32(neg, shift[j]);
  }
#pragma GCC unroll 8
  for (int g = G0; g < G1; ++g) {
    __m256i xv[MV];
    for (int v = 0; v < MV; ++v)
      xv[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + (((v0 + v) * nb + b) * 8 + g) * kBlock));
    for (int j = 0; j < NR; ++j) {
      const __m256i wb = _mm256_set1_epi32(static_cast<int>(load_u32(q + j * K + b * kBlock + 4 * g)));
      for (int v = 0; v < MV; ++v) acc[j][v] = dot4(acc[j][v], wb, xv[v]);
    }
  }
  for (int v = 0; v < MV; ++v) {
    const int64_t vb = (v0 + v) * nb + b;
    const __m256 dx = _mm256_loadu_ps(x.d.data() + vb * kLanes);
    for (int j = 0; j < NR; ++j) {
      const __m256 scale = _mm256_mul_ps(_mm256_set1_ps(s[j * 2 * nb + e]), dx);
      f[j][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[j][v]), scale, f[j][v]);
    }
    if constexpr (Mins) {
      const __m256 xs = _mm256_loadu_ps(x.s.data() + (vb * 3 + which) * kLanes);
      for (int j = 0; j < NR; ++j) f[j][v] = _mm256_fmadd_ps(_mm256_set1_ps(c[j * 2 * nb + e]), xs, f[j][v]);
    }
  }
}

// W rows n0..n0+NR (unpacked: q [NR][K], s and c [NR][2 nb], offsets) against x's lane groups
// v0..v0+MV; Halves: a scale per 16 inputs (some row is Q6_K), else per block.
template <int NR, int MV, bool Halves, bool Mins>
void tile(const XLanes& x, int64_t v0, const RowsCodes& w, int64_t K, float* y, int64_t N,
          int64_t n0, int64_t M, bool accumulate) {
  const int64_t nb = K / kBlock;
  __m256 f[NR][MV];
  __m256i shift[NR];
  for (int j = 0; j < NR; ++j) {
    shift[j] = _mm256_set1_epi32(w.shift[j]);
    for (int v = 0; v < MV; ++v) f[j][v] = _mm256_setzero_ps();
  }
  const uint8_t* q = w.q.data();
  const float *s = w.s.data(), *c = w.c.data();
  for (int64_t b = 0; b < nb; ++b) {
    if constexpr (Halves) {
      block_part<NR, MV, 0, 4, Mins>(x, v0, b, q, s, c, shift, K, f);
      block_part<NR, MV, 4, 8, Mins>(x, v0, b, q, s, c, shift, K, f);
    } else {
      block_part<NR, MV, 0, 8, Mins>(x, v0, b, q, s, c, shift, K, f);
    }
  }
  for (int v = 0; v < MV; ++v) {
    const int64_t rows = std::min<int64_t>(kLanes, M - (v0 + v) * kLanes);
    for (int j = 0; j < NR; ++j) {
      float lanes[kLanes];
      _mm256_storeu_ps(lanes, f[j][v]);
      for (int64_t l = 0; l < rows; ++l) {
        float& out = y[((v0 + v) * kLanes + l) * N + n0 + j];
        out = accumulate ? out + lanes[l] : lanes[l];
      }
    }
  }
}

template <int NR, bool Halves, bool Mins>
void tile_all(const XLanes& x, int64_t groups, const RowsCodes& w, int64_t K, float* y,
              int64_t N, int64_t n0, int64_t M, bool accumulate) {
  int64_t v = 0;
  for (; v + 2 <= groups; v += 2) tile<NR, 2, Halves, Mins>(x, v, w, K, y, N, n0, M, accumulate);
  if (v < groups) tile<NR, 1, Halves, Mins>(x, v, w, K, y, N, n0, M, accumulate);
}

template <bool Halves, bool Mins>
void tiles(int64_t nr, const XLanes& x, int64_t groups, const RowsCodes& w, int64_t K, float* y,
           int64_t N, int64_t n0, int64_t M, bool acc) {
  switch (nr) {
    case 4: return tile_all<4, Halves, Mins>(x, groups, w, K, y, N, n0, M, acc);
    case 3: return tile_all<3, Halves, Mins>(x, groups, w, K, y, N, n0, M, acc);
    case 2: return tile_all<2, Halves, Mins>(x, groups, w, K, y, N, n0, M, acc);
    default: return tile_all<1, Halves, Mins>(x, groups, w, K, y, N, n0, M, acc);
  }
}

void tiles_any(int64_t nr, const XLanes& x, int64_t groups, const RowsCodes& w, int64_t K,
               float* y, int64_t N, int64_t n0, int64_t M, bool acc) {
  if (w.halves) {
    if (w.mins) return tiles<true, true>(nr, x, groups, w, K, y, N, n0, M, acc);
    return tiles<true, false>(nr, x, groups, w, K, y, N, n0, M, acc);
  }
  if (w.mins) return tiles<false, true>(nr, x, groups, w, K, y, N, n0, M, acc);
  tiles<false, false>(nr, x, groups, w, K, y, N, n0, M, acc);
}
#else
// plain C++: the same integers, in the same per-block float steps
void tiles_any(int64_t nr, const XLanes& x, int64_t groups, const RowsCodes& w, int64_t K,
               float* y, int64_t N, int64_t n0, int64_t M, bool accumulate) {
  const int64_t nb = K / kBlock;
  for (int64_t r = 0; r < M; ++r) {
    const int64_t v = r / kLanes, l = r % kLanes;
    for (int64_t j = 0; j < nr; ++j) {
      float total = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t vb = v * nb + b;
        for (int h = 0; h < 2; ++h) {
          const int32_t neg = x.n[(vb * 3 + h) * kLanes + l];
          int32_t sum = w.shift[j] < 32 ? neg * (1 << w.shift[j]) : 0;
          for (int g = 4 * h; g < 4 * h + 4; ++g)
            for (int i = 0; i < 4; ++i)
              sum += w.q[j * K + b * kBlock + 4 * g + i] * x.q[(vb * 8 + g) * kBlock + 4 * l + i];
          total += w.s[j * 2 * nb + 2 * b + h] * x.d[vb * kLanes + l] * sum +
                   w.c[j * 2 * nb + 2 * b + h] * x.s[(vb * 3 + h) * kLanes + l];
        }
      }
      float& out = y[r * N + n0 + j];
      out = accumulate ? out + total : total;
    }
  }
  (void)groups;
}
#endif

// Asks for the bytes of W's rows [n0, n1) (codes and scales), so that they arrive while the
// tile before them computes: unpacking a tile would otherwise wait on memory for each row.
void prefetch_rows(const WeightView& w, int64_t n0, int64_t n1) {
  auto ask = [](const void* p, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(static_cast<const char*>(p) + off);
  };
  for_rows(w, n0, n1, [&](const WeightView& part, int64_t row, int64_t) {
    const uint8_t* qs = static_cast<const uint8_t*>(part.qs);
    const int64_t nb = part.k / kBlock;
    if (part.fmt == WFormat::Q8_0 || part.fmt == WFormat::Q4_1) {
      const int64_t bytes = part.fmt == WFormat::Q8_0 ? part.k : part.k / 2;
      ask(qs + row * bytes, bytes);
      ask(part.d + row * nb, nb * 4);
      if (part.m != nullptr) ask(part.m + row * nb, nb * 4);
    } else {
      ask(qs + row * part.row_bytes, part.row_bytes);
    }
  });
}

}  // namespace

bool int8_lanes_ok(const WeightView& w) {
  if (w.k % kBlock) return false;
  return every_piece(w, [](WFormat f) {
    switch (f) {
      case WFormat::Q8_0:
#if defined(RS_AVX2) && !(defined(__AVX512VNNI__) && defined(__AVX512VL__)) && !defined(__AVXVNNI__)
        return false;  // codes up to 255: int16 pair sums could saturate without VNNI
#endif
      case WFormat::Q4_1:
      case WFormat::Q5_0:
      case WFormat::Q5_1:
      case WFormat::Q4_K:
      case WFormat::Q5_K:
      case WFormat::Q6_K: return true;
      default: return false;
    }
  });
}

void gemm_int8_lanes(const float* x, int64_t M, const WeightView& w, float* y, bool accumulate) {
  const int64_t N = w.n, K = w.k, nb = K / kBlock;
  const int64_t groups = (M + kLanes - 1) / kLanes, tiles_n = (N + kTileRows - 1) / kTileRows;
  thread_local XLanes xl;
  quantize_lanes(x, M, K, xl);
  const XLanes& xs = xl;
  at::parallel_for(0, tiles_n, 1, [&](int64_t begin, int64_t end) {
    RowsCodes rc;
    rc.q.resize(kTileRows * K);
    rc.s.resize(kTileRows * 2 * nb);
    rc.c.resize(kTileRows * 2 * nb);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kTileRows, nr = std::min(kTileRows, N - n0);
      prefetch_rows(w, std::min(N, n0 + kTileRows), std::min(N, n0 + 2 * kTileRows));
      rc.halves = rc.mins = false;
      for_rows(w, n0, n0 + nr, [&](const WeightView& part, int64_t row, int64_t n) {
        const int64_t j = n - n0;
        const int off = unpack_row(part, row, rc.q.data() + j * K, rc.s.data() + j * 2 * nb,
                                   rc.c.data() + j * 2 * nb);
        rc.shift[j] = off == 0 ? 32 : __builtin_ctz(static_cast<unsigned>(off));
        rc.halves |= part.fmt == WFormat::Q6_K;
        rc.mins |= off == 0;
      });
      tiles_any(nr, xs, groups, rc, K, y, N, n0, M, accumulate);
    }
  });
}

}  // namespace rs
