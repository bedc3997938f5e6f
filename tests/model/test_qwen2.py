"""Qwen2 (QKV biases, untied head, ChatML template) from GGUF files.

CI: a tiny random Qwen2 written to GGUF the way llama.cpp's converter does, loaded by us and by
transformers (the reference), logits compared. Slow: the real Qwen2.5-Coder-0.5B-Instruct
Q4_K_M file (``radixserve pull qwen2.5-coder-0.5b``): greedy chat answers with the weights kept
quantized equal those of the dequantized float32 model, and the chat template renders the
default system prompt the model's authors wrote into it.
"""

from __future__ import annotations

import gguf
import pytest
import torch
from test_model_numerics import PROMPT, Runner, assert_close, reference_logits

from radixserve.model.registry import KNOWN_MODELS, installed_path
from testing.gguf_writer import write_llama_gguf
from testing.tiny_model import save_tiny_hf_model

QWEN_05B = KNOWN_MODELS["qwen2.5-coder-0.5b"]


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_tiny_qwen2_gguf_matches_transformers(qtype, tmp_path):
    from transformers import AutoModelForCausalLM

    from radixserve.model.gguf_loader import load_gguf
    from radixserve.model.llama import LlamaModel

    hf = save_tiny_hf_model(tmp_path / "hf", "Qwen2Config", seed=3, tie_word_embeddings=False)
    with torch.no_grad():  # random biases, so the bias path is really exercised
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    write_llama_gguf(hf, tmp_path / "tiny.gguf", gguf.GGMLQuantizationType[qtype])
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf").eval()
    config, weights = load_gguf(tmp_path / "tiny.gguf", progress=False)
    assert config.architecture == "qwen2" and config.attention_bias
    assert not config.tie_word_embeddings and "lm_head.weight" in weights
    logits = Runner(LlamaModel(config, weights)).step(
        prefill=[(torch.tensor(PROMPT), 0, torch.arange(16), True)], all_logits=True
    )
    expected = reference_logits(ref, PROMPT)
    assert_close(logits, expected, 3e-3 if qtype == "Q8_0" else 5e-5)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))
    if qtype == "F32":  # lossless: also the model it was written from
        assert_close(logits, reference_logits(hf, PROMPT), 5e-5)


CHAT = [
    "Write a Python function that checks whether a number is prime.",
    "What is the difference between a list and a tuple in Python?",
    "Explain recursion in one sentence.",
    "How do I read a file line by line in Python?",
]


@pytest.fixture(scope="module")
def qwen_05b():
    path = installed_path(QWEN_05B)
    if path is None:
        pytest.skip(
            f"{QWEN_05B.name} is not installed (`radixserve pull {QWEN_05B.name}` installs it "
            f"into {QWEN_05B.path.parent})"
        )
    return path


def greedy_chat(path, quantization: str) -> tuple[list[list[int]], list[int], list[list]]:
    """Greedy answers to CHAT, their prompt token counts, and each token's two best logprobs."""
    from radixserve.config import EngineConfig
    from radixserve.engine import LLM, SamplingParams

    config = EngineConfig(model=str(path), dtype="float32", quantization=quantization)
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=2)
    with LLM.from_config(config) as llm:
        outs = llm.chat([[{"role": "user", "content": q}] for q in CHAT], params)
    return ([o.token_ids for o in outs], [len(o.prompt_token_ids) for o in outs],
            [o.logprobs for o in outs])  # fmt: skip


@pytest.mark.slow
def test_qwen_05b_quantized_answers_equal_the_float32_reference(qwen_05b):
    """The weights kept quantized (x rounded to int8 in their matmuls) answer as the
    dequantized float32 model does, but where the reference itself hesitates: an answer may
    part only at a near tie of the reference's two best tokens, taking the other one."""
    quantized, counts, _ = greedy_chat(qwen_05b, "auto")
    reference, ref_counts, ref_logprobs = greedy_chat(qwen_05b, "none")
    assert counts == ref_counts
    same = 0
    for ours, ref, logprobs in zip(quantized, reference, ref_logprobs, strict=True):
        if ours == ref:
            same += 1
            continue
        k = next(i for i, (a, b) in enumerate(zip(ours, ref, strict=False)) if a != b)
        (best, best_lp), (second, second_lp) = logprobs[k].top[:2]
        assert best == ref[k] and ours[k] == second, (k, ours[k], logprobs[k])
        assert best_lp - second_lp < 0.05, f"parted at token {k}, {best_lp - second_lp:.3f} nats"
    assert same >= len(CHAT) - 1, f"{same}/{len(CHAT)} greedy answers equal the float32 reference"


@pytest.mark.slow
def test_qwen_05b_template_and_prompt_tokens_match_transformers(qwen_05b):
    from transformers import AutoTokenizer

    from radixserve.model.tokenizer import Tokenizer

    ours = Tokenizer.from_model_path(qwen_05b, [])
    messages = [{"role": "user", "content": CHAT[0]}]
    text = ours.render_chat(messages)
    # the default system prompt comes from the template itself
    assert text.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")
    assert text.endswith("<|im_start|>assistant\n")
    ref = AutoTokenizer.from_pretrained(str(qwen_05b.parent), gguf_file=qwen_05b.name)
    expected = ref.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    assert ours.encode_chat(messages) == list(expected)
