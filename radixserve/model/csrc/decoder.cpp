// The whole Llama layer stack for a batch of decode tokens, in one native call.
//
// A decode step of a small model is mostly per-op overhead when driven op by op from Python
// (about 20 small ops per layer); here each layer is: RMSNorm -> QKV matmul (+bias) -> RoPE
// -> K/V written to the pool -> attention over each sequence's slots -> output matmul added
// to the residual -> RMSNorm -> gate/up matmul -> SiLU(gate) * up -> down matmul added to the
// residual; then the final norm and the LM head. The arithmetic matches llama.py's forward:
// float32 activations, rotate-half RoPE from float32 tables, softmax in float32. Weights are
// QWeights (block-quantized or dense float); the pool keeps its dtype (float32, bfloat16,
// float16), laid out [layers, kv_heads, slots, head_dim].
//
// Not thread-safe: one Decoder serves one engine, whose steps run one at a time (scratch
// buffers are members).
#include <algorithm>
#include <vector>

#include "qweight.h"

namespace rs {
namespace {

template <typename T>
inline v8 load8_as_float(const T* p) {
  v8 out;
  for (int i = 0; i < 8; ++i) out[i] = to_float(p[i]);
  return out;
}
template <>
inline v8 load8_as_float<float>(const float* p) { return load8(p); }
template <>
inline v8 load8_as_float<c10::BFloat16>(const c10::BFloat16* p) {
  typedef uint16_t v8u16 __attribute__((vector_size(16)));
  v8u16 raw;
  std::memcpy(&raw, p, sizeof(raw));
  v8i wide = __builtin_convertvector(raw, v8i) << 16;
  v8 out;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
}

void rms_norm(const float* x, const float* w, int64_t rows, int64_t dim, float eps, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    v8 ss = {};
    for (int64_t i = 0; i < dim; i += 8) ss += load8(xr + i) * load8(xr + i);
    const v8 inv = splat8(1.f / std::sqrt(hsum8(ss) / dim + eps));
    for (int64_t i = 0; i < dim; i += 8) store8(out + r * dim + i, load8(xr + i) * inv * load8(w + i));
  }
}

// rotate-half RoPE of `heads` vectors of size dim at one position, in place
void rope(float* v, int64_t heads, int64_t dim, const float* cos, const float* sin) {
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

// in place: softmax of n scores
void softmax(float* s, int64_t n) {
  float mx = -INFINITY;
  for (int64_t j = 0; j < n; ++j) mx = std::max(mx, s[j]);
  v8 total = {};
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const v8 e = exp8(load8(s + j) - splat8(mx));
    store8(s + j, e);
    total += e;
  }
  float sum = hsum8(total);
  for (; j < n; ++j) sum += (s[j] = std::exp(s[j] - mx));
  const float inv = 1.f / sum;
  for (j = 0; j < n; ++j) s[j] *= inv;
}

}  // namespace

class Decoder {
 public:
  Decoder(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
          std::vector<QWeight> qkv, std::vector<QWeight> o, std::vector<QWeight> gate_up,
          std::vector<QWeight> down, std::vector<torch::Tensor> norms,
          std::vector<std::optional<torch::Tensor>> qkv_bias, QWeight embed, QWeight lm_head,
          torch::Tensor rope_cos, torch::Tensor rope_sin)
      : heads_(num_heads), kv_heads_(num_kv_heads), dim_(head_dim), eps_(eps), qkv_(qkv),
        o_(o), gate_up_(gate_up), down_(down), norms_(norms), bias_(qkv_bias), embed_(embed),
        lm_head_(lm_head), cos_(rope_cos), sin_(rope_sin) {
    layers_ = static_cast<int64_t>(qkv_.size());
    hidden_ = embed_.view.k;
    inter_ = down_.at(0).view.k;
    const int64_t qkv_n = (heads_ + 2 * kv_heads_) * dim_;
    TORCH_CHECK(heads_ % kv_heads_ == 0 && dim_ % 16 == 0 && hidden_ % 8 == 0, "bad shape");
    TORCH_CHECK(o_.size() == (size_t)layers_ && gate_up_.size() == (size_t)layers_ &&
                    down_.size() == (size_t)layers_ && bias_.size() == (size_t)layers_ &&
                    norms_.size() == (size_t)(2 * layers_ + 1),
                "one of each weight per layer, 2 norms per layer + the final norm");
    for (int64_t l = 0; l < layers_; ++l) {
      TORCH_CHECK(qkv_[l].view.n == qkv_n && qkv_[l].view.k == hidden_ &&
                      o_[l].view.n == hidden_ && o_[l].view.k == heads_ * dim_ &&
                      gate_up_[l].view.n == 2 * inter_ && gate_up_[l].view.k == hidden_ &&
                      down_[l].view.n == hidden_ && down_[l].view.k == inter_,
                  "layer ", l, ": weight shapes do not fit the model");
      if (bias_[l].has_value())
        TORCH_CHECK(bias_[l]->scalar_type() == torch::kFloat32 && bias_[l]->numel() == qkv_n,
                    "qkv bias: float32 [", qkv_n, "]");
    }
    for (const auto& n : norms_)
      TORCH_CHECK(n.scalar_type() == torch::kFloat32 && n.is_contiguous() && n.numel() == hidden_,
                  "norm weights: contiguous float32 [hidden]");
    TORCH_CHECK(lm_head_.view.k == hidden_, "LM head: [vocab, hidden]");
    TORCH_CHECK(cos_.scalar_type() == torch::kFloat32 && cos_.is_contiguous() &&
                    cos_.dim() == 2 && cos_.size(1) == dim_ && sin_.sizes() == cos_.sizes() &&
                    sin_.is_contiguous() && sin_.scalar_type() == torch::kFloat32,
                "RoPE tables: contiguous float32 [positions, head_dim]");
  }

  torch::Tensor forward(torch::Tensor ids, torch::Tensor positions, torch::Tensor out_slots,
                        torch::Tensor ctx, torch::Tensor lens, torch::Tensor k_pool,
                        torch::Tensor v_pool) {
    const int64_t B = ids.numel();
    for (const auto* t : {&ids, &positions, &out_slots, &lens})
      TORCH_CHECK(t->scalar_type() == torch::kInt64 && t->is_contiguous() && t->numel() == B,
                  "ids, positions, out_slots, lens: contiguous int64 [batch]");
    TORCH_CHECK(ctx.scalar_type() == torch::kInt64 && ctx.is_contiguous() && ctx.dim() == 2 &&
                    ctx.size(0) == B,
                "ctx: contiguous int64 [batch, max_len]");
    TORCH_CHECK(k_pool.dim() == 4 && k_pool.size(0) == layers_ && k_pool.size(1) == kv_heads_ &&
                    k_pool.size(3) == dim_ && k_pool.is_contiguous() && v_pool.is_contiguous() &&
                    v_pool.sizes() == k_pool.sizes() &&
                    v_pool.scalar_type() == k_pool.scalar_type(),
                "pools: contiguous [layers, kv_heads, slots, head_dim]");
    const int64_t* id = ids.data_ptr<int64_t>();
    const int64_t* pos = positions.data_ptr<int64_t>();
    const int64_t* ln = lens.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(id[b] >= 0 && id[b] < embed_.view.n, "token id out of range");
      TORCH_CHECK(pos[b] >= 0 && pos[b] < cos_.size(0), "position out of range");
      TORCH_CHECK(ln[b] >= 1 && ln[b] <= ctx.size(1), "context length out of range");
      const int64_t* sl = ctx.data_ptr<int64_t>() + b * ctx.size(1);
      for (int64_t j = 0; j < ln[b]; ++j)
        TORCH_CHECK(sl[j] >= 0 && sl[j] < k_pool.size(2), "context slot out of range");
    }
    h_.resize(B * hidden_);
    for (int64_t b = 0; b < B; ++b) dequant_rows(embed_.view, id[b], 1, h_.data() + b * hidden_);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_pool.scalar_type(), "decode",
                                    [&] { layers<scalar_t>(B, pos, out_slots, ctx, lens, k_pool,
                                                           v_pool); });
    x_.resize(B * hidden_);
    rms_norm(h_.data(), norms_.back().data_ptr<float>(), B, hidden_, eps_, x_.data());
    auto logits = torch::empty({B, lm_head_.view.n}, torch::kFloat32);
    qgemm(x_.data(), B, lm_head_.view, logits.data_ptr<float>(), false);
    return logits;
  }

 private:
  template <typename T>
  void layers(int64_t B, const int64_t* pos, const torch::Tensor& out_slots,
              const torch::Tensor& ctx, const torch::Tensor& lens, torch::Tensor& k_pool,
              torch::Tensor& v_pool) {
    const int64_t q_size = heads_ * dim_, kv_size = kv_heads_ * dim_, qkv_n = q_size + 2 * kv_size;
    const int64_t slots = k_pool.size(2);
    const int64_t* out = out_slots.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK(out[b] >= 0 && out[b] < slots, "output slot out of range");
    x_.resize(B * hidden_);
    qkv_buf_.resize(B * qkv_n);
    attn_.resize(B * q_size);
    gu_.resize(B * 2 * inter_);
    act_.resize(B * inter_);
    T* kp = k_pool.data_ptr<T>();
    T* vp = v_pool.data_ptr<T>();
    for (int64_t l = 0; l < layers_; ++l) {
      rms_norm(h_.data(), norms_[2 * l].data_ptr<float>(), B, hidden_, eps_, x_.data());
      qgemm(x_.data(), B, qkv_[l].view, qkv_buf_.data(), false);
      for (int64_t b = 0; b < B; ++b) {
        float* row = qkv_buf_.data() + b * qkv_n;
        if (bias_[l].has_value()) {
          const float* bias = bias_[l]->data_ptr<float>();
          for (int64_t i = 0; i < qkv_n; ++i) row[i] += bias[i];
        }
        const float* c = cos_.data_ptr<float>() + pos[b] * dim_;
        const float* s = sin_.data_ptr<float>() + pos[b] * dim_;
        rope(row, heads_ + kv_heads_, dim_, c, s);  // q heads, then k heads
        for (int64_t h = 0; h < kv_heads_; ++h) {
          const int64_t off = ((l * kv_heads_ + h) * slots + out[b]) * dim_;
          for (int64_t i = 0; i < dim_; ++i) {
            kp[off + i] = from_float<T>(row[q_size + h * dim_ + i]);
            vp[off + i] = from_float<T>(row[q_size + kv_size + h * dim_ + i]);
          }
        }
      }
      attention<T>(l, B, ctx, lens, kp, vp, slots);
      qgemm(attn_.data(), B, o_[l].view, h_.data(), true);
      rms_norm(h_.data(), norms_[2 * l + 1].data_ptr<float>(), B, hidden_, eps_, x_.data());
      qgemm(x_.data(), B, gate_up_[l].view, gu_.data(), false);
      for (int64_t b = 0; b < B; ++b) {
        const float* g = gu_.data() + b * 2 * inter_;
        float* a = act_.data() + b * inter_;
        for (int64_t i = 0; i < inter_; i += 8) {  // silu(g) * up; exp of -|g| never overflows
          const v8 gv = load8(g + i);
          const v8 e = exp8(gv < splat8(0.f) ? gv : -gv);
          const v8 sig = gv < splat8(0.f) ? e / (splat8(1.f) + e) : splat8(1.f) / (splat8(1.f) + e);
          store8(a + i, gv * sig * load8(g + inter_ + i));
        }
      }
      qgemm(act_.data(), B, down_[l].view, h_.data(), true);
    }
  }

  // attn_[b, head] = softmax(q . K / sqrt(dim)) V over the slots ctx[b, :lens[b]]; one task
  // per (sequence, KV head), sharing each K/V row read among that head's query heads.
  template <typename T>
  void attention(int64_t l, int64_t B, const torch::Tensor& ctx, const torch::Tensor& lens,
                 const T* kp, const T* vp, int64_t slots) {
    const int64_t G = heads_ / kv_heads_, L = ctx.size(1), D = dim_;
    const int64_t qkv_n = (heads_ + 2 * kv_heads_) * dim_;
    const float scale = 1.f / std::sqrt(static_cast<float>(D));
    const int64_t* cp = ctx.data_ptr<int64_t>();
    const int64_t* lp = lens.data_ptr<int64_t>();
    at::parallel_for(0, B * kv_heads_, 1, [&](int64_t begin, int64_t end) {
      thread_local std::vector<float> scores;
      for (int64_t task = begin; task < end; ++task) {
        const int64_t b = task / kv_heads_, h = task % kv_heads_, n = lp[b];
        const int64_t* sl = cp + b * L;
        scores.resize(G * n);
        const float* q = qkv_buf_.data() + b * qkv_n + h * G * D;
        const T* kbase = kp + (l * kv_heads_ + h) * slots * D;
        const T* vbase = vp + (l * kv_heads_ + h) * slots * D;
        for (int64_t j = 0; j < n; ++j) {
          const T* k = kbase + sl[j] * D;
          for (int64_t g = 0; g < G; ++g) {
            v8 acc = {};
            for (int64_t i = 0; i < D; i += 8) acc += load8(q + g * D + i) * load8_as_float(k + i);
            scores[g * n + j] = hsum8(acc) * scale;
          }
        }
        for (int64_t g = 0; g < G; ++g) softmax(scores.data() + g * n, n);
        float* o = attn_.data() + b * heads_ * D + h * G * D;
        std::fill(o, o + G * D, 0.f);
        for (int64_t j = 0; j < n; ++j) {
          const T* v = vbase + sl[j] * D;
          for (int64_t i = 0; i < D; i += 8) {
            const v8 vv = load8_as_float(v + i);
            for (int64_t g = 0; g < G; ++g)
              store8(o + g * D + i, load8(o + g * D + i) + splat8(scores[g * n + j]) * vv);
          }
        }
      }
    });
  }

  int64_t heads_, kv_heads_, dim_, layers_ = 0, hidden_ = 0, inter_ = 0;
  float eps_;
  std::vector<QWeight> qkv_, o_, gate_up_, down_;
  std::vector<torch::Tensor> norms_;
  std::vector<std::optional<torch::Tensor>> bias_;
  QWeight embed_, lm_head_;
  torch::Tensor cos_, sin_;
  std::vector<float> h_, x_, qkv_buf_, attn_, gu_, act_;
};

}  // namespace rs

void bind_decoder(pybind11::module& m) {
  pybind11::class_<rs::Decoder>(m, "Decoder")
      .def(pybind11::init<int64_t, int64_t, int64_t, double, std::vector<rs::QWeight>,
                          std::vector<rs::QWeight>, std::vector<rs::QWeight>,
                          std::vector<rs::QWeight>, std::vector<torch::Tensor>,
                          std::vector<std::optional<torch::Tensor>>, rs::QWeight, rs::QWeight,
                          torch::Tensor, torch::Tensor>())
      .def("forward", &rs::Decoder::forward);
}
