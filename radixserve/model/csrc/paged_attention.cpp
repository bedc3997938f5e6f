// Decode attention straight from the paged KV pool, without gathering K and V first.
//
// The pool of one layer is head-major: k, v are [num_kv_heads, num_slots, head_dim]. Each
// decoding sequence b attends to the slots ctx[b, :lens[b]]. Two kernels bracket the softmax
// (which stays in PyTorch, vectorised there):
//   paged_scores:  scores[h, b, g, j] = q[b, h*G + g, :] . k[h, ctx[b, j], :]
//   paged_values:  out[b, h*G + g, :] = sum_j probs[h, b, g, j] * v[h, ctx[b, j], :]
// Positions j >= lens[b] get a score of 0 (the caller masks them) and are never read.
// Both read each K or V row once per (head, sequence) and share it across the G query heads
// of that KV head; work is split over (head, sequence) pairs with at::parallel_for.
// These are raw-pointer kernels: bindings.cpp checks the tensors and dispatches on dtype.
#include "kernels.h"

namespace rs {
namespace {

// GCC/Clang vector extensions: one register of 16 floats, compiled for whatever the CPU has
// (-march=native): a single AVX-512 register, or pairs of AVX2 ones.
typedef float v16 __attribute__((vector_size(64)));
constexpr int64_t kLanes = 16;

template <typename T>
inline v16 load16(const T* src) {
  v16 out;
  for (int64_t i = 0; i < kLanes; ++i) out[i] = to_float(src[i]);
  return out;
}
template <>
inline v16 load16<float>(const float* src) {
  v16 out;
  std::memcpy(&out, src, sizeof(out));
  return out;
}
template <>
inline v16 load16<c10::BFloat16>(const c10::BFloat16* src) {
  typedef uint16_t v16u16 __attribute__((vector_size(32)));
  typedef uint32_t v16u32 __attribute__((vector_size(64)));
  return widen_bf16<v16, v16u16, v16u32>(src);
}

inline float hsum(v16 a) {
  typedef int v16i __attribute__((vector_size(64)));
  a += __builtin_shuffle(a, v16i{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
  a += __builtin_shuffle(a, v16i{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
  a += __builtin_shuffle(a, v16i{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
  a += __builtin_shuffle(a, v16i{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
  return a[0];
}

constexpr int64_t kMaxChunks = kAttnMaxDim / kLanes;
constexpr int64_t kMaxGroup = kAttnMaxGroup;

}  // namespace

template <typename T>
void paged_scores_kernel(const T* qp, const T* kp, const int64_t* cp, const int64_t* lp,
                         float* sp, int64_t B, int64_t H, int64_t D, int64_t KVH, int64_t S,
                         int64_t L) {
  const int64_t G = H / KVH, C = D / kLanes;
  at::parallel_for(0, KVH * B, 1, [&](int64_t begin, int64_t end) {
    v16 qv[kMaxGroup][kMaxChunks], kv[kMaxChunks];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / B, b = task % B, n = lp[b];
      for (int64_t g = 0; g < G; ++g)
        for (int64_t c = 0; c < C; ++c) qv[g][c] = load16(qp + (b * H + h * G + g) * D + c * kLanes);
      float* out = sp + (h * B + b) * G * L;
      const T* kbase = kp + h * S * D;
      for (int64_t j = 0; j < n; ++j) {
        const T* row = kbase + cp[b * L + j] * D;
        for (int64_t c = 0; c < C; ++c) kv[c] = load16(row + c * kLanes);
        for (int64_t g = 0; g < G; ++g) {
          v16 acc = qv[g][0] * kv[0];
          for (int64_t c = 1; c < C; ++c) acc += qv[g][c] * kv[c];
          out[g * L + j] = hsum(acc);
        }
      }
      for (int64_t g = 0; g < G; ++g) std::fill(out + g * L + n, out + (g + 1) * L, 0.f);
    }
  });
}

template <typename T>
void paged_values_kernel(const float* pp, const T* vp, const int64_t* cp, const int64_t* lp,
                         T* op, int64_t B, int64_t G, int64_t D, int64_t KVH, int64_t S,
                         int64_t L) {
  const int64_t H = KVH * G, C = D / kLanes;
  at::parallel_for(0, KVH * B, 1, [&](int64_t begin, int64_t end) {
    v16 acc[kMaxGroup][kMaxChunks], vv[kMaxChunks];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / B, b = task % B, n = lp[b];
      const float* p = pp + (h * B + b) * G * L;
      const T* vbase = vp + h * S * D;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t c = 0; c < C; ++c) acc[g][c] = v16{};
      for (int64_t j = 0; j < n; ++j) {
        const T* row = vbase + cp[b * L + j] * D;
        for (int64_t c = 0; c < C; ++c) vv[c] = load16(row + c * kLanes);
        for (int64_t g = 0; g < G; ++g) {
          const float w = p[g * L + j];
          for (int64_t c = 0; c < C; ++c) acc[g][c] += w * vv[c];
        }
      }
      T* o = op + (b * H + h * G) * D;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t c = 0; c < C; ++c)
          for (int64_t i = 0; i < kLanes; ++i)
            o[g * D + c * kLanes + i] = static_cast<T>(acc[g][c][i]);
    }
  });
}

#define RS_INSTANTIATE(T)                                                                     \
  template void paged_scores_kernel<T>(const T*, const T*, const int64_t*, const int64_t*,   \
                                       float*, int64_t, int64_t, int64_t, int64_t, int64_t,  \
                                       int64_t);                                            \
  template void paged_values_kernel<T>(const float*, const T*, const int64_t*, const int64_t*, \
                                       T*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t);
RS_INSTANTIATE(float)
RS_INSTANTIATE(c10::BFloat16)
RS_INSTANTIATE(c10::Half)

}  // namespace rs
