// QWeight: a weight matrix in one of the formats of kernels.h, holding its tensors.
#pragma once

#include <torch/extension.h>

#include <optional>

#include "kernels.h"

namespace rs {

// A weight matrix in one of the formats of kernels.h; keeps its tensors alive.
struct QWeight {
  WeightView view;
  torch::Tensor qs, d, m;

  QWeight(int64_t fmt, int64_t n, int64_t k, torch::Tensor qs_, std::optional<torch::Tensor> d_,
          std::optional<torch::Tensor> m_)
      : qs(std::move(qs_)) {
    TORCH_CHECK(fmt >= 0 && fmt <= 2, "unknown weight format ", fmt);
    TORCH_CHECK(k % kBlock == 0 && n > 0, "weights need K a multiple of 32, got ", k);
    view.fmt = static_cast<WFormat>(fmt);
    view.n = n;
    view.k = k;
    TORCH_CHECK(qs.device().is_cpu() && qs.is_contiguous(), "weights must be contiguous on CPU");
    const int64_t nb = n * (k / kBlock);
    if (view.fmt == WFormat::F32) {
      TORCH_CHECK(qs.scalar_type() == torch::kFloat32 && qs.numel() == n * k, "F32: float [N, K]");
    } else {
      const int64_t bytes = view.fmt == WFormat::Q8_0 ? n * k : n * k / 2;
      TORCH_CHECK(qs.element_size() == 1 && qs.numel() == bytes, "quantized data has wrong size");
      TORCH_CHECK(d_.has_value() && d_->scalar_type() == torch::kFloat32 &&
                      d_->is_contiguous() && d_->numel() == nb,
                  "scales: contiguous float [N, K/32]");
      d = *d_;
      view.d = d.data_ptr<float>();
    }
    if (view.fmt == WFormat::Q4_1) {
      TORCH_CHECK(m_.has_value() && m_->scalar_type() == torch::kFloat32 &&
                      m_->is_contiguous() && m_->numel() == nb,
                  "minimums: contiguous float [N, K/32]");
      m = *m_;
      view.m = m.data_ptr<float>();
    }
    view.qs = qs.data_ptr();
  }
};

}  // namespace rs
