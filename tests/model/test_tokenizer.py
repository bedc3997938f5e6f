"""A GGUF file's tokenizer: built once from the file and kept on disk, read back from there
as the same tokenizer, and left unbuilt by the model loader until something needs it."""

from __future__ import annotations

import json
import random
import subprocess
import sys

from radixserve.model.tokenizer import Tokenizer

TEXTS = [
    "Hello world",
    " leading space and trailing  ",
    "def f(x):\n\treturn x**2  # squared",
    "wörld 🤖 日本語",
    "<|im_start|>user\nhi<|im_end|>",
    "a\n\n\nb",
]
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


def test_a_tokenizer_read_back_from_the_cache_is_the_one_built_from_the_file(
    default_gguf, tmp_path, monkeypatch
):
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path))
    built = Tokenizer.from_model_path(default_gguf, [])
    saved = list(tmp_path.glob("tokenizers/*/tokenizer.json"))
    assert len(saved) == 1, "the tokenizer built from the file is kept on disk"
    cached = Tokenizer.from_model_path(default_gguf, [])
    assert type(cached.hf).__name__ == "TokenizersBackend"  # the generic class, read back
    for text in TEXTS:
        for special in (True, False):
            assert cached.encode(text, special) == built.encode(text, special), text
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(built.vocab_size) for _ in range(rng.randrange(1, 12))]
        for skip in (True, False):
            assert cached.decode(ids, skip) == built.decode(ids, skip), ids
    assert cached.eos_token_ids == built.eos_token_ids
    assert cached.vocab_size == built.vocab_size
    assert cached.render_chat(MESSAGES) == built.render_chat(MESSAGES)


LOAD_WITHOUT_TOKENIZER = """
import json, sys
from radixserve.model import load_model
loaded = load_model(sys.argv[1], dtype="float32", progress=False)
before = "transformers" in sys.modules
ids = loaded.tokenizer.encode("Hello world")
print(json.dumps({"transformers_at_load": before, "eos": loaded.tokenizer.eos_token_ids,
                  "ids": ids, "vocab": loaded.tokenizer.vocab_size}))
"""


def test_loading_a_gguf_model_defers_its_tokenizer_until_first_use(default_gguf):
    """The engine process needs only the stop ids at start-up, which the file names; the
    tokenizer (transformers and all) is built when a request first needs it."""
    out = subprocess.run(
        [sys.executable, "-c", LOAD_WITHOUT_TOKENIZER, str(default_gguf)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["transformers_at_load"] is False
    eager = Tokenizer.from_model_path(default_gguf, [])
    assert result["ids"] == eager.encode("Hello world")
    assert result["vocab"] == eager.vocab_size
    assert set(eager.eos_token_ids) <= set(result["eos"])
