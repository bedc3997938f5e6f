// Row-wise pieces of a Llama layer, shared by the one-call decoder and the prefill path:
// RMSNorm, rotate-half RoPE and SiLU(gate) * up, all in float32 with the arithmetic of
// llama.py (the PyTorch path they replace computes the same function). Each takes a range of
// rows, so callers can split rows over threads; inputs are checked by bindings.cpp.
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
      const v8 sig = gv < splat8(0.f) ? e / (splat8(1.f) + e) : splat8(1.f) / (splat8(1.f) + e);
      store8(a + i, gv * sig * load8(g + inter + i));
    }
  }
}

}  // namespace rs
