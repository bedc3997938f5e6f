"""Jump forward: grammar-forced tokens computed ahead in one chunk give exactly the output of
token-by-token constrained decoding (greedy and seeded), also through retraction and with
pages, and the kept tokens are counted (the grammar alone drafts here: ``draft_sources``)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from radixserve.engine import SamplingParams
from testing.grammar_walk import LLGUIDANCE_ONLY

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
        drafts = (
            dict(draft_sources="grammar", draft_max_batch=64)
            if jump
            else dict(draft_sources="none")
        )
        engine = make_engine(loaded, **drafts, **options)
        runs.append((engine, *generate(engine, prompts, schemas, params)))
    (_, off, off_reasons, off_steps), (on_engine, on, on_reasons, on_steps) = runs
    assert on == off and on_reasons == off_reasons, (on, off)  # the very same tokens
    return on_engine, on, on_reasons, off_steps, on_steps


@pytest.mark.slow  # seconds to tens of seconds alone; runs in `make test-all`
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
    stats = on_engine.stats().drafts.sources["grammar"]
    assert stats.accepted_tokens > 20 and stats.proposed_tokens >= stats.accepted_tokens
    assert on_steps < off_steps
    for i, schema in enumerate(SCHEMAS * 2):
        if reasons[str(i)] == "stop":
            jsonschema.validate(json.loads(on_engine.tokenizer.decode(outs[str(i)])), schema)
    assert sum(r == "stop" for r in reasons.values()) >= 3


def test_llguidance_outputs_are_identical_with_and_without_drafts(make_engine, real_loaded):
    from radixserve.structured import grammar_backend

    assert grammar_backend("json_schema", json.dumps(LLGUIDANCE_ONLY)) == "llguidance"
    engine = make_engine(real_loaded)
    chat = engine.tokenizer.encode_chat
    prompts = [chat([{"role": "user", "content": f"Sign up {who} as JSON."}])
               for who in ("Ada", "Linus", "Grace")]  # fmt: skip
    params = [SamplingParams(max_tokens=80, temperature=0)] * 2
    params.append(SamplingParams(max_tokens=80, temperature=0.8, seed=3))
    on_engine, outs, reasons, off_steps, on_steps = compare(
        make_engine, real_loaded, [LLGUIDANCE_ONLY] * 3, params, prompts
    )
    stats = on_engine.grammar_stats()
    assert stats.llguidance_requests == 3 and stats.xgrammar_requests == 0
    assert on_engine.stats().drafts.sources["grammar"].accepted_tokens > 10
    assert on_steps < off_steps
    assert sum(r == "stop" for r in reasons.values()) >= 2
    for i in range(3):
        if reasons[str(i)] == "stop":
            jsonschema.validate(
                json.loads(on_engine.tokenizer.decode(outs[str(i)])), LLGUIDANCE_ONLY
            )


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
    assert grammar_drafted(engine) > 0


def grammar_drafted(engine) -> int:
    return engine.stats().drafts.sources["grammar"].proposed_tokens


@pytest.mark.parametrize("max_batch", [0, 1, 2])
def test_drafts_are_made_only_in_batches_up_to_the_limit(make_engine, max_batch):
    """Two requests that run side by side to the end (the same greedy request twice): with
    ``draft_max_batch`` 2 they draft, with 1 or 0 they do not; alone (a batch of one), a
    request drafts unless the limit is 0. The outputs are the same whatever the limit."""
    prompts = [[5, 6, 7, 8, 9]] * 2
    params = [SamplingParams(max_tokens=60, temperature=0.0)] * 2
    engine = make_engine(None, draft_sources="grammar", draft_max_batch=max_batch)
    alone = generate(engine, prompts[:1], [ADDRESS], params[:1])[0]
    drafted_alone = grammar_drafted(engine)
    assert (drafted_alone > 0) == (max_batch >= 1)
    # the grammar is compiled now, so both requests are admitted in the same step
    pair = generate(engine, prompts, [ADDRESS] * 2, params)[0]
    assert (grammar_drafted(engine) > drafted_alone) == (max_batch >= 2)
    off = make_engine(None, draft_sources="none")
    assert generate(off, prompts, [ADDRESS] * 2, params)[0] == pair
    assert generate(off, prompts[:1], [ADDRESS], params[:1])[0] == alone


class Letters:
    """A tokenizer that encodes text one letter per token (the vocabulary ``VOCAB``)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [VOCAB.index(c) for c in text]


LETTERS = "abcdefghijklmnopqrstuvwxyz" * 2
VOCAB = sorted(set(LETTERS)) + ["lm", "qr", "ab", "cd", "</s>"]


def letters_state(drafter=None):
    """A matcher for the regex ``LETTERS`` after the model drew "a", and its drafter."""
    from concurrent.futures import Future

    import xgrammar as xgr

    from radixserve.structured.grammar import Compiled, GrammarState, GrammarStats
    from radixserve.structured.jump_forward import Drafter
    from radixserve.structured.xgrammar_backend import XGrammarMatcher

    class Vocabulary:
        def matcher(self, grammar):
            return XGrammarMatcher(grammar)

    info = xgr.TokenizerInfo(VOCAB, stop_token_ids=[len(VOCAB) - 1])
    compiled = Future()
    grammar = xgr.GrammarCompiler(info).compile_regex(LETTERS)
    compiled.set_result(Compiled("xgrammar", grammar, Vocabulary()))
    drafter = drafter or Drafter(Letters(), [len(VOCAB) - 1], [t.encode() for t in VOCAB])
    state = GrammarState(compiled, drafter, GrammarStats())
    state.matcher.accept(0)
    return state, drafter


def test_tokenizer_drafts_are_sized_by_how_much_of_the_last_one_was_kept():
    """A request's first tokenizer draft has FIRST_DRAFT_TOKENS tokens; one kept whole
    doubles the next, one cut short sizes the next to what was kept (at least 2 tokens), and
    one of which fewer than 2 tokens were kept pauses those drafts for DRAFT_PAUSE draws."""
    import xgrammar as xgr

    from radixserve.structured.jump_forward import DRAFT_PAUSE, FIRST_DRAFT_TOKENS

    state, _ = letters_state()
    bitmask = xgr.allocate_token_bitmask(64, len(VOCAB))
    sizes, cuts = [], []
    for cut_at in (None, None, "l", None, "q"):
        draft = state.forced_tokens(64)
        sizes.append(len(draft))
        state.fill_rows(bitmask, 0, draft)
        if cut_at is None:  # kept whole; then the model draws the next letter itself
            state.settle(len(draft), len(draft), draft[-1] + 1)
        else:  # the model writes "lm" where the draft had "l": the rest is dropped
            cuts.append(draft.index(VOCAB.index(cut_at)))
            state.settle(len(draft), cuts[-1], VOCAB.index(cut_at + chr(ord(cut_at) + 1)))
    first = FIRST_DRAFT_TOKENS
    assert cuts == [2, 0] and sizes == [first, 2 * first, 4 * first, 2, 4]
    for _ in range(DRAFT_PAUSE):  # after a draft cut at its first token: paused
        assert state.forced_tokens(64) == []
        state.fill_rows(bitmask, 0, [])
        state.settle(0, 0, VOCAB.index(state.matcher.forced_bytes().decode()[0]))
    assert len(state.forced_tokens(64)) == 2


def spell(state, pieces: list[str]) -> None:
    """The model writes ``pieces`` one token per step, without drafts."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(1, len(VOCAB))
    for piece in pieces:
        state.forced_tokens(64)  # what core asks after each draw; the draft is not taken
        state.fill_rows(bitmask, 0, [])
        state.settle(0, 0, VOCAB.index(piece))


def test_the_model_s_own_spellings_are_drafted_as_far_as_they_agree():
    """A request writing a forced text in its own pieces teaches the drafter that spelling;
    the next request drafts it whole, and with two spellings known, only as far as they
    agree, then again after the model chose between them."""
    ids = VOCAB.index
    first, drafter = letters_state()
    # the forced text after "a" is "bcd...z" + the alphabet again; the model writes it so:
    pieces = ["b", "cd", *"efghijk", "lm", *"nop", "qr", *"stuvwxyz", "ab", *"cdefghijklmnop"]
    pieces += list("qrstuvwxyz")
    spell(first, pieces)
    second, _ = letters_state(drafter)
    assert second.forced_tokens(64) == [ids(p) for p in pieces]  # drafted whole
    other = ["b", "c", "d", *pieces[2:]]  # the second writes "cd" as "c", "d"
    spell(second, other)
    third, _ = letters_state(drafter)
    assert third.forced_tokens(64) == [ids("b")]  # the spellings part after "b"
    spell(third, ["b", "c"])
    assert third.forced_tokens(64) == [ids(p) for p in other[2:]]  # the one that fits


def draft_rows_against_single_steps(model, prompt: list[int], tokens: list[int]):
    """The logits of ``tokens`` computed as decode rows of one sequence in one step (a
    draft and the token before it), and one token per step; both after ``prompt``."""
    from radixserve.cache import KVPool
    from radixserve.model import build_forward_batch

    pool, n = KVPool(model.kv_shape(), 256), len(prompt)
    slots = torch.randperm(256, generator=torch.Generator().manual_seed(1))
    runs = []
    for one_by_one in (True, False):
        seq = slots[: n + len(tokens)] if one_by_one else slots[128 : 128 + n + len(tokens)]
        prefill = [(torch.tensor(prompt), 0, seq[:n], True)]
        model.forward(build_forward_batch([], prefill, model.device, pool.pad_slot), pool)
        rows = [(t, n + i, seq[: n + i + 1]) for i, t in enumerate(tokens)]
        if one_by_one:
            steps = [build_forward_batch([r], [], model.device, pool.pad_slot) for r in rows]
            runs.append(torch.cat([model.forward(b, pool) for b in steps]))
        else:
            batch = build_forward_batch(rows, [], model.device, pool.pad_slot, decode_sequences=1)
            runs.append(model.forward(batch, pool))
    return runs


def test_draft_rows_give_the_logits_of_single_decode_steps(real_loaded, kernels):
    """A sequence's draft as decode rows of one step (each row attending to the rows before
    it) gives each row the logits it gets decoded alone: bit for bit in the native decoder
    (ten rows of one sequence run its matmuls as single-sequence steps would: no int8
    activations, at most 7 rows a call), up to float summation order op by op."""
    model = real_loaded.model
    prompt = real_loaded.tokenizer.encode("The settings, as JSON: ")
    tokens = real_loaded.tokenizer.encode('{"delete_branch_on_merge": true}')[:10]
    assert len(tokens) == 10
    single, rows = draft_rows_against_single_steps(model, prompt, tokens)
    if kernels == "native":
        assert torch.equal(rows, single)
    assert (rows - single).abs().max() < 1e-3 * single.abs().max()
    assert torch.equal(rows.argmax(-1), single.argmax(-1))


def test_a_draft_step_runs_in_the_native_decoder(make_engine, real_loaded, ops, monkeypatch):
    """With jump forward, the steps that verify drafts run as decode rows in one native call
    (more rows than sequences), and the outputs equal token-by-token decoding's."""
    from radixserve.model import native_decode

    calls = []
    forward = native_decode.NativeDecoder.forward

    def spy(self, batch, pool):
        calls.append((batch.num_decode, batch.decode_sequences))
        return forward(self, batch, pool)

    monkeypatch.setattr(native_decode.NativeDecoder, "forward", spy)
    chat = make_engine(real_loaded).tokenizer.encode_chat
    prompts = [chat([{"role": "user", "content": "Write a JSON object: a shipping address."}])]
    greedy = [SamplingParams(max_tokens=60, temperature=0)]
    _, _, _, off_steps, on_steps = compare(make_engine, real_loaded, [ADDRESS], greedy, prompts)
    assert any(rows > seqs for rows, seqs in calls)
    assert on_steps < off_steps
