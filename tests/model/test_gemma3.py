"""Gemma 3 and Qwen3 against transformers, from HF directories and GGUF files.

Tiny random models (random norm weights too, so Gemma's ``1 + weight`` convention and the
q/k norms matter), logits compared at every position. Gemma 3's local layers have a window
of 5 tokens here and the prompts are 24 tokens long, so the sliding window decides the
output; prefill runs from scratch, in chunks after a cached prefix (chunks longer and
shorter than the window), in decode steps, and mixed in one step, through the native
kernels and PyTorch only. The two RoPE bases and the attention scale differ from their
defaults so that mixing them up fails.
"""

from __future__ import annotations

import gguf
import pytest
import torch
from test_model_numerics import Runner, assert_close, reference_logits

from radixserve.model import load_model
from testing.gguf_writer import write_llama_gguf

PROMPT = [17, 93, 210, 77, 5, 401, 312, 48, 120, 6, 415, 400, 27, 333, 91, 12,
          250, 3, 64, 199, 8, 440, 71, 300]  # fmt: skip
WINDOW = 5
GEMMA = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=7,  # local 0-4, global 5, local 6
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    query_pre_attn_scalar=48,
    sliding_window=WINDOW,
    max_position_embeddings=256,
    rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
    },
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    bos_token_id=2,
    eos_token_id=1,
    pad_token_id=0,
)
QWEN3 = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=256,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


def make_hf(path, config_cls: str, seed: int = 0, **overrides):
    import transformers

    cfg = getattr(transformers, config_cls)(**overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.15 if p.dim() > 1 else 0.3)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module", params=["gemma3", "qwen3"])
def pair(request, tmp_path_factory):
    """(transformers model, our model loaded from its HF directory)."""
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "gemma3":
        hf = make_hf(path, "Gemma3TextConfig", **GEMMA)
    else:
        hf = make_hf(path, "Qwen3Config", **QWEN3)
    return hf, load_model(str(path), dtype="float32", progress=False).model


def test_config_reads_the_local_layers(pair):
    hf, model = pair
    c = model.config
    if c.architecture == "gemma3":
        assert c.sliding_layers == (0, 1, 2, 3, 4, 6) and c.sliding_window == WINDOW
        assert c.qk_norm and c.head_dim == 32 and c.attention_scale == 48**-0.5
        assert (c.rope_theta, c.rope_local_theta) == (1000.0, 50.0)
    else:
        assert c.architecture == "qwen3" and c.qk_norm and not c.sliding_layers


def test_float_kv_layers_auto_keeps_none_and_a_list_is_refused_with_windows(pair):
    from radixserve.model.kv_layers import float_kv_layers

    _, model = pair
    assert float_kv_layers(model, "auto") == ()  # no key biases
    if model.config.sliding_layers:
        with pytest.raises(ValueError, match="kv_float_layers '5': not supported"):
            float_kv_layers(model, "5")


def test_prefill_matches_at_every_position(pair):
    hf, model = pair
    n = len(PROMPT)
    logits = Runner(model).step(
        prefill=[(torch.tensor(PROMPT), 0, torch.arange(n), True)], all_logits=True
    )
    assert_close(logits, reference_logits(hf, PROMPT), 5e-5)


@pytest.mark.parametrize("cuts", [(3, 11, 20), (9, 10, 18), (1, 2, 7)])
def test_chunked_prefill_after_a_cached_prefix_then_decode(pair, cuts, kernels):
    """Chunks longer and shorter than the window, each after the pool's prefix, then decode
    steps past the last cut; every computed row's logits against transformers'."""
    hf, model = pair
    ref = reference_logits(hf, PROMPT)
    run = Runner(model)
    slots = torch.randperm(400)[: len(PROMPT)]  # scattered, as a real pool gives them
    bounds = (0, *cuts)
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        logits = run.step(
            prefill=[(torch.tensor(PROMPT[lo:hi]), lo, slots[:hi], True)], all_logits=True
        )
        assert_close(logits, ref[lo:hi], 5e-5)
    for pos in range(cuts[-1], len(PROMPT)):
        logits = run.step(decode=[(PROMPT[pos], pos, slots[: pos + 1])])
        assert_close(logits[0], ref[pos], 5e-5)


def test_mixed_step_of_decodes_and_chunks(pair, kernels):
    hf, model = pair
    a, b, c = PROMPT, PROMPT[::-1], PROMPT[5:] + PROMPT[:5]
    run = Runner(model)
    sa, sb, sc = torch.arange(0, 24), torch.arange(100, 124), torch.arange(200, 224)
    run.step(prefill=[(torch.tensor(a[:14]), 0, sa[:14], False),
                      (torch.tensor(b[:9]), 0, sb[:9], False)])  # fmt: skip
    logits = run.step(
        decode=[(a[14], 14, sa[:15]), (b[9], 9, sb[:10])],
        prefill=[(torch.tensor(c[:17]), 0, sc[:17], True)],
    )
    assert_close(logits[0], reference_logits(hf, a[:15])[-1], 5e-5)
    assert_close(logits[1], reference_logits(hf, b[:10])[-1], 5e-5)
    assert_close(logits[2], reference_logits(hf, c[:17])[-1], 5e-5)


def test_local_layers_never_read_keys_outside_their_window(pair, kernels):
    """Local layers read no slot before their window: garbage (NaN) in every local-layer slot
    before the window of a chunk's first row, or of a decode token, leaves the logits exact
    (and on the PyTorch path the slots a chunk gathers start at its first row's window)."""
    hf, model = pair
    if not model.config.sliding_layers:
        pytest.skip("no local layers")
    ref = reference_logits(hf, PROMPT)
    run = Runner(model)
    local = list(model.config.sliding_layers)

    def poison(before: int) -> None:
        for pool in (run.pool.k, run.pool.v):
            pool[local, :, :before] = float("nan")

    run.step(prefill=[(torch.tensor(PROMPT[:12]), 0, torch.arange(12), False)])
    gathered, gather = [], run.pool.gather
    run.pool.gather = lambda layer, slots: gathered.append((layer, slots)) or gather(layer, slots)
    poison(12 - WINDOW + 1)
    logits = run.step(prefill=[(torch.tensor(PROMPT[12:20]), 12, torch.arange(20), True)],
                      all_logits=True)  # fmt: skip
    assert_close(logits, ref[12:20], 5e-5)
    if kernels == "pytorch":
        read = {layer: torch.cat([s for i, s in gathered if i == layer]) for layer in local}
        assert all(int(slots.min()) == 12 - WINDOW + 1 for slots in read.values())
    for pos in range(20, len(PROMPT)):
        poison(pos - WINDOW + 1)
        logits = run.step(decode=[(PROMPT[pos], pos, torch.arange(pos + 1))])
        assert_close(logits[0], ref[pos], 5e-5)


@pytest.mark.parametrize("arch", ["gemma3", "qwen3"])
@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_gguf_matches_transformers(arch, qtype, tmp_path):
    """The GGUF file written from the transformers model (llama.cpp's conventions: Gemma's
    norms stored as 1 + weight, attention scaled by the head size) loads as that model."""
    from radixserve.model.gguf_loader import load_gguf
    from radixserve.model.loader import build_model

    if arch == "gemma3":  # llama.cpp scales Gemma 3's scores by the head size
        hf = make_hf(tmp_path / "hf", "Gemma3TextConfig", seed=4,
                     **{**GEMMA, "query_pre_attn_scalar": 32})  # fmt: skip
    else:
        hf = make_hf(tmp_path / "hf", "Qwen3Config", seed=4, **QWEN3)
    write_llama_gguf(hf, tmp_path / "tiny.gguf", gguf.GGMLQuantizationType[qtype])
    model = build_model(*load_gguf(tmp_path / "tiny.gguf", progress=False))
    c = model.config
    assert c.architecture == arch and c.qk_norm
    if arch == "gemma3":
        assert c.sliding_layers == (0, 1, 2, 3, 4, 6) and c.sliding_window == WINDOW
        assert c.rope_local_theta == 50.0
    n = len(PROMPT)
    logits = Runner(model).step(
        prefill=[(torch.tensor(PROMPT), 0, torch.arange(n), True)], all_logits=True
    )
    if qtype == "F32":  # lossless: the model it was written from
        expected = reference_logits(hf, PROMPT)
    else:  # transformers' own load of the file (what GGUF does not say, from the model)
        from transformers import AutoModelForCausalLM

        same = {"query_pre_attn_scalar": 32, "rope_parameters": GEMMA["rope_parameters"]}
        if arch == "qwen3":  # transformers reads no head size from a qwen3 file
            same = {"head_dim": 32}
        ref = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", **same)
        ref = ref.eval()
        expected = reference_logits(ref, PROMPT)
    assert_close(logits, expected, 5e-5 if qtype == "F32" else 3e-3)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


@pytest.mark.slow
def test_real_gemma3_270m_matches_transformers(float_activations):
    """The released Q4_K_M file (``radixserve pull gemma3-270m``), kept quantized, against
    transformers' float32 dequantization of the same file, on a prompt longer than the
    512-token window: prefill in chunks after a cached prefix, then decode steps (x kept in
    float: a comparison at float precision)."""
    from transformers import AutoModelForCausalLM

    from radixserve.model.registry import KNOWN_MODELS, installed_path

    path = installed_path(KNOWN_MODELS["gemma3-270m"])
    if path is None:
        pytest.skip("gemma3-270m is not installed (`radixserve pull gemma3-270m`)")
    ours = load_model(path, dtype="float32", progress=False)
    ref_model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name)
    text = " ".join(f"Item {i}: the {['red', 'green', 'blue'][i % 3]} box." for i in range(90))
    ids = ours.tokenizer.encode(text)[:700]
    ref = reference_logits(ref_model.eval(), ids)
    run = Runner(ours.model, 1024)
    n = len(ids)
    run.step(prefill=[(torch.tensor(ids[:600]), 0, torch.arange(600), False)])
    logits = run.step(prefill=[(torch.tensor(ids[600:n - 3]), 600, torch.arange(n - 3), True)],
                      all_logits=True)  # fmt: skip
    assert_close(logits, ref[600 : n - 3], 0.1)
    assert (logits.argmax(-1) == ref[600 : n - 3].argmax(-1)).float().mean() > 0.95
    for pos in range(n - 3, n):
        logits = run.step(decode=[(ids[pos], pos, torch.arange(pos + 1))])
        assert_close(logits[0], ref[pos], 0.1)


def test_bfloat16_logits_are_not_rounded_to_bfloat16(tmp_path):
    """A bfloat16 model's logits come from a float32 final norm and LM head: rounded to
    bfloat16 (steps of 0.125 between 16 and 32) they would tie the best candidates, which
    greedy decoding then breaks by token id. Their values lie near the float32 model's."""
    from radixserve.model.gguf_loader import load_gguf
    from radixserve.model.loader import build_model
    from radixserve.model.quant import QuantizedWeight

    hf = make_hf(tmp_path / "hf", "Gemma3TextConfig", seed=5,
                 **{**GEMMA, "query_pre_attn_scalar": 32})  # fmt: skip
    write_llama_gguf(hf, tmp_path / "tiny.gguf", gguf.GGMLQuantizationType.Q8_0)
    logits = {}
    for dtype in (torch.bfloat16, torch.float32):
        model = build_model(*load_gguf(tmp_path / "tiny.gguf", dtype, progress=False),
                            dtype=dtype)  # fmt: skip
        assert isinstance(model.lm_head, QuantizedWeight)
        logits[dtype] = Runner(model).step(
            prefill=[(torch.tensor(PROMPT), 0, torch.arange(len(PROMPT)), True)],
            all_logits=True,
        )
    ours = logits[torch.bfloat16]
    assert ours.dtype == torch.float32
    rounded = (ours == ours.bfloat16().float()).float().mean().item()
    assert rounded < 0.2, f"{rounded:.0%} of the logits are bfloat16 values"
    assert_close(ours, logits[torch.float32], 0.5)


def test_int8_kv_in_window_layers_same_on_both_paths(pair, monkeypatch):
    """An int8 pool (window layers in their own pool): a chunk after a prefix, then decode
    steps well past the window, give nearly the same logits on the native kernels and the
    PyTorch path (both read the same rows and round queries alike), both near float KV's."""
    from radixserve.cache.kv_format import KVFormat
    from radixserve.model import native

    hf, model = pair
    if native.paged_ops() is None:
        pytest.skip("the native kernels did not build on this machine")
    ref = reference_logits(hf, PROMPT)
    runs = []
    for native_on in (True, False):
        run = Runner(model, kv_format=KVFormat.of("int8"))
        steps = []
        with monkeypatch.context() as patch:
            if not native_on:
                patch.setattr(native, "paged_ops", lambda: None)
            run.step(prefill=[(torch.tensor(PROMPT[:7]), 0, torch.arange(7), False)])
            steps.append(
                run.step(prefill=[(torch.tensor(PROMPT[7:16]), 7, torch.arange(16), True)])
            )
            for pos in range(16, len(PROMPT)):
                steps.append(run.step(decode=[(PROMPT[pos], pos, torch.arange(pos + 1))]))
        model._native = None
        runs.append(torch.cat(steps))
    fast, slow = runs
    # Qwen3's agree to 1e-7; Gemma 3's by 0.2% of the largest logit (a quarter of their
    # distance from float KV's, the same on both paths), a gap not accounted for yet
    assert (fast - slow).abs().max() < 3e-3 * slow.abs().max()
    assert (slow - ref[15:]).abs().max() < 0.05 * ref.abs().max()
    assert (fast - ref[15:]).abs().max() < 0.05 * ref.abs().max()


@pytest.mark.parametrize("arch", ["gemma3", "qwen3"])
def test_native_decoder_equals_the_op_by_op_path(arch, tmp_path, monkeypatch):
    """Decode steps of two sequences run in one native call (q/k norms; Gemma's output norms,
    GeGLU, scaled embeddings, local layers with their own RoPE reading the window only) and
    equal the PyTorch path's, from the Q8_0 file and dense; well past the 5-token window."""
    from radixserve.model import native
    from radixserve.model.gguf_loader import load_gguf
    from radixserve.model.loader import build_model

    if native.paged_ops() is None:
        pytest.skip("the native kernels did not build on this machine")
    if arch == "gemma3":
        hf = make_hf(tmp_path / "hf", "Gemma3TextConfig", seed=6,
                     **{**GEMMA, "query_pre_attn_scalar": 32})  # fmt: skip
    else:
        hf = make_hf(tmp_path / "hf", "Qwen3Config", seed=6, **QWEN3)
    write_llama_gguf(hf, tmp_path / "tiny.gguf", gguf.GGMLQuantizationType.Q8_0)
    prompts = [PROMPT[:4], PROMPT[7:16]]
    slots = [torch.arange(0, 30), torch.randperm(200)[100:130]]
    for quantization in ("auto", "none"):
        model = build_model(*load_gguf(tmp_path / "tiny.gguf", progress=False,
                                       quantization=quantization))  # fmt: skip
        runs = []
        for native_on in (True, False):
            run = Runner(model)
            with monkeypatch.context() as patch:
                if not native_on:
                    patch.setattr(native, "paged_ops", lambda: None)
                run.step(prefill=[(torch.tensor(p), 0, s[: len(p)], False)
                                  for p, s in zip(prompts, slots, strict=True)])  # fmt: skip
                steps = []
                for k in range(12):
                    decode = [(PROMPT[(len(p) + k) % len(PROMPT)], len(p) + k, s[: len(p) + k + 1])
                              for p, s in zip(prompts, slots, strict=True)]  # fmt: skip
                    steps.append(run.step(decode=decode))
            runs.append(torch.stack(steps))
            if native_on:  # it did run natively
                assert model._native is not None and model._native[1] is not None
                model._native = None
        fast, slow = runs
        assert (fast - slow).abs().max() < 1e-3 * slow.abs().max(), quantization
