"""Shared fixtures: a tiny random Llama saved as an HF directory, and the real default model.

The tiny model uses the default model's tokenizer (vocabulary 49152) so text round-trips,
with a small random network so engine tests run in seconds. Its weights are drawn with a
larger spread than usual so greedy choices are not near-ties.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TINY_CONFIG = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)


def save_tiny_hf_model(path, config_cls_name: str = "LlamaConfig", seed: int = 0, **overrides):
    """Write a random model of the given transformers config class to ``path``."""
    import transformers

    cfg = getattr(transformers, config_cls_name)(**{**TINY_CONFIG, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15)
    model.save_pretrained(path)
    return model


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
