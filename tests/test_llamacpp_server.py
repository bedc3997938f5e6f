"""The llama.cpp server wrapper's options: bad values are CLI errors, the micro-batch reaches
llama.cpp's parameters."""

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
    args = argparse.Namespace(model="m.gguf", port=1, parallel=1, ctx_per_slot=64, threads=1,
                              ubatch=None)  # fmt: skip
    default = llamacpp_server.build_params(args).n_ubatch
    args.ubatch = 1
    assert llamacpp_server.build_params(args).n_ubatch == 1 != default
