"""Shared fixtures: a tiny random Llama saved as an HF directory (``testing/tiny_model.py``),
and the real default model."""

from __future__ import annotations

import os

# Idle OpenMP threads sleep instead of spinning. The suite runs several processes on few cores
# (the test, a server's HTTP and engine processes, a client): a spinning thread holds a core
# that another process needs, and on 2 shared cores a tiny model's decode step took 0.3 s
# instead of 6 ms. Read by libgomp when torch loads it, so set before anything imports torch;
# the servers the tests start inherit it. Threads and kernels are the same as without it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import zmq  # noqa: E402

from testing.tiny_model import save_tiny_hf_model  # noqa: E402

# The ZeroMQ links are authenticated in every test, as by default: one fleet key pair for the
# session (servers started by tests inherit it), so no test reads or writes the user's key.
os.environ["RADIXSERVE_ZMQ_KEY"] = zmq.curve_keypair()[1].decode()
os.environ.pop("RADIXSERVE_ZMQ_ALLOW", None)


@pytest.fixture(scope="session")
def default_gguf():
    from radixserve.model.loader import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def default_tokenizer(default_gguf):
    from radixserve.model.tokenizer import Tokenizer

    return Tokenizer.from_model_path(default_gguf, eos_token_ids=[2])


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_tokenizer):
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_hf_model(path)
    default_tokenizer.hf.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_loaded(tiny_model_dir):
    from radixserve.model import load_model

    return load_model(str(tiny_model_dir), dtype="float32", progress=False)


@pytest.fixture(scope="session")
def real_loaded():
    from radixserve.model import load_model

    return load_model(None, dtype="float32", progress=False)


@pytest.fixture(scope="module")
def ops():
    """The native kernels' module (the test is skipped where they did not build)."""
    from radixserve.model import native

    ops = native.paged_ops()
    if ops is None:
        pytest.skip("the native kernels did not build on this machine")
    return ops


@pytest.fixture
def float_activations():
    """Keep x in float in every native matmul (no rounding to int8 for 8+ rows), for tests
    that compare the kernels with the dequantized model at float precision. Ask for it before
    ``kernels``, whose PyTorch run needs no switch."""
    from radixserve.model import native

    ops = native.paged_ops()
    if ops is None:
        yield
        return
    before = ops.use_int8_lanes()
    ops.use_int8_lanes(0)
    yield
    ops.use_int8_lanes(int(before))


@pytest.fixture(params=["native", "pytorch"])
def kernels(request, monkeypatch):
    """Run a test with the native CPU kernels (when they build) and with PyTorch only."""
    from radixserve.model import native

    if request.param == "pytorch":
        monkeypatch.setattr(native, "paged_ops", lambda: None)
    elif native.paged_ops() is None:
        pytest.skip("the native kernels did not build on this machine")
    return request.param


@pytest.fixture
def make_engine(tiny_loaded):
    """Engine factory over the tiny model; every engine it made is integrity-checked at the end."""
    from radixserve.config import EngineConfig
    from radixserve.disagg import Disaggregation
    from radixserve.engine import Engine

    engines = []

    def make(loaded=None, **options):
        options.setdefault("max_total_tokens", 4096)
        config = EngineConfig.from_options(load_progress=False, **options)
        engine = Engine(config, loaded or tiny_loaded, transfer=Disaggregation)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.check_integrity()
