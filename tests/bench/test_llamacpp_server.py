"""The llama.cpp server wrapper's options: bad values are CLI errors, the micro-batch, the
attention kernel and the KV type reach llama.cpp's parameters."""

from __future__ import annotations

import argparse

import pytest

from radixserve.bench import llamacpp_server


@pytest.mark.parametrize("flag", ["--ubatch", "--threads"])
def test_a_value_below_one_is_an_error_naming_the_option(flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        llamacpp_server.main(["--model", "m.gguf", "--port", "1", flag, "0"])
    assert exit_info.value.code == 2
    assert f"{flag} must be >= 1" in capsys.readouterr().err


def test_the_micro_batch_is_set_only_when_given():
    pytest.importorskip("xllamacpp")
    args = namespace()
    default = llamacpp_server.build_params(args).n_ubatch
    args.ubatch = 1
    assert llamacpp_server.build_params(args).n_ubatch == 1 != default


def test_flash_attention_and_the_kv_type_reach_the_parameters():
    xllamacpp = pytest.importorskip("xllamacpp")
    params = llamacpp_server.build_params(namespace())
    assert params.flash_attn_type == xllamacpp.llama_flash_attn_type.LLAMA_FLASH_ATTN_TYPE_AUTO
    assert params.cache_type_k == params.cache_type_v == xllamacpp.ggml_type.GGML_TYPE_F16
    params = llamacpp_server.build_params(namespace(flash_attn="off", kv_type="f32"))
    off = xllamacpp.llama_flash_attn_type.LLAMA_FLASH_ATTN_TYPE_DISABLED
    assert params.flash_attn_type == off
    assert params.cache_type_k == params.cache_type_v == xllamacpp.ggml_type.GGML_TYPE_F32


def test_an_unknown_kv_type_is_an_error(capsys):
    with pytest.raises(SystemExit):
        llamacpp_server.main(["--model", "m.gguf", "--port", "1", "--kv-type", "q9"])
    assert "--kv-type" in capsys.readouterr().err


def namespace(**changes) -> argparse.Namespace:
    """The options as ``main`` parses them by default, with ``changes``."""
    defaults = dict(model="m.gguf", port=1, parallel=1, ctx_per_slot=64, threads=1, ubatch=None,
                    flash_attn="auto", kv_type="f16", spec="none")  # fmt: skip
    return argparse.Namespace(**{**defaults, **changes})
