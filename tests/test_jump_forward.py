"""Jump forward: grammar-forced tokens computed ahead in one chunk give exactly the output of
token-by-token constrained decoding (greedy and seeded), also through retraction and with
pages, and the kept tokens are counted."""

from __future__ import annotations

import json

import jsonschema
import pytest

from radixserve.engine import SamplingParams

# Request bodies of real APIs: GitHub's "create a label", Kubernetes' ContainerPort, and a
# Stripe-style customer address (required keys, so the grammar forces every key).
GITHUB_LABEL = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "color": {"type": "string", "pattern": "^[0-9a-f]{6}$"},
        "description": {"type": "string", "maxLength": 40},
    },
    "required": ["name", "color", "description"],
    "additionalProperties": False,
}
CONTAINER_PORT = {
    "type": "object",
    "properties": {
        "containerPort": {"type": "integer", "minimum": 1, "maximum": 65535},
        "protocol": {"enum": ["TCP", "UDP", "SCTP"]},
        "name": {"type": "string", "maxLength": 15},
    },
    "required": ["containerPort", "protocol", "name"],
    "additionalProperties": False,
}
ADDRESS = {
    "type": "object",
    "properties": {
        "shipping_address_line1": {"type": "string", "maxLength": 24},
        "shipping_postal_code": {"type": "string", "pattern": "^[0-9]{5}$"},
        "shipping_country_code": {"enum": ["US", "FR", "DE", "NO"]},
        "is_default_shipping_address": {"type": "boolean"},
    },
    "required": [
        "shipping_address_line1",
        "shipping_postal_code",
        "shipping_country_code",
        "is_default_shipping_address",
    ],
    "additionalProperties": False,
}
SCHEMAS = [GITHUB_LABEL, CONTAINER_PORT, ADDRESS]


def generate(engine, prompts, schemas, params_list):
    """Every request's output token ids and finish reason, run together."""
    outs, reasons = {}, {}
    for i, (prompt, schema, params) in enumerate(zip(prompts, schemas, params_list, strict=True)):
        engine.add_request(str(i), prompt, params, grammar=("json_schema", json.dumps(schema)))
        outs[str(i)] = []
    steps = 0  # that computed something (not those waiting for the grammars to compile)
    while engine.has_unfinished():
        outputs = engine.step()
        for o in outputs:
            outs[o.request_id] += o.new_token_ids
            if o.finished:
                reasons[o.request_id] = o.finish_reason
        steps += bool(outputs)
    return outs, reasons, steps


def compare(make_engine, loaded, schemas, params, prompts, **options):
    """Run the same requests with jump forward off and on; return both runs."""
    runs = []
    for jump in (False, True):
        engine = make_engine(loaded, jump_forward=jump, **options)
        runs.append((engine, *generate(engine, prompts, schemas, params)))
    (_, off, off_reasons, off_steps), (on_engine, on, on_reasons, on_steps) = runs
    assert on == off and on_reasons == off_reasons  # the very same tokens
    return on_engine, on, on_reasons, off_steps, on_steps


def test_real_model_outputs_are_identical_and_take_fewer_steps(make_engine, real_loaded):
    engine = make_engine(real_loaded)
    chat = engine.tokenizer.encode_chat
    prompts = [
        chat([{"role": "user", "content": f"Write a JSON object: {name}."}])
        for name in ("a GitHub label", "a Kubernetes container port", "a shipping address")
    ] * 2
    greedy = SamplingParams(max_tokens=80, temperature=0)
    seeded = SamplingParams(max_tokens=80, temperature=0.8, seed=7)
    params = [greedy] * 3 + [seeded] * 3
    on_engine, outs, reasons, off_steps, on_steps = compare(
        make_engine, real_loaded, SCHEMAS * 2, params, prompts
    )
    stats = on_engine.grammar_stats()
    assert stats.forced_tokens > 20 and stats.drafted_tokens >= stats.forced_tokens
    assert on_steps < off_steps
    for i, schema in enumerate(SCHEMAS * 2):
        if reasons[str(i)] == "stop":
            jsonschema.validate(json.loads(on_engine.tokenizer.decode(outs[str(i)])), schema)
    assert sum(r == "stop" for r in reasons.values()) >= 3


@pytest.mark.parametrize("page_size", [1, 4])
def test_drafts_survive_retraction_and_pages(make_engine, page_size):
    """A pool too small for every request retracts some mid-draft; outputs stay identical and
    nothing leaks (``make_engine`` checks integrity)."""
    prompts = [[5 + i, 6, 7, 8, 9] for i in range(6)]
    params = [SamplingParams(max_tokens=60, temperature=0.0 if i % 2 else 1.0, seed=i)
              for i in range(6)]  # fmt: skip
    engine, _, _, _, _ = compare(
        make_engine, None, SCHEMAS * 2, params, prompts,
        max_total_tokens=160, page_size=page_size, chunked_prefill_size=16,
    )  # fmt: skip
    assert engine.scheduler.num_retractions > 0
    assert engine.grammar_stats().drafted_tokens > 0


def test_drafts_are_sized_by_how_much_of_the_last_one_was_kept():
    """A request's first draft has FIRST_DRAFT_TOKENS tokens; one kept whole doubles the
    next, one cut short sizes the next to what was kept (at least 2 tokens), and one of which
    fewer than 2 tokens were kept pauses drafting for DRAFT_PAUSE draws."""
    from concurrent.futures import Future

    import xgrammar as xgr

    from radixserve.engine.grammar import (
        DRAFT_PAUSE,
        FIRST_DRAFT_TOKENS,
        GrammarState,
        GrammarStats,
    )

    letters = "abcdefghijklmnopqrstuvwxyz" * 2
    vocab = sorted(set(letters)) + ["lm", "qr", "</s>"]
    info = xgr.TokenizerInfo(vocab, stop_token_ids=[len(vocab) - 1])
    compiled = Future()
    compiled.set_result(xgr.GrammarCompiler(info).compile_regex(letters))

    class Spell:  # the forced text one letter per token, as a tokenizer would draft it
        def tokens(self, text: str, limit: int) -> list[int]:
            return [vocab.index(c) for c in text][:limit]

    state = GrammarState(compiled, Spell(), GrammarStats())
    bitmask = xgr.allocate_token_bitmask(64, len(vocab))
    state.matcher.accept_token(0)  # the model drew "a"
    sizes, cuts = [], []
    for cut_at in (None, None, "l", None, "q"):
        draft = state.forced_tokens(64)
        sizes.append(len(draft))
        state.fill_rows(bitmask, 0, draft)
        if cut_at is None:  # kept whole; then the model draws the next letter itself
            state.settle(len(draft), len(draft), draft[-1] + 1)
        else:  # the model writes "lm" where the draft had "l": the rest is dropped
            cuts.append(draft.index(vocab.index(cut_at)))
            state.settle(len(draft), cuts[-1], vocab.index(cut_at + chr(ord(cut_at) + 1)))
    first = FIRST_DRAFT_TOKENS
    assert cuts == [2, 0] and sizes == [first, 2 * first, 4 * first, 2, 4]
    for _ in range(DRAFT_PAUSE):  # after a draft cut at its first token: paused
        assert state.forced_tokens(64) == []
        state.settle(0, 0, vocab.index(state.matcher.find_jump_forward_string()[0]))
    assert len(state.forced_tokens(64)) == 2
