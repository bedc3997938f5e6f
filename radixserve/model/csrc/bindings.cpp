// Python bindings of radixserve's native CPU kernels (one extension module).
#include <torch/extension.h>

#include "qweight.h"

torch::Tensor paged_scores(torch::Tensor q, torch::Tensor k, torch::Tensor ctx, torch::Tensor lens);
torch::Tensor paged_values(torch::Tensor probs, torch::Tensor v, torch::Tensor ctx,
                           torch::Tensor lens);
void bind_decoder(pybind11::module& m);

namespace rs {

torch::Tensor qgemm_op(torch::Tensor x, const QWeight& w, std::optional<torch::Tensor> out) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.dim() == 2 &&
                  x.size(1) == w.view.k,
              "x must be contiguous float32 [M, K]");
  torch::Tensor y;
  bool accumulate = out.has_value();
  if (accumulate) {
    y = *out;
    TORCH_CHECK(y.scalar_type() == torch::kFloat32 && y.is_contiguous() &&
                    y.size(0) == x.size(0) && y.size(1) == w.view.n,
                "out must be contiguous float32 [M, N]");
  } else {
    y = torch::empty({x.size(0), w.view.n}, x.options());
  }
  qgemm(x.data_ptr<float>(), x.size(0), w.view, y.data_ptr<float>(), accumulate);
  return y;
}

torch::Tensor dequantize_op(const QWeight& w, std::optional<torch::Tensor> rows) {
  if (!rows.has_value()) {
    auto out = torch::empty({w.view.n, w.view.k}, torch::kFloat32);
    float* o = out.data_ptr<float>();
    at::parallel_for(0, w.view.n, 64, [&](int64_t b, int64_t e) {
      dequant_rows(w.view, b, e - b, o + b * w.view.k);
    });
    return out;
  }
  TORCH_CHECK(rows->scalar_type() == torch::kInt64 && rows->dim() == 1, "rows: int64 [R]");
  auto idx = rows->contiguous();
  auto out = torch::empty({idx.numel(), w.view.k}, torch::kFloat32);
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < idx.numel(); ++i) {
    TORCH_CHECK(ip[i] >= 0 && ip[i] < w.view.n, "row index out of range");
    dequant_rows(w.view, ip[i], 1, out.data_ptr<float>() + i * w.view.k);
  }
  return out;
}

}  // namespace rs

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_scores", &paged_scores, "q . K over paged slots");
  m.def("paged_values", &paged_values, "probs . V over paged slots");
  pybind11::class_<rs::QWeight>(m, "QWeight")
      .def(pybind11::init<int64_t, int64_t, int64_t, torch::Tensor, std::optional<torch::Tensor>,
                          std::optional<torch::Tensor>>());
  m.def("qgemm", &rs::qgemm_op, "x @ W^T (into out, accumulating, when given)",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("out") = pybind11::none());
  m.def("dequantize", &rs::dequantize_op, "W (or some of its rows) as float32",
        pybind11::arg("w"), pybind11::arg("rows") = pybind11::none());
  bind_decoder(m);
}
