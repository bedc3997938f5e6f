"""Validation without a server: sampling parameters, the engine's second check, the engine
loop's safety net, server options, and the sampling defaults read from a model."""

from __future__ import annotations

import json
import math
import pickle
import subprocess
import sys

import gguf
import msgspec
import pytest

from radixserve.api.body import lone_surrogate_at
from radixserve.api.config import ServerConfig, parse_sampling_overrides
from radixserve.api.protocol import ChatCompletionRequest, GenerateRequest
from radixserve.engine import SamplingParams
from radixserve.engine.spec import RequestSpec
from radixserve.model.generation_defaults import generation_defaults
from radixserve.server.engine_process import STEP_ERROR, EngineLoop
from radixserve.server.messages import Abort, Added, AddRequest, Outputs, Rejected, decode, encode

BAD_PARAMS = [
    ({"top_k": 10**20}, "top_k"),  # once killed the engine (int64 overflow in the sampler)
    ({"logprobs": 2.5}, "logprobs"),  # once killed the engine
    ({"logprobs": True}, "logprobs"),
    ({"logprobs": 0.5}, "logprobs"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"repetition_penalty": math.nan}, "repetition_penalty"),
    ({"top_p": math.nan}, "top_p"),
    ({"min_p": -math.inf}, "min_p"),
    ({"seed": 2**64}, "seed"),  # was "Overflow when unpacking long long"
    ({"seed": 1.5}, "seed"),
    ({"stop": {"a": 1}}, "stop"),  # was taken as the stop string "a"
    ({"stop": ["a\ud800"]}, "lone surrogate"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": 4.0}, "max_tokens"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"frequency_penalty": 3}, "frequency_penalty"),
]


@pytest.mark.parametrize("fields,needle", BAD_PARAMS)
def test_bad_sampling_params_are_refused_with_their_name(fields, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**fields)


def test_huge_top_k_within_int64_means_off_and_tiny_temperature_is_greedy():
    assert SamplingParams(top_k=2**63 - 1).top_k == 2**63 - 1
    assert SamplingParams(temperature=1e-9).greedy and not SamplingParams(temperature=0.1).greedy


def test_engine_refuses_params_that_slipped_past_construction_and_goes_on(make_engine):
    engine = make_engine()
    bad = SamplingParams(max_tokens=4)
    bad.top_k = 10**20  # as if unpickled in the engine process, where __post_init__ never ran
    bad = pickle.loads(pickle.dumps(bad))
    with pytest.raises(ValueError, match="top_k"):
        engine.add_request("bad", [5, 6, 7], bad)
    engine.add_request("good", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [o.request_id for o in outs if o.finished] == ["good"]
    engine.check_integrity()


class Recorder:
    """Stands in for the engine loop's PUSH socket."""

    def __init__(self):
        self.sent: list[tuple] = []

    def send_pyobj(self, msg):
        self.sent.append(msg)


class BrokenPull:
    def recv(self):
        return b"garbage"


def outputs_of(sent: list) -> list:
    return [out for msg in sent if isinstance(msg, Outputs) for out in msg.outputs]


def add_message(rid, prompt, params, sent_at=None) -> AddRequest:
    return AddRequest([RequestSpec(request_id=rid, prompt_ids=prompt, params=params)], sent_at)


def test_request_messages_round_trip_typed_and_refuse_what_breaks_the_schema():
    spec = RequestSpec(request_id="r", prompt_ids=[5, 6, 7], namespace="ns-1",
                       params=SamplingParams(max_tokens=3, stop=["x"]), segments=((0, 2),),
                       recompute_ratio=0.5, prefill_peer="tcp://127.0.0.1:9")  # fmt: skip
    got = decode(encode(AddRequest([spec], 1.5)))
    assert got == AddRequest([spec], 1.5) and isinstance(got.specs[0].params, SamplingParams)
    assert decode(encode(Abort("r", "stop"))) == Abort("r", "stop")
    bad = msgspec.structs.replace(spec, namespace=7)  # a namespace is text or nothing
    with pytest.raises(ValueError, match=r"\$\.specs\[1\]\.namespace"):
        decode(encode(AddRequest([spec, bad])))
    with pytest.raises(ValueError):
        decode(b"garbage")


def test_engine_loop_survives_a_failing_step_and_a_bad_message(make_engine, monkeypatch):
    engine = make_engine()
    push = Recorder()
    loop = EngineLoop(engine, BrokenPull(), push)
    loop.receive()  # an unreadable message: logged and dropped
    loop.handle(add_message("a", [5, 6, 7, 8], SamplingParams(max_tokens=50)))
    loop.handle(add_message("b", [9, 10], {"not": "params"}))
    assert push.sent[:2] == [Added(["a"]), Rejected(["b"], 0, "params must be a SamplingParams")]
    loop.step()  # the prefill of "a"
    real_step = engine.step

    def failing_step():
        raise RuntimeError("boom")

    monkeypatch.setattr(engine, "step", failing_step)
    loop.step()
    failed = outputs_of(push.sent)[-1]
    assert failed.request_id == "a" and failed.finished and failed.finish_reason == "error"
    assert failed.error == STEP_ERROR and "boom" not in failed.error
    engine.check_integrity()
    monkeypatch.setattr(engine, "step", real_step)
    loop.handle(add_message("c", [5, 6, 7, 8], SamplingParams(max_tokens=3, ignore_eos=True)))
    while engine.has_unfinished():
        loop.step()
    last = outputs_of(push.sent)[-1]
    assert last.request_id == "c" and last.finish_reason == "length"


def test_the_engine_loop_takes_one_requests_sequences_all_or_none(make_engine):
    engine = make_engine()
    push = Recorder()
    loop = EngineLoop(engine, None, push)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    specs = [RequestSpec(request_id=f"r{i}", prompt_ids=[5, 6, 7 + i], params=params)
             for i in range(3)]  # fmt: skip
    empty = RequestSpec(request_id="r3", prompt_ids=[], params=params)
    loop.handle(AddRequest([*specs, empty]))
    assert push.sent == [Rejected(["r0", "r1", "r2", "r3"], 3, "the prompt is empty")]
    assert not engine.has_unfinished() and not outputs_of(push.sent)
    engine.check_integrity()
    loop.handle(AddRequest(specs))  # the ids are free again
    assert push.sent[-1] == Added(["r0", "r1", "r2"])
    loop.step()
    first = outputs_of(push.sent)
    assert sorted(o.request_id for o in first if o.new_token_ids) == ["r0", "r1", "r2"]


def test_request_bodies_refuse_nan_lone_surrogates_and_loose_types():
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    ChatCompletionRequest.model_validate(chat)  # model may be left out
    for extra in ({"temperature": math.nan}, {"n": True}, {"max_tokens": 2.5}, {"stream": 1}):
        with pytest.raises(ValueError):
            ChatCompletionRequest.model_validate({**chat, **extra})
    surrogate = {"messages": [{"role": "user", "content": "a\ud800b"}]}
    with pytest.raises(ValueError, match=r"messages\.0\.content holds a lone surrogate"):
        ChatCompletionRequest.model_validate(surrogate)
    assert lone_surrogate_at({"a": ["ok", "\U0001f600"]}) is None
    with pytest.raises(ValueError, match="lone surrogate"):
        GenerateRequest.model_validate({"text": "\udfff"})


def test_generate_schema_describes_sampling_params():
    schema = GenerateRequest.model_json_schema()["properties"]["sampling_params"]
    assert schema["additionalProperties"] is False and "top_k" in schema["properties"]


def test_default_sampling_flag_syntax():
    assert parse_sampling_overrides("temperature=0.2, top_p=0.9,max-tokens=64") == {
        "temperature": 0.2,
        "top_p": 0.9,
        "max_tokens": 64,
    }
    for bad, needle in [("temp=1", "unknown parameter 'temp'"), ("top_p", "NAME=VALUE"),
                        ("top_p=high", "not a number")]:  # fmt: skip
        with pytest.raises(ValueError, match=needle):
            parse_sampling_overrides(bad)


def test_server_config_checks_its_options():
    for options, needle in [
        ({"max_request_sequences": 0}, "max_request_sequences"),
        ({"api_keys": ["k"], "admin_key": "k"}, "must differ"),
        ({"salt_from_api_key": True}, "needs at least one API key"),
        ({"max_request_bytes": "lots"}, "memory size"),
        ({"default_sampling": {"temp": 1}}, "unknown parameter"),
    ]:
        with pytest.raises(ValueError, match=needle):
            ServerConfig(**options)
    with pytest.raises(ValueError, match="unknown server option"):
        ServerConfig.from_options(api_key="x")


def test_serve_flags_name_themselves_in_errors(capsys):
    from radixserve.cli import main

    for argv, needle in [
        (["--default-sampling", "temperature=-1"], "--default-sampling: temperature"),
        (["--max-request-sequences", "0"], "--max-request-sequences"),
        (["--salt-from-api-key"], "--salt-from-api-key needs at least one API key"),
    ]:
        with pytest.raises(SystemExit):
            main(["serve", *argv])
        assert needle in capsys.readouterr().err


ONLY_SERVE = """
import sys
from radixserve.cli import main
try:
    main(["serve", "--port", "-1"])
except SystemExit:
    pass
print(sorted(m for m in ("radixserve.bench.cli", "radixserve.sim.cli", "fastapi", "transformers")
             if m in sys.modules))
"""


def test_a_command_line_builds_only_its_own_sub_command():
    """``serve`` parses its flags without importing the benchmark's and simulator's modules
    or the HTTP stack (those come after the engine process has started); the whole command
    line still lists every sub-command."""
    from radixserve.cli import COMMANDS, build_parser

    out = subprocess.run(
        [sys.executable, "-c", ONLY_SERVE], capture_output=True, text=True, timeout=60
    )
    assert "--port must be between 0 and 65535" in out.stderr  # the serve parser ran
    assert out.stdout.strip() == "[]"
    parser = build_parser()
    choices = next(a for a in parser._actions if a.dest == "command").choices
    assert sorted(choices) == sorted(COMMANDS)


def test_generation_defaults_from_hf_directory(tmp_path):
    assert generation_defaults(tmp_path).values == {}
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.9, "do_sample": True, "bos_token_id": 1})
    )
    found = generation_defaults(tmp_path)
    assert found.values == {"temperature": 0.6, "top_p": 0.9}
    assert found.source == "generation_config.json"
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    assert generation_defaults(tmp_path).values == {"temperature": 0.0}


def write_gguf_header(path, **fields) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in fields.items():
        name = key.replace("__", ".")
        if isinstance(value, str):
            writer.add_string(name, value)
        else:
            writer.add_float32(name, value)
    writer.add_array("tokenizer.ggml.tokens", ["a", "b", "c"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()


def test_generation_defaults_from_gguf_metadata_then_the_family_table(tmp_path, default_gguf):
    meta = tmp_path / "meta.gguf"
    write_gguf_header(meta, general__basename="smollm2", general__sampling__temp=0.3)
    found = generation_defaults(meta)
    assert found.values == {"temperature": 0.3} and "metadata" in found.source
    family = tmp_path / "family.gguf"
    write_gguf_header(family, general__basename="Qwen2.5")
    assert generation_defaults(family).values["top_k"] == 20
    real = generation_defaults(default_gguf)  # the default model: SmolLM2's model card
    assert real.values == {"temperature": 0.2, "top_p": 0.9}


class Writes:
    """A stdout that keeps every write, to see what was printed when."""

    def __init__(self):
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        pass


def test_chat_streams_tokens_and_reports_the_cache_split(make_engine, monkeypatch):
    from radixserve import LLM
    from radixserve.cli import stream_answer

    llm = LLM.from_engine(make_engine())
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    history = [{"role": "user", "content": "Tell me a story."}]
    out = Writes()
    monkeypatch.setattr("sys.stdout", out)
    first = stream_answer(llm, history, params)
    history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "More."}]
    second = stream_answer(llm, history, params)
    text_writes = [w for w in out.writes if w and not w.startswith("\n[")]
    assert len(text_writes) >= 6  # piece by piece, not the whole answer at once
    summaries = [w for w in out.writes if w.startswith("\n[prompt")]
    assert f"{first.usage.prompt_tokens} tokens: 0 from the cache" in summaries[0]
    cached = second.usage.cached_tokens
    assert cached > first.usage.prompt_tokens
    computed = second.usage.prompt_tokens - cached
    assert f"{cached} from the cache, {computed} computed" in summaries[1]
    assert "tokens/s" in summaries[1]
