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
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstring>

namespace {

// GCC/Clang vector extensions: one register of 16 floats, compiled for whatever the CPU has
// (-march=native): a single AVX-512 register, or pairs of AVX2 ones.
typedef float v16 __attribute__((vector_size(64)));
constexpr int64_t kLanes = 16;

inline float to_float(float x) { return x; }
inline float to_float(double x) { return static_cast<float>(x); }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }

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
  // bfloat16 is the top half of a float: widen 16 of them and shift, all in registers
  typedef uint16_t v16u16 __attribute__((vector_size(32)));
  typedef uint32_t v16u32 __attribute__((vector_size(64)));
  v16u16 raw;
  std::memcpy(&raw, src, sizeof(raw));
  v16u32 wide = __builtin_convertvector(raw, v16u32) << 16;
  v16 out;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
}

inline float hsum(v16 a) {
  typedef int v16i __attribute__((vector_size(64)));
  a += __builtin_shuffle(a, v16i{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
  a += __builtin_shuffle(a, v16i{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
  a += __builtin_shuffle(a, v16i{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
  a += __builtin_shuffle(a, v16i{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
  return a[0];
}

constexpr int64_t kMaxChunks = 16;  // head_dim up to 256
constexpr int64_t kMaxGroup = 16;   // query heads per KV head

template <typename T>
void scores_impl(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& ctx,
                 const torch::Tensor& lens, torch::Tensor& scores) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k.size(0), S = k.size(1), L = ctx.size(1), G = H / KVH;
  const int64_t C = D / kLanes;
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const int64_t* cp = ctx.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  float* sp = scores.data_ptr<float>();
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
void values_impl(const torch::Tensor& probs, const torch::Tensor& v, const torch::Tensor& ctx,
                 const torch::Tensor& lens, torch::Tensor& out) {
  const int64_t KVH = v.size(0), S = v.size(1), D = v.size(2);
  const int64_t B = ctx.size(0), L = ctx.size(1), G = probs.size(2), H = KVH * G;
  const int64_t C = D / kLanes;
  const float* pp = probs.data_ptr<float>();
  const T* vp = v.data_ptr<T>();
  const int64_t* cp = ctx.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
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

void check_inputs(const torch::Tensor& kv, const torch::Tensor& ctx, const torch::Tensor& lens) {
  TORCH_CHECK(kv.device().is_cpu() && kv.is_contiguous() && kv.dim() == 3,
              "the pool layer must be a contiguous CPU tensor [heads, slots, dim]");
  TORCH_CHECK(kv.size(2) % kLanes == 0 && kv.size(2) <= kLanes * kMaxChunks,
              "head_dim must be a multiple of ", kLanes, " up to ", kLanes * kMaxChunks);
  TORCH_CHECK(ctx.scalar_type() == torch::kInt64 && ctx.is_contiguous() && ctx.dim() == 2,
              "ctx must be a contiguous int64 [batch, max_len] tensor");
  TORCH_CHECK(lens.scalar_type() == torch::kInt64 && lens.is_contiguous() &&
                  lens.numel() == ctx.size(0),
              "lens must be a contiguous int64 [batch] tensor");
}

}  // namespace

torch::Tensor paged_scores(torch::Tensor q, torch::Tensor k, torch::Tensor ctx,
                           torch::Tensor lens) {
  check_inputs(k, ctx, lens);
  TORCH_CHECK(q.is_contiguous() && q.dim() == 3 && q.scalar_type() == k.scalar_type(),
              "q must be contiguous [batch, heads, dim] in the pool's dtype");
  TORCH_CHECK(q.size(1) % k.size(0) == 0 && q.size(1) / k.size(0) <= kMaxGroup,
              "at most ", kMaxGroup, " query heads per KV head");
  const int64_t G = q.size(1) / k.size(0);
  auto scores = torch::empty({k.size(0), q.size(0), G, ctx.size(1)},
                             q.options().dtype(torch::kFloat32));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "paged_scores",
                                  [&] { scores_impl<scalar_t>(q, k, ctx, lens, scores); });
  return scores;
}

torch::Tensor paged_values(torch::Tensor probs, torch::Tensor v, torch::Tensor ctx,
                           torch::Tensor lens) {
  check_inputs(v, ctx, lens);
  TORCH_CHECK(probs.is_contiguous() && probs.scalar_type() == torch::kFloat32 &&
                  probs.dim() == 4 && probs.size(2) <= kMaxGroup,
              "probs must be contiguous float32 [kv_heads, batch, group, max_len]");
  auto out = torch::empty({ctx.size(0), v.size(0) * probs.size(2), v.size(2)}, v.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, v.scalar_type(), "paged_values",
                                  [&] { values_impl<scalar_t>(probs, v, ctx, lens, out); });
  return out;
}
