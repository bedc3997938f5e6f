"""int8 keys stored in a channel order (``KeyOrder``) on a Qwen2-architecture model whose layer 1
has a few very large key-bias channels, as Qwen2.5's first layers do.

The order comes from the weights (``kv_layers.key_order``): in that layer the large pairs are
stored first, side by side, the other layers as computed. It lowers the rounding error of
that layer's keys; the prefill kernels, the native decoder and the PyTorch path all read the
ordered rows alike (queries in the stored order), and read something else without the order.
"""

from __future__ import annotations

import pytest
import torch

from radixserve.cache import KVPool
from radixserve.model import build_forward_batch, load_model, native
from radixserve.model.kv_layers import key_order
from testing.tiny_model import save_tiny_hf_model

PROMPT = [17, 93, 210, 77, 5, 401, 312, 48, 120, 6, 415, 400, 27, 333, 91, 12]
# key-bias channels made large in layer 1: pairs 0, 5 and 4 of head 0, pair 8 of head 1
BIG = [0, 5, 20, 40]


@pytest.fixture(scope="module")
def biased(tmp_path_factory):
    path = tmp_path_factory.mktemp("biased")
    hf = save_tiny_hf_model(path / "a", "Qwen2Config", seed=3, hidden_size=128, vocab_size=512,
                            intermediate_size=256, num_hidden_layers=3)  # fmt: skip
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            layer.self_attn.k_proj.bias.normal_(0, 1.0)
            if i == 1:
                layer.self_attn.k_proj.bias[BIG] += 150.0
    hf.save_pretrained(path / "b")
    return load_model(str(path / "b"), dtype="float32", progress=False).model


def test_the_order_puts_the_large_bias_pairs_together(biased, tiny_loaded):
    order = key_order(biased)
    assert order is not None and biased.kv_shape().key_order == order
    assert biased.kv_shape().int8_format.name == f"int8g16k{order.digest}"
    perm, identity = order.perm, torch.arange(32)
    assert torch.equal(perm[0], identity.expand(2, 32)) and torch.equal(perm[2], perm[0])
    assert set(perm[1, 0, :6].tolist()) == {0, 16, 5, 21, 4, 20}  # pairs 0, 5, 4: one group
    assert perm[1, 1, :2].tolist() == [8, 24]
    # each large pair divided by the power of two bringing its bias near the median pair's
    scale = order.scale  # stored order
    assert bool((scale[1, 0, :6] >= 32).all()) and bool((scale[1, 1, :2] >= 32).all())
    assert bool((scale[0] == 1).all()) and bool((scale[1, 0, 6:] <= 2).all())
    assert key_order(tiny_loaded.model) is None  # Llama: no key biases, keys as computed


def prefill(model, shape, ops_on: bool, monkeypatch) -> tuple[KVPool, torch.Tensor]:
    """A 12-token prompt in two chunks, then 4 decode steps; the pool and every logits row."""
    pool = KVPool(shape, 64)
    out = []
    with monkeypatch.context() as patch:
        if not ops_on:
            patch.setattr(native, "paged_ops", lambda: None)
        for lo, hi in ((0, 7), (7, 12)):
            chunk = (torch.tensor(PROMPT[lo:hi]), lo, torch.arange(hi), True)
            out.append(model.forward(build_forward_batch([], [chunk], model.device, 64), pool))
        for pos in range(12, 16):
            step = [(PROMPT[pos], pos, torch.arange(pos + 1))]
            out.append(model.forward(build_forward_batch(step, [], model.device, 64), pool))
    model._native = None
    return pool, torch.cat(out)


def test_ordered_keys_round_less_and_every_path_reads_them_alike(biased, monkeypatch):
    if native.paged_ops() is None:
        pytest.skip("the native kernels did not build on this machine")
    shape = biased.kv_shape()
    ordered, plain = (
        shape.with_format(shape.int8_format),
        shape.with_format(shape.int8_format.with_key_order(None)),
    )
    exact, _ = prefill(biased, shape, True, monkeypatch)
    fast_pool, fast = prefill(biased, ordered, True, monkeypatch)
    slow_pool, slow = prefill(biased, ordered, False, monkeypatch)
    plain_pool, unordered = prefill(biased, plain, True, monkeypatch)
    # kernels (prefill and the native decoder) and the PyTorch path: the same function
    assert (fast - slow).abs().max() < 1e-4 * slow.abs().max()
    slots = torch.arange(16)
    for layer in range(3):  # the same rows, read back alike
        torch.testing.assert_close(fast_pool.gather(layer, slots), slow_pool.gather(layer, slots),
                                   atol=0.02, rtol=0.01)  # fmt: skip
    assert not torch.allclose(fast, unordered, atol=1e-4)  # the order is applied
    # layer 1's keys, read back in the model's order: the channels the order groups apart
    # from the large pairs (head 0's second stored group; in the computed order each group
    # holds a large pair, which sets its scale) round far less with the order
    keys = exact.gather(1, slots)[0][0].clone()
    apart = key_order(biased).perm[1, 0, 16:]
    err = [float((p.gather(1, slots)[0][0] - keys)[:, apart].norm())
           for p in (fast_pool, plain_pool)]  # fmt: skip
    assert err[0] < 0.1 * err[1], err
