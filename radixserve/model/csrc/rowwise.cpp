// Row-wise pieces of a Llama layer, shared by the one-call decoder and the prefill path:
// RMSNorm, rotate-half RoPE and SiLU(gate) * up, all in float32 with the arithmetic of
// llama.py (the PyTorch path they replace computes the same function). Each takes a range of
// rows, so callers can split rows over threads; inputs are checked by bindings.cpp.
#include <algorithm>

#include "kernels.h"

namespace rs {

void rms_norm_rows(const float* x, const float* w, int64_t rows, int64_t dim, float eps,
                   float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    v8 ss = {};
    for (int64_t i = 0; i < dim; i += 8) ss += load8(xr + i) * load8(xr + i);
    const v8 inv = splat8(1.f / std::sqrt(hsum8(ss) / dim + eps));
    for (int64_t i = 0; i < dim; i += 8) store8(out + r * dim + i, load8(xr + i) * inv * load8(w + i));
  }
}

void rope_row(float* v, int64_t heads, int64_t dim, const float* cos, const float* sin) {
  const int64_t half = dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* p = v + h * dim;
    for (int64_t i = 0; i < half; i += 8) {
      const v8 a = load8(p + i), b = load8(p + half + i);
      store8(p + i, a * load8(cos + i) - b * load8(sin + i));
      store8(p + half + i, b * load8(cos + half + i) + a * load8(sin + half + i));
    }
  }
}

void silu_mul_rows(const float* gate_up, int64_t rows, int64_t inter, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gate_up + r * 2 * inter;
    float* a = out + r * inter;
    for (int64_t i = 0; i < inter; i += 8) {  // exp of -|g| never overflows
      const v8 gv = load8(g + i);
      const v8 e = exp8(gv < splat8(0.f) ? gv : -gv);
      const v8 r = splat8(1.f) / (splat8(1.f) + e);  // one division serves both signs
      const v8 sig = gv < splat8(0.f) ? e * r : r;
      store8(a + i, gv * sig * load8(g + inter + i));
    }
  }
}

void gelu_tanh_mul_rows(const float* gate_up, int64_t rows, int64_t inter, float* out) {
  // 0.5 (1 + tanh(u)) = sigmoid(2u): the sigmoid of silu_mul_rows at 2u
  const v8 c1 = splat8(2.f * 0.7978845608028654f), c3 = splat8(0.044715f);
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gate_up + r * 2 * inter;
    float* a = out + r * inter;
    for (int64_t i = 0; i < inter; i += 8) {
      const v8 gv = load8(g + i);
      const v8 u = c1 * (gv + c3 * gv * gv * gv);
      const v8 e = exp8(u < splat8(0.f) ? u : -u);  // exp of -|u| never overflows
      const v8 rcp = splat8(1.f) / (splat8(1.f) + e);
      const v8 sig = u < splat8(0.f) ? e * rcp : rcp;
      store8(a + i, gv * sig * load8(g + inter + i));
    }
  }
}

void add_rms_norm_rows(const float* x, const float* w, int64_t rows, int64_t dim, float eps,
                       float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    float* o = out + r * dim;
    v8 ss = {};
    for (int64_t i = 0; i < dim; i += 8) ss += load8(xr + i) * load8(xr + i);
    const v8 inv = splat8(1.f / std::sqrt(hsum8(ss) / dim + eps));
    for (int64_t i = 0; i < dim; i += 8)
      store8(o + i, load8(o + i) + load8(xr + i) * inv * load8(w + i));
  }
}

int64_t argmax_row(const float* x, int64_t n) {
  // the maximum first (NaN: none of the comparisons holds, so it is noted apart), then the
  // first position holding it
  v8 best = splat8(-INFINITY);
  v8i nan = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const v8 v = load8(x + i);
    nan |= v != v;
    best = v > best ? v : best;
  }
  float top = -INFINITY;
  bool any_nan = false;
  for (int l = 0; l < 8; ++l) {
    top = std::max(top, best[l]);
    any_nan |= nan[l] != 0;
  }
  for (int64_t j = i; j < n; ++j) {
    any_nan |= x[j] != x[j];
    if (x[j] > top) top = x[j];
  }
  if (any_nan) {
    for (int64_t j = 0; j < n; ++j)
      if (x[j] != x[j]) return j;
  }
  i = 0;
#ifdef RS_AVX2
  const __m256 target = _mm256_set1_ps(top);
  for (; i + 8 <= n; i += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), target, _CMP_EQ_OQ));
    if (hit) return i + __builtin_ctz(hit);
  }
#endif
  for (; i < n; ++i)
    if (x[i] == top) return i;
  return 0;
}

}  // namespace rs
