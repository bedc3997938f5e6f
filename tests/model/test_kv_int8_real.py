"""int8 KV against float KV on a real model (slow: Qwen2.5-Coder-0.5B-Instruct Q4_K_M).

Qwen2 and Qwen2.5 have very large key biases in some layers, the hard case for int8 keys:
``kv_float_layers auto`` keeps those layers (0, 1, 2 and 8 of this model) in float32.
Greedy answers to 8 chat prompts with ``kv_cache_dtype int8`` against the same engine with
float32 KV: where one parts, the first token that differs was a near tie (< 0.05 nats) of the
float run's two best tokens, and at least 7 of 8 are the same (measured: 7/8, parting at a
gap of 0.027 nats; with every layer int8, 6/8). Prints the measured agreement.
"""

from __future__ import annotations

import pytest

from radixserve.model.registry import KNOWN_MODELS, installed_path

QWEN_05B = KNOWN_MODELS["qwen2.5-coder-0.5b"]
CHAT = [
    "Write a Python function that checks whether a number is prime.",
    "What is the difference between a list and a tuple in Python?",
    "Explain recursion in one sentence.",
    "How do I read a file line by line in Python?",
    "Write a SQL query that counts the orders per customer.",
    "What does the `git rebase` command do?",
    "Write a bash one-liner that finds the ten largest files in a directory.",
    "Explain what a hash map is and when to use one.",
]


def greedy(path, kv_cache_dtype: str) -> tuple[list[list[int]], list]:
    from radixserve.config import EngineConfig
    from radixserve.engine import LLM, SamplingParams

    config = EngineConfig.from_options(model=str(path), kv_cache_dtype=kv_cache_dtype,
                                       load_progress=False)  # fmt: skip
    params = SamplingParams(max_tokens=32, temperature=0.0, logprobs=2)
    with LLM.from_config(config) as llm:
        outs = llm.chat([[{"role": "user", "content": q}] for q in CHAT], params)
    return [o.token_ids for o in outs], [o.logprobs for o in outs]


@pytest.mark.slow
def test_qwen_05b_int8_kv_answers_as_float_kv():
    path = installed_path(QWEN_05B)
    if path is None:
        pytest.skip(f"{QWEN_05B.name} is not installed (`radixserve pull {QWEN_05B.name}`)")
    reference, ref_logprobs = greedy(path, "auto")
    int8, _ = greedy(path, "int8")
    same, gaps = 0, []
    for ours, ref, logprobs in zip(int8, reference, ref_logprobs, strict=True):
        if ours == ref:
            same += 1
            continue
        k = next(i for i, (a, b) in enumerate(zip(ours, ref, strict=False)) if a != b)
        (_, best_lp), (_, second_lp) = logprobs[k].top[:2]
        gaps.append((k, round(best_lp - second_lp, 3)))
    print(f"int8 KV: {same}/{len(CHAT)} greedy answers equal float KV's; partings {gaps}")
    assert same >= 7, f"{same}/{len(CHAT)} answers equal; partings (token, nats) {gaps}"
    assert all(gap < 0.05 for _, gap in gaps), f"a parting away from a near tie: {gaps}"


@pytest.mark.slow
def test_qwen_05b_key_order_rounds_layer_0_keys_finer():
    """Layer 0's keys (key RMS 35, a few channels near 150) of a real prompt, stored with the
    model's key order (its large pairs apart, divided by powers of two) and without: the
    error of the keys read back, and of their dot products with the layer's queries."""
    import torch

    import radixserve.model.llama as llama
    from radixserve.cache import KVPool
    from radixserve.model import build_forward_batch, load_model

    path = installed_path(QWEN_05B)
    if path is None:
        pytest.skip(f"{QWEN_05B.name} is not installed (`radixserve pull {QWEN_05B.name}`)")
    loaded = load_model(str(path), dtype="float32", progress=False)
    model = loaded.model
    assert model.key_order is not None
    ids = loaded.tokenizer.encode(" ".join(CHAT))
    captured, attend = {}, llama.paged_attention

    def hook(layer, q, k, v, batch, pool, scale, window=None):
        if layer == 0:
            captured["qk"] = (q.clone(), k.clone())
        return attend(layer, q, k, v, batch, pool, scale, window)

    shape = model.kv_shape()
    errors = {}
    for name, fmt in (
        ("ordered", shape.int8_format),
        ("plain", shape.int8_format.with_key_order(None)),
    ):
        pool = KVPool(shape.with_format(fmt), len(ids))
        item = (torch.tensor(ids), 0, torch.arange(len(ids)), False)
        llama.paged_attention = hook
        try:
            with torch.inference_mode():
                model.forward(build_forward_batch([], [item], model.device, pool.pad_slot), pool)
        finally:
            llama.paged_attention = attend
        q, k = captured["qk"]
        got = pool.gather(0, torch.arange(len(ids)))[0].transpose(0, 1)  # [n, kv_heads, dim]
        rep = q.shape[1] // k.shape[1]
        scores = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(rep, 1))
        back = torch.einsum("qhd,khd->hqk", q, got.repeat_interleave(rep, 1))
        errors[name] = (float((got - k).norm() / k.norm()),
                        float((back - scores).norm() / scores.norm()))  # fmt: skip
    print(f"layer 0, relative error (keys, scores): {errors}")
    # measured: keys 0.45% against 0.58%, scores 0.15% against 0.37%
    assert errors["ordered"][0] < 0.9 * errors["plain"][0], errors
    assert errors["ordered"][1] < 0.5 * errors["plain"][1], errors
