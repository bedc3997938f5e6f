"""A 32K-token context on a real model (slow: Qwen2.5-Coder-0.5B-Instruct Q4_K_M, trained for
32,768 tokens).

A fact stated once at the start of a ~31K-token prompt (the project's own docs and sources as
filler) is answered at its end, with int8 KV: the prefill chunks and the decode steps attend
over the whole context. A prompt one token over the trained context is refused, naming it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from radixserve.model.registry import KNOWN_MODELS, installed_path

QWEN_05B = KNOWN_MODELS["qwen2.5-coder-0.5b"]
ROOT = Path(__file__).resolve().parents[2]
FACT = "Remember this: the vault code is 7391."
QUESTION = "What is the vault code stated at the very beginning? Answer with the number only."


def filler() -> str:
    parts = sorted(ROOT.glob("docs/*.md")) + sorted(ROOT.glob("radixserve/**/*.py"))
    return "\n\n".join(p.read_text() for p in parts)


@pytest.mark.slow
def test_qwen_05b_answers_from_the_start_of_a_32k_context():
    from radixserve.config import EngineConfig
    from radixserve.engine import LLM, SamplingParams

    path = installed_path(QWEN_05B)
    if path is None:
        pytest.skip(f"{QWEN_05B.name} is not installed (`radixserve pull {QWEN_05B.name}`)")
    config = EngineConfig.from_options(model=str(path), kv_cache_dtype="int8",
                                       load_progress=False)  # fmt: skip
    with LLM.from_config(config) as llm:
        tok = llm.engine.tokenizer
        body = tok.encode(filler())[:30_800]
        text = f"{FACT}\n\n{tok.decode(body)}\n\n{QUESTION}"
        messages = [{"role": "user", "content": text}]
        out = llm.chat([messages], SamplingParams(max_tokens=8, temperature=0.0))[0]
        assert len(out.prompt_token_ids) > 30_000
        assert "7391" in out.text, out.text
        with pytest.raises(ValueError, match="context is 32768 tokens"):
            llm.engine.add_request("over", list(range(100, 100 + 32_768)), SamplingParams())
        llm.engine.check_integrity()
