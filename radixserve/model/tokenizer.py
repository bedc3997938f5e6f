"""Tokenizer: text <-> token ids and the chat template, from a GGUF file or an HF directory.

A thin wrapper over a transformers fast tokenizer (transformers builds one from the vocabulary
and merges stored in a GGUF file, and takes the chat template from it too). Chat prompts are
rendered to text by the template and then encoded without adding special tokens again, since
the template writes them itself.

Building a tokenizer from GGUF metadata takes seconds, so the result is kept on disk and later
loads read it back as transformers' generic fast tokenizer: everything it does is in the saved
``tokenizer.json`` and ``tokenizer_config.json``, and the generic class skips importing
transformers' table of model-specific classes and rebuilding the vocabulary in Python.

``deferred`` gives a GGUF file's tokenizer that is built on first use: the engine process needs
only the stop ids, which the file itself names, until a request asks for a grammar.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from radixserve.utils import cache_dir


class Tokenizer:
    def __init__(
        self,
        hf_tokenizer: Any,
        eos_token_ids: list[int],
        build: Callable[[], Any] | None = None,
    ):
        """``hf_tokenizer`` None: ``build`` makes it on first use (see ``deferred``)."""
        self._hf, self._build, self._lock = hf_tokenizer, build, threading.Lock()
        hf_eos = hf_tokenizer.eos_token_id if hf_tokenizer is not None else None
        self.eos_token_ids = list(
            dict.fromkeys([*eos_token_ids, *([hf_eos] if hf_eos is not None else [])])
        )

    @classmethod
    def from_model_path(cls, path: Path, eos_token_ids: list[int]) -> Tokenizer:
        return cls(_load_hf(path), eos_token_ids)

    @classmethod
    def deferred(cls, path: Path, eos_token_ids: list[int]) -> Tokenizer:
        """A GGUF file's tokenizer, built on first use. ``eos_token_ids`` are the file's own
        stop ids (``tokenizer.ggml.eos_token_id`` and its end-of-turn id): the tokenizer built
        from the file takes its end-of-sequence token from the same field, so they are
        complete without building it. An HF directory's tokenizer is built at once."""
        if path.is_dir():
            return cls.from_model_path(path, eos_token_ids)
        return cls(None, eos_token_ids, build=lambda: _load_hf(path))

    @property
    def hf(self) -> Any:
        """The transformers tokenizer (built now if it was deferred)."""
        if self._hf is None:
            with self._lock:
                if self._hf is None:
                    self._hf = self._build()
        return self._hf

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    @property
    def template_has_tools(self) -> bool:
        """The chat template renders a ``tools`` list itself (Qwen2.5's does)."""
        return self.has_chat_template and "tools" in self.hf.chat_template

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        if not self.has_chat_template:
            raise ValueError("this model has no chat template; use a completion prompt instead")
        extra = {"tools": tools} if tools else {}
        try:
            return self.hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **extra
            )
        except Exception as e:  # the template itself may reject a conversation
            raise ValueError(f"the chat template rejected these messages: {e}") from e

    def encode_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        return self.encode(self.render_chat(messages, tools=tools), add_special_tokens=False)


def _load_hf(path: Path) -> Any:
    """The transformers tokenizer of a GGUF file or an HF directory."""
    from transformers.utils import logging

    logging.set_verbosity_error()
    if path.is_dir():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path))
    cached = _tokenizer_cache_dir(path)
    if cached is not None and (cached / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(cached))
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if cached is not None:
        try:
            hf.save_pretrained(str(cached))
        except OSError:
            pass  # an unwritable cache only costs time
    return hf


def _tokenizer_cache_dir(gguf_path: Path) -> Path | None:
    """Where the tokenizer built from this exact file is kept (None: caching disabled)."""
    if os.environ.get("RADIXSERVE_CACHE_DIR") == "":
        return None
    stat = gguf_path.stat()
    key = f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    return cache_dir() / "tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:16]
