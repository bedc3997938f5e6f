"""The one-pass GGUF reader gives what ``gguf.GGUFReader`` gives: every metadata value and
every tensor (shape, type, bytes), on a file with the metadata kinds real files carry."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from radixserve.model.gguf_file import GGUFFile

Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "small.gguf"
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_string("tokenizer.chat_template", "{{ messages }} ünïcode")
    w.add_token_list(["<s>", "a", "ab", "é" * 5])
    w.add_token_scores([0.0, -1.5, -2.0, -3.0])
    w.add_token_types([3, 1, 1, 1])
    w.add_bool("general.flag", True)
    w.add_uint64("general.big", 2**40)
    w.add_tensor("dense", rng.normal(size=(3, 64)).astype(np.float32))
    w.add_tensor("half", rng.normal(size=(2, 32)).astype(np.float16))
    q = gguf.quants.quantize(rng.normal(size=(5, 64)).astype(np.float32), Q.Q8_0)
    w.add_tensor("quantized", q, raw_shape=q.shape, raw_dtype=Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_reads_what_the_gguf_package_reads(small_gguf):
    ours, ref = GGUFFile(small_gguf), gguf.GGUFReader(str(small_gguf))
    keys = {k for k in ref.fields if not k.startswith("GGUF.")}  # its own pseudo-fields
    assert set(ours.fields) == keys
    for key in keys:
        assert ours.fields[key].contents() == pytest.approx(ref.fields[key].contents()), key
        assert len(ours.fields[key].data) == len(ref.fields[key].data), key
    assert ours.fields["tokenizer.ggml.tokens"].contents()[3] == "é" * 5
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors, strict=True):
        assert list(a.shape) == list(b.shape) and a.tensor_type == b.tensor_type
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data), a.name


def test_not_a_gguf_file_is_an_error(tmp_path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"NOPE" + bytes(20))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(path)


def test_a_released_tensor_reads_the_same(small_gguf):
    ours = GGUFFile(small_gguf)
    before = [t.data.copy() for t in ours.tensors]
    for t in ours.tensors:
        ours.release(t)
    for t, data in zip(ours.tensors, before, strict=True):
        assert np.array_equal(t.data, data)  # dropped pages come back from the file
