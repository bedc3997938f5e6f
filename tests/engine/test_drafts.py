"""Drafts: whatever a draft source proposes, a request writes exactly what it writes without
drafts (greedy and seeded, with logprobs, stops, penalties, batching, chunked prefill,
retraction, pages, the prefix cache on and off); random draws keep the model's distribution
(a chi-square test over many draws); the length policy and the text source's matcher."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve.engine import SamplingParams
from radixserve.engine.drafts import Drafts, DraftSource, LengthPolicy, Proposal, longest_match
from radixserve.engine.drafts.policy import Prediction, RequestDrafting, bucket
from radixserve.engine.request import Request, Verified
from radixserve.engine.sampler import sample
from radixserve.engine.spec import RequestSpec


class Oracle(DraftSource):
    """Proposes each request's known output (from a run without drafts), with every
    ``wrong``-th token of that output replaced, so drafts are kept whole, in part or not at
    all, at every length up to the policy's limit."""

    name = "oracle"

    def __init__(self, outputs: dict[str, list[int]], wrong: int = 7):
        self.outputs, self.wrong = outputs, wrong

    def propose(self, req: Request, limit: int) -> Proposal | None:
        at = req.num_output
        known = self.outputs[req.request_id][at : at + limit]
        tokens = [t + 1 if (at + j) % self.wrong == self.wrong - 1 else t
                  for j, t in enumerate(known)]  # fmt: skip
        return Proposal(tokens, 32) if tokens else None


def use_source(engine, source: DraftSource, max_tokens: int = 12) -> None:
    """Give ``engine`` ``source`` alone, with a policy that drafts whenever a token may be kept."""
    eos = frozenset(engine.tokenizer.eos_token_ids)
    engine.drafts = engine.core.drafts = Drafts(
        [source], LengthPolicy(row_cost=0.01, max_tokens=max_tokens), max_batch=64,
        eos_token_ids=eos,
    )  # fmt: skip


def run(engine, specs: list[RequestSpec]):
    """Every request's output tokens, finish reason and logprobs; and the step each finished
    at."""
    for spec in specs:
        engine.add(spec)
    outs: dict[str, list[int]] = {s.request_id: [] for s in specs}
    reasons, logprobs, steps, done_at = {}, {s.request_id: [] for s in specs}, 0, {}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] += o.new_token_ids
            logprobs[o.request_id] += o.new_logprobs
            if o.finished:
                reasons[o.request_id] = o.finish_reason
                done_at[o.request_id] = steps
        steps += 1
    return outs, reasons, logprobs, done_at


def mixed_specs(stop_token: int | None = None) -> list[RequestSpec]:
    """Greedy and seeded requests, one asking logprobs, one with penalties (it never drafts),
    one that stops on a token id, prompts of different lengths (one long enough to be
    prefilled in chunks beside others' drafts)."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 40000, n).tolist() for n in (9, 70, 23, 14, 5)]
    params = [
        SamplingParams(max_tokens=48, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=36, temperature=0, logprobs=3, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0.8, seed=5, repetition_penalty=1.3),
        SamplingParams(max_tokens=44, temperature=1.0, seed=2, logprobs=0,
                       stop_token_ids=[stop_token] if stop_token is not None else []),
    ]  # fmt: skip
    return [RequestSpec(request_id=str(i), prompt_ids=p, params=q)
            for i, (p, q) in enumerate(zip(prompts, params, strict=True))]  # fmt: skip


def chi_square_p(counts: np.ndarray, expected: np.ndarray) -> float:
    """The chi-square goodness-of-fit test's p-value (cells with expected counts of 5 or more;
    the rest pooled into one)."""
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(stat / 2.0)))


def assert_same(with_drafts, without):
    outs, reasons, logprobs, _ = with_drafts
    assert outs == without[0] and reasons == without[1]
    for rid, lps in logprobs.items():
        ref = without[2][rid]
        assert [lp.token_id for lp in lps] == [lp.token_id for lp in ref]
        assert [[t for t, _ in lp.top] for lp in lps] == [[t for t, _ in lp.top] for lp in ref]
        np.testing.assert_allclose([lp.logprob for lp in lps], [lp.logprob for lp in ref],
                                   rtol=0, atol=1e-4)  # fmt: skip


@pytest.mark.parametrize(
    "options",
    [
        dict(chunked_prefill_size=16),
        dict(chunked_prefill_size=16, enable_prefix_caching=False),
        dict(chunked_prefill_size=32, page_size=4),
    ],
    ids=["cache", "no-cache", "pages"],
)
def test_outputs_are_identical_with_drafts_kept_whole_in_part_or_not(make_engine, kernels,
                                                                    options):  # fmt: skip
    """Rows with and without drafts share steps (a penalised request never drafts) beside
    prompt chunks; every request writes the same tokens, stops and logprobs as without
    drafts, in fewer steps."""
    off = run(make_engine(draft_sources="none", **options), mixed_specs())
    stop_token = off[0]["4"][20]
    off = run(make_engine(draft_sources="none", **options), mixed_specs(stop_token))
    engine = make_engine(draft_sources="none", **options)
    use_source(engine, Oracle(off[0]))
    on = run(engine, mixed_specs(stop_token))
    assert_same(on, off)
    assert off[1]["4"] == "stop" and len(off[0]["4"]) == 21
    s = engine.stats().drafts.sources["oracle"]
    assert s.accepted_tokens > 40 and s.proposed_tokens > s.accepted_tokens  # kept and refused
    drafted = ["0", "1", "2", "4"]  # "3" has penalties
    assert sum(on[3][r] for r in drafted) < 0.7 * sum(off[3][r] for r in drafted)


@pytest.mark.parametrize("page_size", [1, 4])
def test_drafts_survive_retraction(make_engine, page_size):
    """A pool too small for every request (the run without drafts retracts one) with drafts
    on: drafts are dropped when memory is short, outputs stay identical and nothing leaks
    (``make_engine`` checks integrity)."""
    options = dict(max_total_tokens=150, page_size=page_size, chunked_prefill_size=16)
    specs = [RequestSpec(request_id=str(i), prompt_ids=[5 + i, *range(6, 50)],
                         params=SamplingParams(max_tokens=56, temperature=0.0 if i % 2 else 1.0,
                                               seed=i, ignore_eos=True))
             for i in range(6)]  # fmt: skip
    off_engine = make_engine(draft_sources="none", **options)
    off = run(off_engine, specs)
    assert off_engine.scheduler.num_retractions > 0  # the pool really is too small
    engine = make_engine(draft_sources="none", **options)
    use_source(engine, Oracle(off[0], wrong=11), max_tokens=16)
    on = run(engine, specs)
    assert_same(on, off)
    assert engine.stats().drafts.sources["oracle"].accepted_tokens > 0


def test_text_drafts_on_a_real_model_copying_text(make_engine, real_loaded):
    """SmolLM2 copying a list it was shown: its own-text drafts (the defaults) are kept, the
    output is the one without drafts, in fewer steps."""
    tok = real_loaded.tokenizer
    items = "\n".join(f"- item {i}: the {w} box" for i, w in enumerate(
        ["red", "blue", "green", "small", "large", "empty"]))  # fmt: skip
    prompt = tok.encode(f"A list:\n{items}\n\nThe same list, copied:\n- item 0:")
    spec = RequestSpec(request_id="a", prompt_ids=prompt,
                       params=SamplingParams(max_tokens=60, temperature=0))  # fmt: skip
    off = run(make_engine(real_loaded, draft_sources="none"), [spec])
    engine = make_engine(real_loaded, draft_sources="text")
    on = run(engine, [spec])
    assert on[:2] == off[:2]
    text = engine.stats().drafts.sources["text"]
    assert text.accepted_tokens >= 20 and on[3]["a"] < off[3]["a"] * 0.7


def test_random_draws_with_a_draft_follow_the_model_s_distribution(tiny_loaded):
    """The rejection rule: with a one-token draft ``d`` (the second most likely token), the
    first token of many seeded draws follows the model's distribution, ``d`` is kept with
    probability ``p(d)``, and after a kept ``d`` the next token follows the model's
    distribution after ``d`` (chi-square tests over 20,000 draws; the tiny model's logits,
    restricted to its 12 most likely first tokens)."""
    from radixserve.cache import KVPool
    from radixserve.model import build_forward_batch

    model = tiny_loaded.model
    prompt = [523, 9012, 77, 310]
    full = model.forward(
        build_forward_batch([], [(torch.tensor(prompt), 0, torch.arange(4), True)], model.device,
                            0),
        KVPool(model.kv_shape(), 8),
    )[0]  # fmt: skip
    vocab = full.topk(12).indices
    d = int(vocab[1])
    after = model.forward(
        build_forward_batch([], [(torch.tensor([*prompt, d]), 0, torch.arange(5), True)],
                            model.device, 0),
        KVPool(model.kv_shape(), 8),
    )[0]  # fmt: skip
    rows = torch.stack([full[vocab], after[vocab]])  # a 12-token vocabulary: d is token 1
    n = 20000
    reqs = []
    for i in range(n):
        spec = RequestSpec(request_id=str(i), prompt_ids=[0, 2, 3],
                           params=SamplingParams(temperature=1.0, seed=i))  # fmt: skip
        r = Request(spec, max_tokens=4, seed=i)
        r.add_draft([1])
        reqs.append(r)
    verified: dict[str, Verified] = {}
    drawn = sample(rows.repeat(n, 1).contiguous(), reqs, verified)
    kept = np.array([verified[r.request_id].kept for r in reqs])
    first = np.where(kept == 1, 1, [t for t, _ in drawn])
    second = np.array([t for t, _ in drawn])[kept == 1]
    p0, p1 = (torch.softmax(row, -1).double().numpy() for row in rows)
    assert chi_square_p(np.bincount(first, minlength=12), p0 * n) > 1e-3
    assert chi_square_p(np.bincount(second, minlength=12), p1 * len(second)) > 1e-3
    z = (kept.sum() - n * p0[1]) / np.sqrt(n * p0[1] * (1 - p0[1]))
    assert abs(z) < 3.5  # d kept with probability p(d)
    assert 0.05 < p0[1] < 0.95  # a test that can fail either way
    # the test itself can fail: the same draws against the distribution after the prompt
    # alone for the second token are rejected
    assert chi_square_p(np.bincount(second, minlength=12), p0 * len(second)) < 1e-3


def test_longest_match_is_the_most_recent_of_the_longest():
    rng = np.random.default_rng(0)
    for _ in range(300):
        ids = rng.integers(0, 4, rng.integers(1, 40)).astype(np.int32)
        want = None
        for end in range(len(ids) - 1):
            n = 0
            while n <= end and ids[end - n] == ids[len(ids) - 1 - n] and n < 64:
                n += 1
            if n and (want is None or n >= want[1]):
                want = (end, n)
        assert longest_match(ids) == want


def test_the_length_policy_drafts_less_as_batches_grow_and_acceptance_falls():
    policy = LengthPolicy(row_cost=0.1, max_tokens=16)
    assert policy.threshold(1) == pytest.approx(0.1)
    assert policy.threshold(16) == pytest.approx(1.6 / 2.5)
    lengths = [policy.length(0.9, b, 16) for b in (1, 2, 4, 8, 16)]
    assert lengths == sorted(lengths, reverse=True) and lengths[0] == 16 and lengths[-1] == 4
    assert policy.length(0.05, 1, 16) == 0 and policy.length(1.0, 16, 5) == 5
    state = RequestDrafting()
    for _ in range(20):  # a source whose predictions never come true is not drafted
        p = Prediction("text", bucket(3), [7, 8])
        policy.learn(state, p, *p.check([9]))
    assert policy.length(policy.rate(state, "text", bucket(3)), 1, 16) == 0
    fresh = RequestDrafting()  # another request starts from what all requests showed
    assert policy.rate(fresh, "text", bucket(3)) < 0.1
    assert policy.rate(fresh, "text", bucket(20)) == pytest.approx(0.3)


def test_a_repeated_request_drafts_from_the_cache_of_its_own_namespace_only(make_engine):
    """A request asked again writes what the first wrote, drafted from the cache (its output
    is in the tree); asked in another namespace, nothing is proposed from the first's text.
    All three write the same tokens (greedy, float32)."""
    prompt = list(range(40, 70))

    def spec(rid: str, namespace: str) -> RequestSpec:
        params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        return RequestSpec(request_id=rid, prompt_ids=prompt, namespace=namespace, params=params)

    engine = make_engine(draft_sources="cache")
    first = run(engine, [spec("a", "t1")])
    other = run(engine, [spec("b", "t2")])
    assert engine.stats().drafts.sources["cache"].proposed_tokens == 0
    again = run(engine, [spec("c", "t1")])
    assert first[0]["a"] == other[0]["b"] == again[0]["c"]
    cache = engine.stats().drafts.sources["cache"]
    assert cache.accepted_tokens >= 20 and again[3]["c"] < 0.7 * first[3]["a"]


def test_a_prediction_coming_true_lengthens_drafts_before_it_is_decided():
    policy = LengthPolicy(row_cost=0.1, max_tokens=16)
    state = RequestDrafting()
    p = state.pending["cache"] = Prediction("cache", bucket(40), list(range(16)))
    before = policy.length(policy.rate(state, "cache", bucket(40)), 1, 16)
    assert p.check(list(range(6))) is None  # six came true, ten to go
    after = policy.length(policy.rate(state, "cache", bucket(40)), 1, 16)
    assert before == 1 and after >= 10
    assert policy.rate(state, "text", bucket(40)) == pytest.approx(0.3)  # another source's
