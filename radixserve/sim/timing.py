"""The timing model: how long one engine step takes, from what the step computes.

A step prefills chunks (``n`` prompt tokens of a request starting at context position ``s``)
and decodes one token for each of ``B`` requests. Its duration is linear in six features::

    t = overhead + prefill_token * P + prefill_attention * A + prefill_chunk * C
                 + decode_request * B + decode_attention * S

    P = prompt tokens computed          A = sum over those tokens of their context length
    C = prefill chunks (requests)       B = decoding requests
    S = sum of the decoding requests' context lengths

In a step that also prefills, the decoding requests run in the prefill pass (the fast decode
path takes only pure-decode steps) and count as one-token chunks in P, A and C instead.

``request_overhead + request_overhead_per_token * P + request_overhead_per_stream * S`` is
added to every request's time to first token and latency, ``P`` being its prompt's length and
``S`` the requests already in flight at its instance when it arrives: what a request spends
outside the engine's steps (HTTP, chat template, tokenizing, the engine process hop, streaming
back), which grows with its prompt and with the streams the front end serves at once; all are
measured on a real server (``served.py``), which also scales the step coefficients to the
engine as it serves. Coefficients are fitted (``fit_coefficients``, non-negative least
squares) to steps measured on the real engine by ``radixserve simulate fit`` and saved as
JSON; ``profiles/`` holds the default model's profile for the CPU it was measured on.

With a host tier, a step also copies KV between the device and the host pool (synchronously,
in the step, as the server's tier controller does on CPU): ``host_load_token`` seconds per
token loaded back to the device and ``host_write_token`` per token written to the host are
added to the step that moved them. ``kv_bytes_per_token`` (the model's KV size) turns a host
tier given in bytes (``host_kv_memory``) into tokens. All three are measured by
``radixserve simulate fit`` on the engine's own pools (``fit.measure_tier_costs``); the two
costs scale with the steps (``scaled``).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

FEATURES = (
    "overhead",
    "prefill_token",
    "prefill_attention",
    "prefill_chunk",
    "decode_request",
    "decode_attention",
)
OVERHEADS = ("request_overhead", "request_overhead_per_token", "request_overhead_per_stream")
TIER_COSTS = ("host_load_token", "host_write_token")
DEFAULT_PROFILE = "cpu-smollm2-135m"


@dataclass
class TimingModel:
    overhead: float = 0.0
    prefill_token: float = 0.0
    prefill_attention: float = 0.0
    prefill_chunk: float = 0.0
    decode_request: float = 0.0
    decode_attention: float = 0.0
    request_overhead: float = 0.0
    request_overhead_per_token: float = 0.0
    request_overhead_per_stream: float = 0.0
    host_load_token: float = 0.0  # s per token copied host -> device
    host_write_token: float = 0.0  # s per token copied device -> host
    kv_bytes_per_token: int = 0  # the model's KV bytes per token; 0: unknown
    meta: dict[str, Any] = field(default_factory=dict)  # how and where it was measured

    def __post_init__(self) -> None:
        for name in (*FEATURES, *OVERHEADS, *TIER_COSTS, "kv_bytes_per_token"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or value < 0:
                raise ValueError(f"timing model: {name} must be a number >= 0, got {value!r}")

    def coefficients(self) -> np.ndarray:
        return np.array([getattr(self, f) for f in FEATURES])

    def step_time(
        self, prefills: list[tuple[int, int]], decode_contexts: list[int] | None = None
    ) -> float:
        """Seconds for one step: ``prefills`` is (tokens, start position) per chunk."""
        return float(step_features(prefills, decode_contexts or []) @ self.coefficients())

    def decode_run(self, batch: int, context_sum: int, steps: int) -> np.ndarray:
        """End times (from the run's start) of ``steps`` pure-decode steps of ``batch``
        requests whose contexts sum to ``context_sum`` at the first step (each step adds
        ``batch`` to the sum)."""
        j = np.arange(1, steps + 1, dtype=np.float64)
        per_step = self.overhead + self.decode_request * batch
        return j * per_step + self.decode_attention * (j * context_sum + batch * j * (j - 1) / 2)

    def scaled(self, factor: float) -> TimingModel:
        """Every step ``factor`` times as long (the request overheads unchanged): e.g. one
        instance as fast as ``N`` of these with ``factor = 1 / N``."""
        steps = {f: getattr(self, f) * factor for f in (*FEATURES, *TIER_COSTS)}
        overheads = {f: getattr(self, f) for f in OVERHEADS}
        meta = {**self.meta, "scaled": factor}
        return TimingModel(**steps, **overheads, kv_bytes_per_token=self.kv_bytes_per_token,
                           meta=meta)  # fmt: skip

    def transfer_time(self, loaded_tokens: int, written_tokens: int) -> float:
        """Seconds a step spends copying KV: tokens loaded host -> device, written to host."""
        return loaded_tokens * self.host_load_token + written_tokens * self.host_write_token

    def outside_time(self, prompt_tokens: int, streams: float) -> float:
        """Seconds a request of ``prompt_tokens`` spends outside the engine's steps when
        ``streams`` other requests are in flight at its instance."""
        return (
            self.request_overhead
            + self.request_overhead_per_token * prompt_tokens
            + self.request_overhead_per_stream * streams
        )

    # ------------------------------------------------------------------ files
    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path_or_name: str | Path) -> TimingModel:
        """A JSON file, or the name of a profile shipped in ``radixserve/sim/profiles``."""
        path = Path(path_or_name).expanduser()
        if path.is_file():
            text = path.read_text()
        else:
            shipped = resources.files("radixserve.sim") / "profiles" / f"{path_or_name}.json"
            if not shipped.is_file():
                raise ValueError(
                    f"timing model {str(path_or_name)!r} is neither a file nor a shipped "
                    f"profile ({', '.join(shipped_profiles())})"
                )
            text = shipped.read_text()
        try:
            raw = json.loads(text)
            return cls(**raw)
        except (json.JSONDecodeError, TypeError) as e:
            raise ValueError(f"timing model {str(path_or_name)!r} is not valid: {e}") from e


def shipped_profiles() -> list[str]:
    root = resources.files("radixserve.sim") / "profiles"
    return sorted(p.name.removesuffix(".json") for p in root.iterdir() if p.name.endswith(".json"))


def step_features(prefills: list[tuple[int, int]], decode_contexts: list[int]) -> np.ndarray:
    """The six features of a step. A step that prefills computes its decoding requests in the
    same pass, as one-token chunks (the engine's fast decode path runs only pure-decode
    steps), so there they count as prefill chunks, not as decode requests."""
    if prefills and decode_contexts:
        prefills = [*prefills, *((1, s) for s in decode_contexts)]
        decode_contexts = []
    tokens = sum(n for n, _ in prefills)
    attention = sum(n * s + n * (n + 1) / 2 for n, s in prefills)
    return np.array(
        [1.0, tokens, attention, len(prefills), len(decode_contexts), sum(decode_contexts)]
    )


def fit_coefficients(features: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """Non-negative least squares over few columns: the best fit among all subsets of the
    columns whose unconstrained solution is non-negative (exact for six columns). Rows are
    weighted by 1/seconds, so the fit minimises relative error (short decode steps count as
    much as long prefills)."""
    w = 1.0 / np.maximum(seconds, 1e-6)
    x, y = features * w[:, None], seconds * w
    best, best_err = np.zeros(x.shape[1]), float(np.sum(y**2))
    used = [c for c in range(x.shape[1]) if np.any(features[:, c])]
    for k in range(1, len(used) + 1):
        for cols in itertools.combinations(used, k):
            sol, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
            if np.any(sol < 0):
                continue
            err = float(np.sum((x[:, cols] @ sol - y) ** 2))
            if err < best_err:
                best = np.zeros(x.shape[1])
                best[list(cols)] = sol
                best_err = err
    return best


def model_from_fit(
    coefficients: np.ndarray, request_overhead: float, meta: dict[str, Any]
) -> TimingModel:
    return TimingModel(
        **{f: float(c) for f, c in zip(FEATURES, coefficients, strict=True)},
        request_overhead=request_overhead,
        meta=meta,
    )
