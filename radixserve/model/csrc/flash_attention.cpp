// Attention of query rows over KV rows in the paged pool, flash-attention style.
//
// Every row r of a step (a decode token, a prompt chunk's token, a sparse prefill's row)
// attends to the keys [lo[r], hi[r]) of its context (a run of pool slots). One call takes all
// rows of a layer: prompt chunks, decode tokens and window layers are the same problem with
// other ranges.
//
// Work is cut into tasks (a block of rows of one context) x (a KV head) x (a range of keys).
// A task packs its queries once (the G query heads of its KV head, times scale * log2(e)),
// then walks its keys in tiles of BK: each tile's K rows are read from the pool once for the
// whole block, decoded to float (bfloat16, float16) and transposed into K^T [D][BK] (int8
// keys: kept as codes for integer dot products, flash_i8.cpp), and its V rows decoded into
// [BK][D] (float32 V rows are read in place); micro tiles of MR query vectors compute scores,
// an online softmax (running max and sum per query vector, the output rescaled when the max
// grows), and the weighted V sum. Scratch is O(rows x head_dim), never O(context^2), and the
// pool is read in place: no gathered or decoded copy of the context.
//
// Parallelism: blocks are sized so there are at least two tasks per thread; when there are
// still too few (decoding one sequence: one row, few KV heads) each block's key range is
// split into parts computed apart (their own max and sum) and merged after. Threads take
// tasks from a shared counter, largest first.
#include <atomic>

#include "flash.h"

namespace rs {
namespace {

#if defined(__AVX512F__)
constexpr int W = 16;
constexpr int QK_NV = 4;  // vectors of keys per micro tile of scores
constexpr int PV_NV = 4;  // vectors of head dims per micro tile of outputs
#else
constexpr int W = 8;
constexpr int QK_NV = 2;
constexpr int PV_NV = 2;
#endif
constexpr int MR = 6;   // query vectors per micro tile
using flash::BK;
constexpr float kLog2e = 1.4426950408889634f;
constexpr int64_t kMinSplitKeys = 512;  // a part of a split key range has at least this many

typedef float vec __attribute__((vector_size(W * 4)));
typedef int32_t veci __attribute__((vector_size(W * 4)));
typedef uint16_t vech __attribute__((vector_size(W * 2)));
typedef uint32_t vecu __attribute__((vector_size(W * 4)));

inline vec loadv(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void storev(float* p, vec v) { std::memcpy(p, &v, sizeof(v)); }
inline vec splat(float x) { return vec{} + x; }

inline float hmax(vec v) {
  float m = v[0];
  for (int i = 1; i < W; ++i) m = std::max(m, v[i]);
  return m;
}
inline float hadd(vec v) {
  float s = 0.f;
  for (int i = 0; i < W; ++i) s += v[i];
  return s;
}

// 2^x, ~1 ulp for x in [-126, 128]; 0 below -126 (so 2^-inf = 0)
inline vec exp2v(vec x) {
  const vec lo = splat(-126.f);
  const vec xc = x < lo ? lo : x;
  vec n = __builtin_convertvector(__builtin_convertvector(xc + (xc < splat(0.f) ? splat(-0.5f) : splat(0.5f)), veci), vec);
  const vec f = xc - n;  // in [-0.5, 0.5]
  vec p = splat(1.535336188319500e-4f);
  p = p * f + splat(1.339887440266574e-3f);
  p = p * f + splat(9.618437357674640e-3f);
  p = p * f + splat(5.550332471162809e-2f);
  p = p * f + splat(2.402264791363012e-1f);
  p = p * f + splat(6.931472028550421e-1f);
  p = p * f + splat(1.f);
  veci bits = (__builtin_convertvector(n, veci) + 127) << 23;
  vec scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < lo ? splat(0.f) : p * scale;
}

// n float16 values at p as floats into out (n a multiple of 4)
inline void halves_to_floats(const uint8_t* p, int64_t n, float* out) {
#if defined(RS_AVX2)  // F16C
  for (int64_t i = 0; i < n; i += 4)
    _mm_storeu_ps(out + i, _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 2 * i))));
#else
  for (int64_t i = 0; i < n; ++i) out[i] = half_at(p + 2 * i);
#endif
}

// W int8 codes at p as floats
inline vec codes_to_floats(const uint8_t* p) {
  vec out;
#if defined(__AVX512F__)
  const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  std::memcpy(&out, &f, sizeof(out));
#elif defined(RS_AVX2)
  const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  std::memcpy(&out, &f, sizeof(out));
#else
  for (int i = 0; i < W; ++i) out[i] = static_cast<int8_t>(p[i]);
#endif
  return out;
}

// One KV row decoded to D floats at out (D a multiple of W).
template <KVType T>
inline void decode_row(const uint8_t* row, int64_t D, int64_t group, float* out) {
  const int64_t C = D / W;
  if constexpr (T == KVType::F32) {
    std::memcpy(out, row, D * sizeof(float));
  } else if constexpr (T == KVType::BF16) {
    for (int64_t c = 0; c < C; ++c)
      storev(out + c * W, widen_bf16<vec, vech, vecu>(reinterpret_cast<const c10::BFloat16*>(row) + c * W));
  } else if constexpr (T == KVType::F16) {
    halves_to_floats(row, D, out);
  } else {  // I8: codes, then one float16 scale per group (a multiple of 16 >= W channels)
    float scales[kAttnMaxDim / 16 + 4];
    const int64_t n = D / group;
    if (n % 4 == 0)
      halves_to_floats(row + D, n, scales);
    else
      for (int64_t g = 0; g < n; ++g) scales[g] = half_at(row + D + 2 * g);
    for (int64_t g = 0, i = 0; g < n; ++g)
      for (const int64_t end = i + group; i < end; i += W) storev(out + i, codes_to_floats(row + i) * scales[g]);
  }
}

// The W x W block of vectors r transposed in place (r[i][j] <-> r[j][i]): log2(W) stages,
// each swapping the off-diagonal sub-blocks of size b with two-input shuffles.
template <int B>
inline void transpose_stage(vec* r) {
  veci m1, m2;
  for (int l = 0; l < W; ++l) {
    m1[l] = (l & B) ? W + l - B : l;
    m2[l] = (l & B) ? W + l : l + B;
  }
  for (int i = 0; i < W; ++i) {
    if (i & B) continue;
    const vec a = r[i], c = r[i + B];
    r[i] = __builtin_shuffle(a, c, m1);
    r[i + B] = __builtin_shuffle(a, c, m2);
  }
}
inline void transpose(vec* r) {
  if constexpr (W == 16) transpose_stage<8>(r);
  transpose_stage<4>(r);
  transpose_stage<2>(r);
  transpose_stage<1>(r);
}

alignas(64) constexpr float kZeroRow[kAttnMaxDim] = {};

struct Tile {
  float* kt;  // [D][BK]: K^T of the tile (float formats)
  float* vp;  // [BK][D]: V decoded (formats other than float32)
  const float** vrow;  // [BK]: each key's V row as floats (float32: the pool's row, in place)
  float* kp;  // [BK][D]: K decoded (bfloat16, float16)
  flash::KeysI8* ki8;  // I8: the keys' codes and scales for integer dot products
};

// The tile's keys [t, t + nk) of a context as the scores read them, and its V as floats;
// zero past nk
template <KVType T>
void pack_tile(const KVLayer& kv, int64_t head, const int64_t* ctx, int64_t t, int64_t nk,
               int64_t D, const Tile& tile) {
  const uint8_t* kbase = kv.k + head * kv.slots * kv.row_bytes;
  const uint8_t* vbase = kv.v + head * kv.slots * kv.row_bytes;
  const uint8_t* krows[BK];
  for (int64_t j = 0; j < BK; ++j) {
    krows[j] = j < nk ? kbase + ctx[t + j] * kv.row_bytes : nullptr;
    if (j >= nk) {
      tile.vrow[j] = kZeroRow;
      continue;
    }
    if (j + 4 < nk) __builtin_prefetch(vbase + ctx[t + j + 4] * kv.row_bytes);
    const uint8_t* vrow = vbase + ctx[t + j] * kv.row_bytes;
    if constexpr (T == KVType::F32) {
      tile.vrow[j] = reinterpret_cast<const float*>(vrow);
    } else {
      decode_row<T>(vrow, D, kv.group, tile.vp + j * D);
      tile.vrow[j] = tile.vp + j * D;
    }
  }
  if constexpr (T == KVType::I8) {
    flash::pack_keys_i8(krows, D, kv.group, *tile.ki8);
    return;
  }
  const float* rows[BK];
  for (int64_t j = 0; j < BK; ++j) {
    if constexpr (T == KVType::F32) {
      rows[j] = reinterpret_cast<const float*>(krows[j]);
    } else {
      rows[j] = krows[j] ? tile.kp + j * D : nullptr;
      if (krows[j]) decode_row<T>(krows[j], D, kv.group, tile.kp + j * D);
    }
  }
  for (int64_t j0 = 0; j0 < BK; j0 += W)
    for (int64_t c = 0; c < D / W; ++c) {
      vec r[W];
      for (int i = 0; i < W; ++i) r[i] = rows[j0 + i] ? loadv(rows[j0 + i] + c * W) : vec{};
      transpose(r);
      for (int i = 0; i < W; ++i) storev(tile.kt + (c * W + i) * BK + j0, r[i]);
    }
}

// s[i][j] = q_i . k_j for R query vectors (rows of qp, D apart) and the tile's BK keys
template <int R>
void scores(const float* qp, int64_t D, const float* kt, float* s) {
  for (int j0 = 0; j0 < BK; j0 += QK_NV * W) {
    vec acc[R][QK_NV] = {};
    for (int64_t d = 0; d < D; ++d) {
      vec kv[QK_NV];
#pragma GCC unroll 4
      for (int v = 0; v < QK_NV; ++v) kv[v] = loadv(kt + d * BK + j0 + v * W);
#pragma GCC unroll 6
      for (int i = 0; i < R; ++i) {
        const float q = qp[i * D + d];
#pragma GCC unroll 4
        for (int v = 0; v < QK_NV; ++v) acc[i][v] += q * kv[v];
      }
    }
    for (int i = 0; i < R; ++i)
      for (int v = 0; v < QK_NV; ++v) storev(s + i * BK + j0 + v * W, acc[i][v]);
  }
}

// o_i = o_i * alpha_i + sum_j p[i][j] v_j over dims [d0, d0 + NV * W), for R query vectors
template <int R, int NV>
void values_part(const float* p, const float* const* vrow, int64_t D, int64_t d0, const float* alpha, float* o) {
  vec acc[R][NV] = {};
  for (int j = 0; j < BK; ++j) {
    vec vv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) vv[v] = loadv(vrow[j] + d0 + v * W);
#pragma GCC unroll 6
    for (int i = 0; i < R; ++i) {
      const float pj = p[i * BK + j];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[i][v] += pj * vv[v];
    }
  }
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < NV; ++v) {
      float* out = o + i * D + d0 + v * W;
      storev(out, loadv(out) * alpha[i] + acc[i][v]);
    }
}

template <int R>
void values(const float* p, const float* const* vrow, int64_t D, const float* alpha, float* o) {
  int64_t d0 = 0;
  for (; d0 + PV_NV * W <= D; d0 += PV_NV * W) values_part<R, PV_NV>(p, vrow, D, d0, alpha, o);
  for (; d0 < D; d0 += W) values_part<R, 1>(p, vrow, D, d0, alpha, o);
}

// The softmax step of one query vector over a tile: s (BK scores, log2 units) becomes p;
// keys outside [a, b) get none. Updates the running max m and sum l; returns the factor the
// output so far is rescaled by.
inline float softmax_step(float* s, int64_t a, int64_t b, float& m, float& l) {
  if (b <= a) {
    std::fill(s, s + BK, 0.f);
    return 1.f;
  }
  if (a > 0 || b < BK) {
    std::fill(s, s + a, -INFINITY);
    std::fill(s + b, s + BK, -INFINITY);
  }
  vec mx = loadv(s);
  for (int j = W; j < BK; j += W) {
    const vec x = loadv(s + j);
    mx = x > mx ? x : mx;
  }
  const float m_new = std::max(m, hmax(mx));
  const float alpha = m == -INFINITY ? 0.f : exp2v(splat(m - m_new))[0];
  vec sum = {};
  const vec shift = splat(m_new);
  for (int j = 0; j < BK; j += W) {
    const vec e = exp2v(loadv(s + j) - shift);
    storev(s + j, e);
    sum += e;
  }
  l = l * alpha + hadd(sum);
  m = m_new;
  return alpha;
}

struct Task {
  int64_t seq, r0, r1, head, k0, k1;
  int64_t part;  // offset (floats) of its partial result in the parts buffer; -1: none, the
                 // task writes the output
  double cost;
};

struct Split {
  int64_t first, n;  // tasks [first, first + n) are the parts of one (block, head)
};

// Per-thread scratch, grown as needed.
struct Scratch {
  std::vector<float> qp, o, m, l, s, kt, vp, kp;
  flash::QueriesI8 qi8;
  flash::KeysI8 ki8;
};

// The softmax step and the weighted V sum of R query vectors whose scores s are computed
template <int R>
void finish(float* s, const int64_t* a, const int64_t* b, float* m, float* l, const float* const* vrow,
            int64_t D, float* o) {
  float alpha[MR];
  for (int i = 0; i < R; ++i) alpha[i] = softmax_step(s + i * BK, a[i], b[i], m[i], l[i]);
  values<R>(s, vrow, D, alpha, o);
}
using FinishFn = void (*)(float*, const int64_t*, const int64_t*, float*, float*, const float* const*, int64_t,
                          float*);
constexpr FinishFn kFinish[MR + 1] = {nullptr, finish<1>, finish<2>, finish<3>, finish<4>, finish<5>, finish<6>};
using ScoresFn = void (*)(const float*, int64_t, const float*, float*);
constexpr ScoresFn kScores[MR + 1] = {nullptr, scores<1>, scores<2>, scores<3>, scores<4>, scores<5>, scores<6>};

template <KVType T>
void run_task(const AttnRows& p, const KVLayer& kv, const Task& task, Scratch& sc, float* parts) {
  const int64_t D = p.dim, G = p.heads / p.kv_heads, M = (task.r1 - task.r0) * G;
  sc.qp.resize(M * D);
  sc.o.assign(M * D, 0.f);
  sc.m.assign(M, -INFINITY);
  sc.l.assign(M, 0.f);
  sc.s.resize(MR * BK);
  sc.kt.resize(D * BK);
  sc.vp.resize(BK * D);
  sc.kp.resize(BK * D);
  const float qscale = p.scale * kLog2e;
  for (int64_t r = task.r0; r < task.r1; ++r)
    for (int64_t g = 0; g < G; ++g) {
      const float* src = p.q + r * p.q_stride + (task.head * G + g) * D;
      float* dst = sc.qp.data() + ((r - task.r0) * G + g) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * qscale;
    }
  if constexpr (T == KVType::I8) flash::quantize_queries_i8(sc.qp.data(), M, D, kv.group, sc.qi8);
  const int64_t* ctx = p.ctx + p.ctx_start[task.seq];
  const float* vrow[BK];
  const Tile tile{sc.kt.data(), sc.vp.data(), vrow, sc.kp.data(), &sc.ki8};
  int64_t a[MR], b[MR];
  for (int64_t t = task.k0; t < task.k1; t += BK) {
    const int64_t nk = std::min<int64_t>(BK, task.k1 - t);
    bool packed = false;
    for (int64_t i0 = 0; i0 < M; i0 += MR) {
      const int R = static_cast<int>(std::min<int64_t>(MR, M - i0));
      bool any = false;
      for (int i = 0; i < R; ++i) {
        const int64_t r = task.r0 + (i0 + i) / G;
        a[i] = std::clamp<int64_t>(p.lo[r] - t, 0, nk);
        b[i] = std::clamp<int64_t>(std::min(p.hi[r], task.k1) - t, 0, nk);
        a[i] = std::max<int64_t>(a[i], task.k0 - t);
        any |= b[i] > a[i];
      }
      if (!any) continue;
      if (!packed) {
        pack_tile<T>(kv, task.head, ctx, t, nk, D, tile);
        packed = true;
      }
      if constexpr (T == KVType::I8)
        flash::scores_i8(sc.qi8, i0, R, D, kv.group, sc.ki8, sc.s.data());
      else
        kScores[R](sc.qp.data() + i0 * D, D, tile.kt, sc.s.data());
      kFinish[R](sc.s.data(), a, b, sc.m.data() + i0, sc.l.data() + i0, tile.vrow, D, sc.o.data() + i0 * D);
    }
  }
  if (task.part < 0) {
    for (int64_t i = 0; i < M; ++i) {
      const int64_t r = task.r0 + i / G, g = i % G;
      float* dst = p.out + r * p.out_stride + (task.head * G + g) * D;
      const float inv = sc.l[i] > 0.f ? 1.f / sc.l[i] : 0.f;
      for (int64_t d = 0; d < D; ++d) dst[d] = sc.o[i * D + d] * inv;
    }
    return;
  }
  // a part of a split range: unnormalised outputs, then each vector's max and sum
  float* dst = parts + task.part;
  std::copy(sc.o.begin(), sc.o.end(), dst);
  std::copy(sc.m.begin(), sc.m.end(), dst + M * D);
  std::copy(sc.l.begin(), sc.l.end(), dst + M * D + M);
}

// The n parts of one (block, head), the first one's task given, merged into the output
void merge_parts(const AttnRows& p, const Task& task, int64_t n, const float* parts) {
  const int64_t D = p.dim, G = p.heads / p.kv_heads, M = (task.r1 - task.r0) * G;
  const int64_t stride = M * (D + 2);
  const float* first = parts + task.part;
  for (int64_t i = 0; i < M; ++i) {
    float mx = -INFINITY;
    for (int64_t k = 0; k < n; ++k) mx = std::max(mx, first[k * stride + M * D + i]);
    const int64_t r = task.r0 + i / G, g = i % G;
    float* dst = p.out + r * p.out_stride + (task.head * G + g) * D;
    std::fill(dst, dst + D, 0.f);
    float total = 0.f;
    for (int64_t k = 0; k < n; ++k) {
      const float* part = first + k * stride;
      const float mk = part[M * D + i];
      if (mk == -INFINITY) continue;
      const float w = std::exp2(mk - mx);
      total += w * part[M * D + M + i];
      for (int64_t d = 0; d < D; ++d) dst[d] += w * part[i * D + d];
    }
    const float inv = total > 0.f ? 1.f / total : 0.f;
    for (int64_t d = 0; d < D; ++d) dst[d] *= inv;
  }
}

// The tasks of a call: blocks of rows of one context, each with every KV head, split along
// the keys when there are fewer than two per thread. Returns the floats the parts need.
int64_t plan(const AttnRows& p, int64_t threads, std::vector<Task>& tasks, std::vector<Split>& splits) {
  const int64_t G = p.heads / p.kv_heads;
  // a block's packed queries and outputs stay within ~256 KB each
  const int64_t most = std::max<int64_t>(1, (65536 / p.dim) / G);
  const int64_t spread = (p.rows * p.kv_heads + 2 * threads - 1) / (2 * threads);
  const int64_t rb = std::max(std::min(most, spread), std::min<int64_t>(most, 8));
  int64_t blocks = 0;
  for (int64_t s = 0; s < p.seqs; ++s) blocks += (p.seq_start[s + 1] - p.seq_start[s] + rb - 1) / rb;
  const int64_t pairs = std::max<int64_t>(1, blocks * p.kv_heads);
  const int64_t want = (2 * threads + pairs - 1) / pairs;
  int64_t floats = 0;
  for (int64_t s = 0; s < p.seqs; ++s)
    for (int64_t r0 = p.seq_start[s]; r0 < p.seq_start[s + 1]; r0 += rb) {
      const int64_t r1 = std::min(r0 + rb, p.seq_start[s + 1]);
      int64_t k0 = INT64_MAX, k1 = 0;
      for (int64_t r = r0; r < r1; ++r) {
        if (p.hi[r] <= p.lo[r]) continue;
        k0 = std::min(k0, p.lo[r]);
        k1 = std::max(k1, p.hi[r]);
      }
      if (k1 == 0) k0 = 0;
      const int64_t keys = k1 - k0, M = (r1 - r0) * G;
      const int64_t n = std::max<int64_t>(1, std::min(want, keys / kMinSplitKeys));
      const double rows = static_cast<double>(r1 - r0);
      for (int64_t h = 0; h < p.kv_heads; ++h) {
        if (n == 1) {
          tasks.push_back({s, r0, r1, h, k0, k1, -1, rows * (keys + BK)});
          continue;
        }
        splits.push_back({static_cast<int64_t>(tasks.size()), n});
        const int64_t step = ((keys + n - 1) / n + BK - 1) / BK * BK;
        for (int64_t k = 0; k < n; ++k) {
          const int64_t lo = std::min(k1, k0 + k * step), hi = std::min(k1, lo + step);
          tasks.push_back({s, r0, r1, h, lo, hi, floats, rows * (hi - lo + BK)});
          floats += M * (p.dim + 2);
        }
      }
    }
  return floats;
}

template <KVType T>
void attend_all(const AttnRows& p, const KVLayer& kv) {
  std::vector<Task> tasks;
  std::vector<Split> splits;
  std::vector<float> parts(plan(p, at::get_num_threads(), tasks, splits));
  std::vector<int64_t> order(tasks.size());  // largest first, for an even finish
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return tasks[x].cost > tasks[y].cost; });
  std::atomic<int64_t> next{0};
  const int64_t n = static_cast<int64_t>(tasks.size());
  at::parallel_for(0, std::min<int64_t>(n, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    Scratch sc;
    for (int64_t i = next++; i < n; i = next++) run_task<T>(p, kv, tasks[order[i]], sc, parts.data());
  });
  for (const Split& sp : splits) merge_parts(p, tasks[sp.first], sp.n, parts.data());
}

}  // namespace

void flash_attention(const AttnRows& p, const KVLayer& kv) {
  if (p.rows == 0) return;
  switch (kv.type) {
    case KVType::F32: attend_all<KVType::F32>(p, kv); break;
    case KVType::BF16: attend_all<KVType::BF16>(p, kv); break;
    case KVType::F16: attend_all<KVType::F16>(p, kv); break;
    case KVType::I8: attend_all<KVType::I8>(p, kv); break;
  }
}

void encode_kv_row_i8(const float* x, int64_t dim, int64_t group, uint8_t* row) {
  int8_t* codes = reinterpret_cast<int8_t*>(row);
  for (int64_t g0 = 0; g0 < dim; g0 += group) {
    float amax = 0.f;
    for (int64_t i = g0; i < g0 + group; ++i) amax = std::max(amax, std::fabs(x[i]));
    const c10::Half h(amax / 127.f);
    const float s = static_cast<float>(h);
    for (int64_t i = g0; i < g0 + group; ++i)
      codes[i] = s > 0.f ? static_cast<int8_t>(std::clamp(std::nearbyint(x[i] / s), -127.f, 127.f)) : 0;
    std::memcpy(row + dim + 2 * (g0 / group), &h.x, 2);
  }
}

}  // namespace rs
