"""Sampler: next tokens for a batch of requests, each with its own SamplingParams.

Order of processing: logit bias, grammar masks (a constrained request's forbidden tokens
get ``-inf``, ``structured/``), penalties (repetition over prompt + output, frequency and
presence over output) -> greedy rows take the argmax -> other rows: temperature, then
top-k, top-p and min-p masks over one sort, then a draw. Each request draws with its own
``torch.Generator`` (seeded from ``seed`` or from the engine's seed sequence), via the
exponential race ``argmax(p / E)`` with ``E ~ Exp(1)``, so its tokens do not depend on what
else is in the batch.
Logprobs are of the model's distribution (raw logits, before penalties and temperature).
Each constrained request's matcher then accepts the token drawn for it.

A request with a draft (``drafts/``) has one row per draft token plus one, each row the
distribution after the tokens before it. It keeps the draft up to the first row whose token
differs from it and takes that row's token as its next. A random request draws at each row
in turn, as it would token by token, and keeps the draft token if the draw is that token:
that is speculative sampling's rejection rule for a draft proposed with certainty (keep
draft token ``d`` with probability ``p(d)``; else draw from ``p`` without ``d``,
renormalised, which is what a draw that came out other than ``d`` is). So the tokens follow
the model's distribution exactly, and a seeded request writes the same tokens with drafts
or without. Logprobs of kept draft tokens come from their own rows.
"""

from __future__ import annotations

import numpy as np
import torch

from radixserve.engine.request import Request, TokenLogprob, Verified
from radixserve.model import native
from radixserve.structured import apply_masks


def _apply_penalties(logits: torch.Tensor, reqs: list[Request], first: list[int]) -> None:
    """Penalties on each penalised request's row (such a request never has a draft)."""
    vocab = logits.shape[1]
    for i, r in enumerate(reqs):
        p = r.params
        if not p.needs_penalties:
            continue
        row = logits[first[i]]
        if p.repetition_penalty != 1.0:  # each token seen once or more, once
            seen = torch.from_numpy(np.unique(r.token_ids).astype(np.int64)).to(logits.device)
            vals, penalty = row[seen], p.repetition_penalty
            row[seen] = torch.where(vals > 0, vals / penalty, vals * penalty)
        if p.frequency_penalty or p.presence_penalty:
            out = torch.tensor(r.output_ids, dtype=torch.int64, device=logits.device)
            counts = torch.bincount(out, minlength=vocab)[:vocab].to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax; on the CPU by the native kernel (same answer, ties and NaN included,
    about 10x faster than torch's on a batch of vocabulary-wide rows)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
        ops = native.paged_ops()
        if ops is not None and logits.shape[1] > 0:
            return ops.argmax(logits)
    return logits.argmax(dim=-1)


def _filter(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """Temperature plus top-k / top-p / min-p masks, batched over the rows given."""
    device = logits.device
    temps = torch.tensor([r.params.temperature for r in reqs], device=device)
    logits = logits / temps[:, None]
    vocab = logits.shape[1]
    # top_k above the vocabulary keeps every token (and never overflows an int64 tensor)
    top_k = [min(r.params.top_k, vocab) if r.params.top_k > 0 else vocab for r in reqs]
    top_p = [r.params.top_p for r in reqs]
    min_p = [r.params.min_p for r in reqs]
    if all(k == vocab for k in top_k) and all(p == 1.0 for p in top_p) and not any(min_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=device)[None, :]
    drop = ranks >= torch.tensor(top_k, device=device)[:, None]
    probs = sorted_logits.softmax(dim=-1)
    drop |= (probs.cumsum(dim=-1) - probs) > torch.tensor(top_p, device=device)[:, None]
    drop |= probs < torch.tensor(min_p, device=device)[:, None] * probs[:, :1]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _draw(logits: torch.Tensor, reqs: list[Request], first: list[int], drafts: list[list[int]]):
    """Each request's candidate token at each of its rows: the argmax, or for a random
    request a draw per row, in row order, stopping after the first row that leaves its draft
    (so its generator advances exactly as in token-by-token decoding)."""
    tokens = _argmax(logits)
    randoms = [i for i, r in enumerate(reqs) if not r.params.greedy]
    if not randoms:
        return tokens.tolist()
    # Every random row filtered in one batch first: a row that cannot be filtered fails the
    # call before any request's generator has advanced, so the rows sampled again one by
    # one draw the same.
    spans = [range(first[i], first[i] + len(drafts[i]) + 1) for i in randoms]
    rows = [row for span in spans for row in span]
    row_reqs = [reqs[i] for i, span in zip(randoms, spans, strict=True) for _ in span]
    filtered = _filter(logits[rows], row_reqs).softmax(dim=-1)
    probs_of_row = dict(zip(rows, filtered, strict=True))
    for i in randoms:
        r, draft = reqs[i], drafts[i]
        for j in range(len(draft) + 1):
            probs = probs_of_row[first[i] + j]
            # drawn on the CPU, where the request's generator lives, whatever the device
            race = torch.empty(probs.shape[0]).exponential_(generator=r.generator)
            tokens[first[i] + j] = (probs / race.to(probs.device)).argmax()
            if j == len(draft) or int(tokens[first[i] + j]) != draft[j]:
                break
    return tokens.tolist()


def sample(
    logits: torch.Tensor, reqs: list[Request], verified: dict[str, Verified] | None = None
) -> list[tuple[int, TokenLogprob | None]]:
    """``logits``: float32, one row per request, or ``1 + num_draft`` rows for a request with
    a draft (the row after each draft token). One (token, logprob or None) per request; for
    a request with a draft, ``verified[request_id]`` says how many draft tokens it keeps
    (and their logprobs)."""
    rows = [1 + r.num_draft for r in reqs]
    first = [sum(rows[:i]) for i in range(len(reqs))]
    raw_logprobs = None
    if any(r.params.logprobs is not None for r in reqs):
        raw_logprobs = logits.log_softmax(dim=-1)
    biased = [i for i, r in enumerate(reqs) if r.params.logit_bias]
    constrained = [i for i, r in enumerate(reqs) if r.grammar is not None]
    penalised = [i for i, r in enumerate(reqs) if r.params.needs_penalties]
    if biased or constrained or penalised:
        logits = logits.clone()  # the steps below write into the rows
    for i in biased:
        bias = reqs[i].params.logit_bias
        ids = torch.tensor(list(bias), dtype=torch.int64, device=logits.device)
        span = slice(first[i], first[i] + rows[i])
        logits[span, ids] += torch.tensor(list(bias.values()), device=logits.device)
    drafts = [_draft(r) for r in reqs]
    if constrained:
        apply_masks(logits, [(first[i], reqs[i].grammar, drafts[i]) for i in constrained])
    if penalised:
        _apply_penalties(logits, reqs, first)
    tokens = _draw(logits, reqs, first, drafts)
    out: list[tuple[int, TokenLogprob | None]] = []
    for i, r in enumerate(reqs):
        kept = 0
        while kept < len(drafts[i]) and tokens[first[i] + kept] == drafts[i][kept]:
            kept += 1
        token = tokens[first[i] + kept]
        if r.grammar is not None:
            r.grammar.settle(len(drafts[i]), kept, token)
        lps = None
        if raw_logprobs is not None and r.params.logprobs is not None:
            lps = [_logprob(raw_logprobs[first[i] + j], t, r.params.logprobs)
                   for j, t in enumerate([*drafts[i][:kept], token])]  # fmt: skip
        if drafts[i] and verified is not None:
            verified[r.request_id] = Verified(kept, lps[:-1] if lps else [])
        out.append((token, lps[-1] if lps else None))
    return out


def _logprob(row: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """``token``'s logprob in ``row`` (raw log-softmax), with the ``top`` most likely."""
    best = []
    if top > 0:
        values, ids = row.topk(top)
        best = list(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprob(token, float(row[token]), best)


def _draft(r: Request) -> list[int]:
    return r.token_ids[len(r.token_ids) - r.num_draft :].tolist() if r.num_draft else []
