// The batched float path of qgemm (quant_gemm.cpp): y[M, N] (+)= x[M, K] @ W^T for 8 rows of x
// or more, the decode steps of many sequences at once.
//
// x is transposed once (xt [K, Mp], Mp = M rounded up to 8, zero-padded) so that a vector's
// lanes run over 8 rows of x; W's rows are dequantized 12 at a time into a small buffer, as
// they lie (no transpose of W), and each weight is broadcast and multiplied into 8 or 16 rows
// of x at once. Every register tile keeps 12 accumulators, no horizontal sums. Per weight the
// work is M/8 FMAs plus one dequantization, so from 8 rows on this beats the integer dot
// products of the few-row path (which pay a convert, a scale and an FMA per block and row):
// 1.1-1.7x on Q4_1 at 16-32 rows on Zen 3. The result equals x @ dequantize(W)^T up to float
// summation order.
#include <algorithm>

#include "kernels.h"

namespace rs {
namespace {

// acc[j][v] += W[n0 + j, k] * xt[k, i0 + 8v .. i0 + 8v + 8] over all k, then out to y.
template <int NR, int MV>
inline void lane_tile(const float* xt, int64_t Mp, int64_t i0, const float* wb, int64_t ldw,
                      int64_t K, float* y, int64_t N, int64_t n0, int64_t M, bool accumulate) {
  v8 acc[NR][MV] = {};
  const float* xp = xt + i0;
  for (int64_t k = 0; k < K; ++k, xp += Mp) {
    v8 xv[MV];
    for (int v = 0; v < MV; ++v) xv[v] = load8(xp + 8 * v);
    for (int j = 0; j < NR; ++j) {
      const v8 wv = splat8(wb[j * ldw + k]);
      for (int v = 0; v < MV; ++v) acc[j][v] += wv * xv[v];
    }
  }
  const int64_t rows = std::min<int64_t>(8 * MV, M - i0);
  for (int j = 0; j < NR; ++j) {
    float lanes[8 * MV];
    for (int v = 0; v < MV; ++v) store8(lanes + 8 * v, acc[j][v]);
    for (int64_t l = 0; l < rows; ++l) {
      float& out = y[(i0 + l) * N + n0 + j];
      out = accumulate ? out + lanes[l] : lanes[l];
    }
  }
}

// Rows of x 16 at a time against 6 rows of W (12 accumulators), the last 8 or fewer against
// all 12 rows of the tile (12 accumulators again: enough independent FMAs in flight).
template <int NR>
void lane_tiles(const float* xt, int64_t Mp, const float* wb, int64_t ldw, int64_t K, float* y,
                int64_t N, int64_t n0, int64_t M, bool accumulate) {
  constexpr int H = NR / 2, R = NR - H;  // the tile's two halves for 16-row blocks
  int64_t i0 = 0;
  for (; i0 + 16 <= Mp; i0 += 16) {
    lane_tile<R, 2>(xt, Mp, i0, wb, ldw, K, y, N, n0, M, accumulate);
    if constexpr (H > 0)
      lane_tile<H, 2>(xt, Mp, i0, wb + R * ldw, ldw, K, y, N, n0 + R, M, accumulate);
  }
  if (i0 < Mp) lane_tile<NR, 1>(xt, Mp, i0, wb, ldw, K, y, N, n0, M, accumulate);
}

}  // namespace

void gemm_lanes(const float* x, int64_t M, const WeightView& w, float* y, bool accumulate) {
  constexpr int64_t NR = 12;
  const int64_t N = w.n, K = w.k, Mp = (M + 7) / 8 * 8, tiles = (N + NR - 1) / NR;
  std::vector<float> xt(K * Mp, 0.f);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t k = 0; k < K; ++k) xt[k * Mp + i] = x[i * K + k];
  at::parallel_for(0, tiles, 2, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(w.fmt == WFormat::F32 ? 0 : NR * K);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * NR, nr = std::min(NR, N - n0);
      const float* wb = weight_rows(w, n0, nr, buf.data());
      const float* xp = xt.data();
      switch (nr) {  // one instantiation per possible tile height
        case 12: lane_tiles<12>(xp, Mp, wb, K, K, y, N, n0, M, accumulate); break;
        case 11: lane_tiles<11>(xp, Mp, wb, K, K, y, N, n0, M, accumulate); break;
        case 10: lane_tiles<10>(xp, Mp, wb, K, K, y, N, n0, M, accumulate); break;
        case 9: lane_tiles<9>(xp, Mp, wb, K, K, y, N, n0, M, accumulate); break;
        case 8: lane_tiles<8>(xp, Mp, wb, K, K, y, N, n0, M, accumulate); break;
        case 7: lane_tiles<7>(xp, Mp, wb, K, K, y, N, n0, M, accumulate); break;
        case 6: lane_tiles<6>(xp, Mp, wb, K, K, y, N, n0, M, accumulate); break;
        case 5: lane_tiles<5>(xp, Mp, wb, K, K, y, N, n0, M, accumulate); break;
        case 4: lane_tiles<4>(xp, Mp, wb, K, K, y, N, n0, M, accumulate); break;
        case 3: lane_tiles<3>(xp, Mp, wb, K, K, y, N, n0, M, accumulate); break;
        case 2: lane_tiles<2>(xp, Mp, wb, K, K, y, N, n0, M, accumulate); break;
        default: lane_tiles<1>(xp, Mp, wb, K, K, y, N, n0, M, accumulate); break;
      }
    }
  });
}

}  // namespace rs
