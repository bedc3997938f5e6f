// Python bindings of radixserve's native CPU kernels: the one translation unit that includes
// torch/extension.h (the slow header), so the kernels build in parallel and fast. Every tensor
// is checked here; the kernels get raw pointers.
#include <torch/extension.h>

#include <mutex>
#include <optional>
#include <set>

#include "kernels.h"

namespace rs {
namespace {

// A pool tensor [..., slots, row_width] in the format KVFormat.kernel_code names (row_width:
// head_dim values, or an int8 row's bytes), checked against head_dim and the group.
KVType kv_type(const torch::Tensor& t, int64_t code, int64_t group, int64_t dim) {
  TORCH_CHECK(code >= 0 && code <= static_cast<int64_t>(KVType::I8), "unknown KV format code ", code);
  const auto type = static_cast<KVType>(code);
  const torch::ScalarType expect[] = {torch::kFloat32, torch::kBFloat16, torch::kHalf, torch::kUInt8};
  TORCH_CHECK(t.scalar_type() == expect[code], "the KV pool's dtype does not match its format");
  if (type == KVType::I8) {
    TORCH_CHECK(group > 0 && group % 16 == 0 && dim % group == 0, "int8 KV: a group of a multiple of 16 dividing head_dim");
    TORCH_CHECK(t.size(-1) == dim + 2 * (dim / group), "int8 KV rows: head_dim codes, then the scales");
  } else {
    TORCH_CHECK(t.size(-1) == dim, "KV rows: head_dim values");
  }
  return type;
}

int64_t row_bytes(const torch::Tensor& t) { return t.size(-1) * t.element_size(); }

void check_ints(const torch::Tensor& t, int64_t n, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kInt64 && t.is_contiguous() && t.dim() == 1 &&
                  (n < 0 || t.numel() == n),
              what, " must be a contiguous int64 CPU vector", n < 0 ? "" : " of one entry per row");
}

}  // namespace

// Attention of q's rows over their ranges of pool slots (kernels.h: AttnRows); every index
// is checked here.
torch::Tensor flash_attention_op(torch::Tensor q, torch::Tensor k, torch::Tensor v, int64_t code, int64_t group,
                                 torch::Tensor ctx, torch::Tensor ctx_start, torch::Tensor seq_start,
                                 torch::Tensor lo, torch::Tensor hi, double scale) {
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == torch::kFloat32 && q.dim() == 3 && q.stride(2) == 1 &&
                  q.stride(1) == q.size(2) && q.stride(0) >= q.size(1) * q.size(2),
              "q must be a float32 CPU [rows, heads, head_dim] tensor, each row's heads contiguous");
  const int64_t R = q.size(0), H = q.size(1), D = q.size(2);
  TORCH_CHECK(D % 16 == 0 && D <= kAttnMaxDim, "head_dim must be a multiple of 16 up to ", kAttnMaxDim);
  TORCH_CHECK(k.device().is_cpu() && k.is_contiguous() && k.dim() == 3 && v.sizes() == k.sizes() &&
                  v.is_contiguous() && v.scalar_type() == k.scalar_type(),
              "the pool layers must be contiguous CPU [kv_heads, slots, row] tensors of one dtype");
  TORCH_CHECK(H % k.size(0) == 0, "query heads must be a multiple of KV heads");
  KVLayer kv;
  kv.type = kv_type(k, code, group, D);
  kv.group = group;
  kv.row_bytes = row_bytes(k);
  kv.slots = k.size(1);
  kv.k = static_cast<const uint8_t*>(k.data_ptr());
  kv.v = static_cast<const uint8_t*>(v.data_ptr());
  check_ints(ctx, -1, "ctx");
  check_ints(seq_start, -1, "seq_start");
  const int64_t S = seq_start.numel() - 1;
  TORCH_CHECK(S >= 0, "seq_start needs at least one entry");
  check_ints(ctx_start, S, "ctx_start");
  check_ints(lo, R, "lo");
  check_ints(hi, R, "hi");
  const int64_t *cp = ctx.data_ptr<int64_t>(), *cs = ctx_start.data_ptr<int64_t>(),
                *ss = seq_start.data_ptr<int64_t>(), *lp = lo.data_ptr<int64_t>(), *hp = hi.data_ptr<int64_t>();
  TORCH_CHECK(ss[0] == 0 && ss[S] == R, "seq_start must run from 0 to the number of rows");
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(ss[s] <= ss[s + 1], "seq_start must not decrease");
    int64_t most = 0;
    for (int64_t r = ss[s]; r < ss[s + 1]; ++r) {
      TORCH_CHECK(0 <= lp[r] && lp[r] <= hp[r], "each row needs 0 <= lo <= hi");
      most = std::max(most, hp[r]);
    }
    TORCH_CHECK(cs[s] >= 0 && cs[s] + most <= ctx.numel(), "a context runs past ctx");
    for (int64_t j = 0; j < most; ++j)
      TORCH_CHECK(cp[cs[s] + j] >= 0 && cp[cs[s] + j] < kv.slots, "context slot out of range");
  }
  auto out = torch::empty({R, H, D}, q.options());
  AttnRows a;
  a.q = q.data_ptr<float>();
  a.q_stride = q.stride(0);
  a.out = out.data_ptr<float>();
  a.out_stride = H * D;
  a.rows = R;
  a.heads = H;
  a.kv_heads = k.size(0);
  a.dim = D;
  a.ctx = cp;
  a.ctx_start = cs;
  a.seq_start = ss;
  a.seqs = S;
  a.lo = lp;
  a.hi = hp;
  a.scale = static_cast<float>(scale);
  flash_attention(a, kv);
  return out;
}

// int8 KV rows of x [n, head_dim] (float32), as KVFormat.encode makes them
torch::Tensor encode_kv_i8_op(torch::Tensor x, int64_t group) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.dim() == 2,
              "x must be a contiguous float32 CPU [n, head_dim] tensor");
  const int64_t D = x.size(1);
  TORCH_CHECK(group > 0 && group % 16 == 0 && D % group == 0, "a group of a multiple of 16 dividing head_dim");
  auto out = torch::empty({x.size(0), D + 2 * (D / group)}, x.options().dtype(torch::kUInt8));
  const float* xp = x.data_ptr<float>();
  uint8_t* op = out.data_ptr<uint8_t>();
  const int64_t rb = out.size(1);
  at::parallel_for(0, x.size(0), 64, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) encode_kv_row_i8(xp + i * D, D, group, op + i * rb);
  });
  return out;
}

// A weight matrix in one of the formats of kernels.h; keeps its tensors alive. A Stack's
// pieces are QWeights too; their views live in one shared vector that copies keep pointing at.
struct QWeight {
  WeightView view;
  torch::Tensor qs, d, m;
  std::vector<QWeight> parts;
  std::shared_ptr<std::vector<WeightView>> part_views;

  QWeight(int64_t fmt, int64_t n, int64_t k, torch::Tensor qs_, std::optional<torch::Tensor> d_,
          std::optional<torch::Tensor> m_)
      : qs(std::move(qs_)) {
    TORCH_CHECK(fmt >= 0 && fmt < static_cast<int64_t>(WFormat::Stack), "unknown weight format ", fmt);
    TORCH_CHECK(k % kBlock == 0 && n > 0, "weights need K a multiple of 32, got ", k);
    view.fmt = static_cast<WFormat>(fmt);
    view.n = n;
    view.k = k;
    TORCH_CHECK(qs.device().is_cpu() && qs.is_contiguous(), "weights must be contiguous on CPU");
    const int64_t nb = n * (k / kBlock);
    if (view.fmt == WFormat::F32) {
      TORCH_CHECK(qs.scalar_type() == torch::kFloat32 && qs.numel() == n * k, "F32: float [N, K]");
    } else if (const int64_t inputs = block_inputs(view.fmt)) {
      TORCH_CHECK(k % inputs == 0, "this format needs K a multiple of ", inputs, ", got ", k);
      view.row_bytes = k / inputs * block_bytes(view.fmt);
      TORCH_CHECK(qs.element_size() == 1 && qs.numel() == n * view.row_bytes,
                  "GGUF blocks: uint8 [N, ", view.row_bytes, "]");
    } else {
      const int64_t bytes = view.fmt == WFormat::Q8_0 ? n * k : n * k / 2;
      TORCH_CHECK(qs.element_size() == 1 && qs.numel() == bytes, "quantized data has wrong size");
      TORCH_CHECK(d_.has_value() && d_->scalar_type() == torch::kFloat32 && d_->is_contiguous() &&
                      d_->numel() == nb,
                  "scales: contiguous float [N, K/32]");
      d = *d_;
      view.d = d.data_ptr<float>();
    }
    if (view.fmt == WFormat::Q4_1) {
      TORCH_CHECK(m_.has_value() && m_->scalar_type() == torch::kFloat32 && m_->is_contiguous() &&
                      m_->numel() == nb,
                  "minimums: contiguous float [N, K/32]");
      m = *m_;
      view.m = m.data_ptr<float>();
    }
    view.qs = qs.data_ptr();
  }

  // The rows of `pieces` one after another (all quantized, one K).
  static QWeight stack(std::vector<QWeight> pieces) {
    TORCH_CHECK(!pieces.empty(), "a stack needs pieces");
    QWeight w;
    w.view.fmt = WFormat::Stack;
    w.view.k = pieces[0].view.k;
    w.part_views = std::make_shared<std::vector<WeightView>>();
    for (const auto& p : pieces) {
      TORCH_CHECK(p.view.fmt != WFormat::F32 && p.view.fmt != WFormat::Stack && p.view.k == w.view.k,
                  "stack pieces: quantized, not stacks, one K");
      w.view.n += p.view.n;
      w.part_views->push_back(p.view);
    }
    w.parts = std::move(pieces);
    w.view.parts = w.part_views->data();
    w.view.num_parts = static_cast<int64_t>(w.part_views->size());
    return w;
  }

 private:
  QWeight() = default;
};

torch::Tensor qgemm_op(torch::Tensor x, const QWeight& w, std::optional<torch::Tensor> out, bool int8,
                       bool alone) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.dim() == 2 &&
                  x.size(1) == w.view.k,
              "x must be contiguous float32 [M, K]");
  const bool accumulate = out.has_value();
  torch::Tensor y = accumulate ? *out : torch::empty({x.size(0), w.view.n}, x.options());
  TORCH_CHECK(y.scalar_type() == torch::kFloat32 && y.is_contiguous() && y.dim() == 2 &&
                  y.size(0) == x.size(0) && y.size(1) == w.view.n,
              "out must be contiguous float32 [M, N]");
  qgemm(x.data_ptr<float>(), x.size(0), w.view, y.data_ptr<float>(), accumulate, int8, alone);
  return y;
}

// The plain C++ dequantization of a GGUF block format, whatever the build (for the tests).
torch::Tensor dequantize_reference_op(const QWeight& w) {
  TORCH_CHECK(block_inputs(w.view.fmt) > 0, "a GGUF block format only");
  auto out = torch::empty({w.view.n, w.view.k}, torch::kFloat32);
  for (int64_t r = 0; r < w.view.n; ++r) dequant_gguf_row(w.view, r, out.data_ptr<float>() + r * w.view.k, true);
  return out;
}

torch::Tensor dequantize_op(const QWeight& w, std::optional<torch::Tensor> rows) {
  const int64_t K = w.view.k;
  if (!rows.has_value()) {
    auto out = torch::empty({w.view.n, K}, torch::kFloat32);
    float* o = out.data_ptr<float>();
    at::parallel_for(0, w.view.n, 64, [&](int64_t b, int64_t e) { dequant_rows(w.view, b, e - b, o + b * K); });
    return out;
  }
  TORCH_CHECK(rows->scalar_type() == torch::kInt64 && rows->dim() == 1, "rows: int64 [R]");
  auto idx = rows->contiguous();
  auto out = torch::empty({idx.numel(), K}, torch::kFloat32);
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < idx.numel(); ++i) {
    TORCH_CHECK(ip[i] >= 0 && ip[i] < w.view.n, "row index out of range");
    dequant_rows(w.view, ip[i], 1, out.data_ptr<float>() + i * K);
  }
  return out;
}

// The native decoder: holds the model's tensors, checks every step's inputs.
class Decoder {
 public:
  Decoder(int64_t heads, int64_t kv_heads, int64_t dim, double eps, std::vector<QWeight> qkv,
          std::vector<QWeight> o, std::vector<QWeight> gate_up, std::vector<QWeight> down,
          std::vector<torch::Tensor> norms, std::vector<std::optional<torch::Tensor>> qkv_bias,
          QWeight embed, QWeight lm_head, torch::Tensor cos, torch::Tensor sin, double scale,
          std::vector<torch::Tensor> qk_norms, std::vector<torch::Tensor> out_norms,
          std::vector<int64_t> windows, std::optional<torch::Tensor> local_cos,
          std::optional<torch::Tensor> local_sin, double embed_scale, bool gelu)
      : keep_{qkv, o, gate_up, down, {embed, lm_head}}, tensors_(norms), cos_(cos), sin_(sin) {
    const int64_t L = static_cast<int64_t>(qkv.size());
    w_.layers = L;
    w_.heads = heads;
    w_.kv_heads = kv_heads;
    w_.dim = dim;
    w_.eps = static_cast<float>(eps);
    w_.scale = static_cast<float>(scale);
    w_.embed_scale = static_cast<float>(embed_scale);
    w_.gelu = gelu;
    w_.hidden = embed.view.k;
    w_.inter = down.at(0).view.k;
    w_.embed = embed.view;
    w_.lm_head = lm_head.view;
    const int64_t qkv_n = (heads + 2 * kv_heads) * dim;
    TORCH_CHECK(heads % kv_heads == 0 && dim % 16 == 0 && dim <= kAttnMaxDim && w_.hidden % 32 == 0,
                "unsupported head shape");
    TORCH_CHECK((int64_t)o.size() == L && (int64_t)gate_up.size() == L && (int64_t)down.size() == L &&
                    (int64_t)qkv_bias.size() == L && (int64_t)norms.size() == 2 * L + 1,
                "one of each weight per layer, two norms per layer and the final norm");
    for (int64_t l = 0; l < L; ++l) {
      TORCH_CHECK(qkv[l].view.n == qkv_n && qkv[l].view.k == w_.hidden && o[l].view.n == w_.hidden &&
                      o[l].view.k == heads * dim && gate_up[l].view.n == 2 * w_.inter &&
                      gate_up[l].view.k == w_.hidden && down[l].view.n == w_.hidden &&
                      down[l].view.k == w_.inter,
                  "layer ", l, ": weight shapes do not fit the model");
      w_.qkv.push_back(qkv[l].view);
      w_.o.push_back(o[l].view);
      w_.gate_up.push_back(gate_up[l].view);
      w_.down.push_back(down[l].view);
      const float* bias = nullptr;
      if (qkv_bias[l].has_value()) {
        const auto& t = *qkv_bias[l];
        TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.numel() == qkv_n,
                    "qkv bias: contiguous float32 [", qkv_n, "]");
        tensors_.push_back(t);
        bias = t.data_ptr<float>();
      }
      w_.qkv_bias.push_back(bias);
    }
    for (const auto& n : norms) {
      TORCH_CHECK(n.scalar_type() == torch::kFloat32 && n.is_contiguous() && n.numel() == w_.hidden,
                  "norm weights: contiguous float32 [hidden]");
      w_.norms.push_back(n.data_ptr<float>());
    }
    TORCH_CHECK(lm_head.view.k == w_.hidden, "LM head: [vocab, hidden]");
    TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && cos.is_contiguous() && cos.dim() == 2 &&
                    cos.size(1) == dim && sin.sizes() == cos.sizes() && sin.is_contiguous() &&
                    sin.scalar_type() == torch::kFloat32,
                "RoPE tables: contiguous float32 [positions, head_dim]");
    w_.max_pos = cos.size(0);
    w_.cos = cos.data_ptr<float>();
    w_.sin = sin.data_ptr<float>();
    extras(L, dim, qk_norms, out_norms, windows, local_cos, local_sin);
  }

  // An int8 pool's float layers: their pools (the main pool's slots) and which layers they are
  void float_pools(DecodeBatch& batch, const torch::Tensor& fk, const torch::Tensor& fv, const torch::Tensor& layers,
                   int64_t code, const torch::Tensor& k_pool) const {
    check_ints(layers, -1, "f_layers");
    TORCH_CHECK(fk.dim() == 4 && fk.size(0) == layers.numel() && fk.size(1) == w_.kv_heads &&
                    fk.size(2) == k_pool.size(2) && fk.is_contiguous() && fv.is_contiguous() && fv.sizes() == fk.sizes() &&
                    fv.scalar_type() == fk.scalar_type() && fk.device().is_cpu(),
                "float layer pools: contiguous CPU [float layers, kv_heads, slots, row], the main pool's slots");
    batch.f_k_pool = fk.data_ptr();
    batch.f_v_pool = fv.data_ptr();
    batch.f_type = kv_type(fk, code, 0, w_.dim);
    TORCH_CHECK(batch.f_type != KVType::I8, "float layer pools hold float values");
    batch.f_row_bytes = row_bytes(fk);
    batch.is_float.assign(w_.layers, 0);
    const int64_t* lp = layers.data_ptr<int64_t>();
    for (int64_t i = 0; i < layers.numel(); ++i) {
      TORCH_CHECK(lp[i] >= 0 && lp[i] < w_.layers && !batch.is_float[lp[i]], "f_layers: distinct layer indices");
      batch.is_float[lp[i]] = 1;
    }
  }

  torch::Tensor forward(torch::Tensor ids, torch::Tensor positions, torch::Tensor out_slots,
                        torch::Tensor ctx, torch::Tensor lens, torch::Tensor k_pool, torch::Tensor v_pool,
                        int64_t kv_code, int64_t kv_group, int64_t sequences,
                        std::optional<torch::Tensor> w_out_slots, std::optional<torch::Tensor> w_ctx,
                        std::optional<torch::Tensor> w_k_pool, std::optional<torch::Tensor> w_v_pool,
                        std::optional<torch::Tensor> f_k_pool, std::optional<torch::Tensor> f_v_pool,
                        std::optional<torch::Tensor> f_layers, int64_t f_kv_code,
                        std::optional<torch::Tensor> key_order, std::optional<torch::Tensor> key_scale) {
    const int64_t B = ids.numel();
    TORCH_CHECK(sequences == -1 || (sequences >= 1 && sequences <= B),
                "sequences: -1 (one per row) or from 1 to the number of rows");
    for (const auto* t : {&ids, &positions, &out_slots, &lens})
      TORCH_CHECK(t->scalar_type() == torch::kInt64 && t->is_contiguous() && t->numel() == B && t->device().is_cpu(),
                  "ids, positions, out_slots, lens: contiguous int64 [batch] on CPU");
    TORCH_CHECK(ctx.scalar_type() == torch::kInt64 && ctx.is_contiguous() && ctx.dim() == 2 && ctx.size(0) == B,
                "ctx: contiguous int64 [batch, max_len]");
    const bool apart = w_k_pool.has_value();
    int64_t window_layers = 0;
    for (int64_t win : w_.windows) window_layers += win > 0;
    TORCH_CHECK(!apart || (w_v_pool && w_ctx && w_out_slots && window_layers > 0),
                "window pools: k, v, context and output slots together, for a model with windows");
    const bool floats = f_k_pool.has_value();
    TORCH_CHECK(!floats || (f_v_pool && f_layers && !apart), "float layer pools: k, v and layers together, no window pools");
    const int64_t float_layers = floats ? f_layers->numel() : 0;
    TORCH_CHECK(k_pool.dim() == 4 && k_pool.size(0) == w_.layers - (apart ? window_layers : 0) - float_layers &&
                    k_pool.size(1) == w_.kv_heads && k_pool.is_contiguous() && v_pool.is_contiguous() &&
                    v_pool.sizes() == k_pool.sizes() && v_pool.scalar_type() == k_pool.scalar_type() &&
                    k_pool.device().is_cpu(),
                "pools: contiguous CPU [layers, kv_heads, slots, row] of one dtype");
    DecodeBatch batch;
    batch.size = B;
    batch.ids = ids.data_ptr<int64_t>();
    batch.positions = positions.data_ptr<int64_t>();
    batch.out_slots = out_slots.data_ptr<int64_t>();
    batch.ctx = ctx.data_ptr<int64_t>();
    batch.ctx_stride = ctx.size(1);
    batch.lens = lens.data_ptr<int64_t>();
    batch.k_pool = k_pool.data_ptr();
    batch.v_pool = v_pool.data_ptr();
    batch.slots = k_pool.size(2);
    batch.kv_type = kv_type(k_pool, kv_code, kv_group, w_.dim);
    batch.kv_group = kv_group;
    batch.row_bytes = row_bytes(k_pool);
    batch.sequences = sequences == -1 ? B : sequences;
    if (floats) float_pools(batch, *f_k_pool, *f_v_pool, *f_layers, f_kv_code, k_pool);
    TORCH_CHECK(key_order.has_value() == key_scale.has_value(), "key_order and key_scale together");
    if (key_order) {
      const auto &o = *key_order, &s = *key_scale;
      TORCH_CHECK(batch.kv_type == KVType::I8 && o.scalar_type() == torch::kInt64 && o.is_contiguous() &&
                      o.device().is_cpu() && o.dim() == 3 && o.size(0) == w_.layers && o.size(1) == w_.kv_heads &&
                      o.size(2) == w_.dim && o.min().item<int64_t>() >= 0 && o.max().item<int64_t>() < w_.dim,
                  "key_order: an int8 pool's contiguous int64 [layers, kv_heads, head_dim] of channel indices");
      TORCH_CHECK(s.scalar_type() == torch::kFloat32 && s.is_contiguous() && s.sizes() == o.sizes(),
                  "key_scale: contiguous float32, key_order's shape");
      batch.key_order = o.data_ptr<int64_t>();
      batch.key_scale = s.data_ptr<float>();
    }
    if (apart) {
      const auto &wk = *w_k_pool, &wv = *w_v_pool, &wc = *w_ctx, &wo = *w_out_slots;
      TORCH_CHECK(wk.dim() == 4 && wk.size(0) == window_layers && wk.size(1) == w_.kv_heads &&
                      wk.size(3) == k_pool.size(3) && wk.is_contiguous() && wv.is_contiguous() &&
                      wv.sizes() == wk.sizes() && wk.scalar_type() == k_pool.scalar_type() &&
                      wv.scalar_type() == k_pool.scalar_type() && wk.device().is_cpu(),
                  "window pools: contiguous CPU [window layers, kv_heads, slots, row], the pool's format");
      TORCH_CHECK(wc.sizes() == ctx.sizes() && wc.scalar_type() == torch::kInt64 && wc.is_contiguous() &&
                      wo.numel() == B && wo.scalar_type() == torch::kInt64 && wo.is_contiguous(),
                  "window slots: int64 of the shapes of ctx and out_slots");
      batch.w_k_pool = wk.data_ptr();
      batch.w_v_pool = wv.data_ptr();
      batch.w_slots = wk.size(2);
      batch.w_ctx = wc.data_ptr<int64_t>();
      batch.w_out_slots = wo.data_ptr<int64_t>();
      for (int64_t b = 0; b < B; ++b) {
        TORCH_CHECK(batch.w_out_slots[b] >= 0 && batch.w_out_slots[b] < batch.w_slots, "window output slot out of range");
        for (int64_t j = 0; j < batch.lens[b]; ++j) {
          const int64_t slot = batch.w_ctx[b * batch.ctx_stride + j];
          TORCH_CHECK(slot >= 0 && slot < batch.w_slots, "window context slot out of range");
        }
      }
    }
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(batch.ids[b] >= 0 && batch.ids[b] < w_.embed.n, "token id out of range");
      TORCH_CHECK(batch.positions[b] >= 0 && batch.positions[b] < w_.max_pos, "position out of range");
      TORCH_CHECK(batch.out_slots[b] >= 0 && batch.out_slots[b] < batch.slots, "output slot out of range");
      TORCH_CHECK(batch.lens[b] >= 1 && batch.lens[b] <= ctx.size(1), "context length out of range");
      for (int64_t j = 0; j < batch.lens[b]; ++j) {
        const int64_t slot = batch.ctx[b * batch.ctx_stride + j];
        TORCH_CHECK(slot >= 0 && slot < batch.slots, "context slot out of range");
      }
    }
    auto logits = torch::empty({B, w_.lm_head.n}, torch::kFloat32);
    decode_step(w_, batch, scratch_, logits.data_ptr<float>());
    return logits;
  }

 private:
  // Qwen3's and Gemma 3's parts, each empty (or none) where the model has none
  void extras(int64_t L, int64_t dim, const std::vector<torch::Tensor>& qk_norms,
              const std::vector<torch::Tensor>& out_norms, std::vector<int64_t> windows,
              const std::optional<torch::Tensor>& local_cos,
              const std::optional<torch::Tensor>& local_sin) {
    TORCH_CHECK(qk_norms.empty() || (int64_t)qk_norms.size() == 2 * L, "q and k norms: two per layer, or none");
    TORCH_CHECK(out_norms.empty() || (int64_t)out_norms.size() == 2 * L, "output norms: two per layer, or none");
    for (const auto& n : qk_norms) {
      TORCH_CHECK(n.scalar_type() == torch::kFloat32 && n.is_contiguous() && n.numel() == dim,
                  "q and k norm weights: contiguous float32 [head_dim]");
      tensors_.push_back(n);
      w_.qk_norms.push_back(n.data_ptr<float>());
    }
    for (const auto& n : out_norms) {
      TORCH_CHECK(n.scalar_type() == torch::kFloat32 && n.is_contiguous() && n.numel() == w_.hidden,
                  "output norm weights: contiguous float32 [hidden]");
      tensors_.push_back(n);
      w_.out_norms.push_back(n.data_ptr<float>());
    }
    if (windows.empty()) windows.assign(L, 0);
    TORCH_CHECK((int64_t)windows.size() == L, "windows: one per layer");
    for (int64_t win : windows) TORCH_CHECK(win >= 0, "windows: 0 (all keys) or positive");
    w_.windows = windows;
    TORCH_CHECK(local_cos.has_value() == local_sin.has_value(), "local RoPE tables: both or neither");
    if (local_cos.has_value()) {
      TORCH_CHECK(local_cos->sizes() == cos_.sizes() && local_sin->sizes() == cos_.sizes() &&
                      local_cos->scalar_type() == torch::kFloat32 && local_sin->scalar_type() == torch::kFloat32 &&
                      local_cos->is_contiguous() && local_sin->is_contiguous(),
                  "local RoPE tables: contiguous float32, shaped as the global ones");
      tensors_.push_back(*local_cos);
      tensors_.push_back(*local_sin);
      w_.local_cos = local_cos->data_ptr<float>();
      w_.local_sin = local_sin->data_ptr<float>();
    }
  }

  std::vector<std::vector<QWeight>> keep_;
  std::vector<torch::Tensor> tensors_;
  torch::Tensor cos_, sin_;
  DecoderWeights w_;
  DecoderScratch scratch_;
};

// --- row-wise layer pieces for the prefill path, rows split over threads ---------------
void check_rows(const torch::Tensor& x, int64_t width, const char* what) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2 &&
                  x.is_contiguous() && x.size(1) == width && width % 8 == 0,
              what, " must be a contiguous float32 CPU [rows, ", width, "] tensor");
}

torch::Tensor rms_norm_op(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(w.scalar_type() == torch::kFloat32 && w.is_contiguous() && w.dim() == 1,
              "the norm weight must be a contiguous float32 vector");
  check_rows(x, w.size(0), "x");
  auto out = torch::empty_like(x);
  const int64_t dim = x.size(1);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, x.size(0), 16, [&](int64_t b, int64_t e) {
    rms_norm_rows(xp + b * dim, wp, e - b, dim, static_cast<float>(eps), op + b * dim);
  });
  return out;
}

// RoPE in place on the first `heads` head vectors of each row of qkv [T, width] (q, then k),
// row t at positions[t] of the [max_pos, head_dim] tables.
void rope_op(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
             int64_t heads, int64_t head_dim) {
  TORCH_CHECK(head_dim % 16 == 0 && heads > 0, "head_dim must be a multiple of 16");
  check_rows(qkv, qkv.size(1), "qkv");
  TORCH_CHECK(heads * head_dim <= qkv.size(1), "more heads than the row holds");
  for (const auto* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->is_contiguous() && t->dim() == 2 &&
                    t->size(1) == head_dim && t->sizes() == cos.sizes(),
                "the RoPE tables must be contiguous float32 [max_pos, head_dim]");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.is_contiguous() &&
                  positions.numel() == qkv.size(0),
              "positions must be a contiguous int64 [rows] tensor");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < positions.numel(); ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "position out of the RoPE table");
  const int64_t width = qkv.size(1);
  float* base = qkv.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  at::parallel_for(0, qkv.size(0), 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t)
      rope_row(base + t * width, heads, head_dim, cp + pos[t] * head_dim, sp + pos[t] * head_dim);
  });
}

torch::Tensor silu_mul_op(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 16 == 0, "gate_up must be [rows, 2 * inter]");
  check_rows(gate_up, gate_up.size(1), "gate_up");
  const int64_t inter = gate_up.size(1) / 2;
  auto out = torch::empty({gate_up.size(0), inter}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, gate_up.size(0), 16, [&](int64_t b, int64_t e) {
    silu_mul_rows(gp + b * 2 * inter, e - b, inter, op + b * inter);
  });
  return out;
}

// Each row's argmax (torch.argmax(x, -1)'s answer: first index on ties, NaN the largest).
torch::Tensor argmax_op(torch::Tensor x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2 &&
                  x.is_contiguous() && x.size(1) > 0,
              "x must be a contiguous float32 CPU [rows, n] tensor with n > 0");
  auto out = torch::empty({x.size(0)}, x.options().dtype(torch::kInt64));
  const int64_t n = x.size(1);
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, x.size(0), 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) op[r] = argmax_row(xp + r * n, n);
  });
  return out;
}

// How many threads at::parallel_for really ran `n` single-item chunks on: a build that lost
// OpenMP (the pragma in ATen's inline header needs -fopenmp) runs every kernel on one.
int64_t parallel_threads(int64_t n) {
  std::mutex mu;
  std::set<int> ids;
  at::parallel_for(0, n, 1, [&](int64_t, int64_t) {
    std::lock_guard<std::mutex> hold(mu);
    ids.insert(at::get_thread_num());
  });
  return static_cast<int64_t>(ids.size());
}

}  // namespace rs

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  // The kernels touch no Python object, so they let go of the GIL: the engine process's I/O
  // threads (storage reads and writes, KV transfer, KV events) keep working during a step.
  using nogil = py::call_guard<py::gil_scoped_release>;
  m.def("flash_attention", &rs::flash_attention_op, "rows of q over ranges of pool slots", py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("kv_code"), py::arg("kv_group"), py::arg("ctx"), py::arg("ctx_start"),
        py::arg("seq_start"), py::arg("lo"), py::arg("hi"), py::arg("scale"), nogil());
  m.def("encode_kv_i8", &rs::encode_kv_i8_op, "int8 KV rows of float32 values", nogil());
  py::class_<rs::QWeight>(m, "QWeight")
      .def(py::init<int64_t, int64_t, int64_t, torch::Tensor, std::optional<torch::Tensor>,
                    std::optional<torch::Tensor>>())
      .def_static("stack", &rs::QWeight::stack, "the rows of several weights, one after another")
      .def_property_readonly("shape", [](const rs::QWeight& w) { return std::make_pair(w.view.n, w.view.k); })
      .def_property_readonly("int8_lanes", [](const rs::QWeight& w) { return rs::int8_lanes_ok(w.view); },
                             "whether qgemm(int8=True) rounds x to int8 for this weight (8+ rows)");
  m.def("dequantize_reference", &rs::dequantize_reference_op, "a GGUF block format's plain C++ dequantization",
        nogil());
  m.def("qgemm", &rs::qgemm_op, "x @ W^T (added into out, when given)", py::arg("x"), py::arg("w"),
        py::arg("out") = py::none(), py::arg("int8") = false, py::arg("alone") = false, nogil());
  m.def("use_int8_lanes", &rs::use_int8_lanes, "whether batches of 8+ rows round x to int8 (set: 0 off, 1 on, -1 ask)",
        py::arg("set") = -1);
  m.def("dequantize", &rs::dequantize_op, "W (or some of its rows) as float32", py::arg("w"),
        py::arg("rows") = py::none(), nogil());
  py::class_<rs::Decoder>(m, "Decoder")
      .def(py::init<int64_t, int64_t, int64_t, double, std::vector<rs::QWeight>, std::vector<rs::QWeight>,
                    std::vector<rs::QWeight>, std::vector<rs::QWeight>, std::vector<torch::Tensor>,
                    std::vector<std::optional<torch::Tensor>>, rs::QWeight, rs::QWeight, torch::Tensor,
                    torch::Tensor, double, std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                    std::vector<int64_t>, std::optional<torch::Tensor>, std::optional<torch::Tensor>,
                    double, bool>(),
           py::arg("heads"), py::arg("kv_heads"), py::arg("dim"), py::arg("eps"), py::arg("qkv"),
           py::arg("o"), py::arg("gate_up"), py::arg("down"), py::arg("norms"), py::arg("qkv_bias"),
           py::arg("embed"), py::arg("lm_head"), py::arg("cos"), py::arg("sin"), py::arg("scale"),
           py::arg("qk_norms") = std::vector<torch::Tensor>{},
           py::arg("out_norms") = std::vector<torch::Tensor>{},
           py::arg("windows") = std::vector<int64_t>{}, py::arg("local_cos") = py::none(),
           py::arg("local_sin") = py::none(), py::arg("embed_scale") = 1.0, py::arg("gelu") = false)
      .def("forward", &rs::Decoder::forward, py::arg("ids"), py::arg("positions"), py::arg("out_slots"),
           py::arg("ctx"), py::arg("lens"), py::arg("k_pool"), py::arg("v_pool"), py::arg("kv_code"),
           py::arg("kv_group"), py::arg("sequences") = -1,
           py::arg("w_out_slots") = py::none(), py::arg("w_ctx") = py::none(),
           py::arg("w_k_pool") = py::none(), py::arg("w_v_pool") = py::none(),
           py::arg("f_k_pool") = py::none(), py::arg("f_v_pool") = py::none(), py::arg("f_layers") = py::none(),
           py::arg("f_kv_code") = 0, py::arg("key_order") = py::none(), py::arg("key_scale") = py::none(),
           nogil());
  m.def("rms_norm", &rs::rms_norm_op, "RMSNorm of each row", nogil());
  m.def("rope_", &rs::rope_op, "rotate-half RoPE in place on each row's first heads", nogil());
  m.def("silu_mul", &rs::silu_mul_op, "SiLU(gate) * up of rows laid out [gate | up]", nogil());
  m.def("argmax", &rs::argmax_op, "each row's argmax, as torch.argmax(x, -1)", nogil());
  m.def("parallel_threads", &rs::parallel_threads, "threads at::parallel_for spreads n items over",
        nogil());
}
