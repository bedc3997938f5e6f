"""A schema-driven fuzz run (schemathesis) over a live server's OpenAPI document."""

from __future__ import annotations

import os

import httpx

FUZZ_EXAMPLES = int(os.environ.get("RADIXSERVE_FUZZ_EXAMPLES", "10"))
# what only an internal exception's text would say: errors name the API's fields instead
INTERNAL_WORDS = ("SamplingParams", "__init__", "keyword argument", "Traceback")


def fuzz(
    url: str, op, mode, seen: dict[int, int], failures: list[str], headers, model, examples
) -> None:
    """``examples`` cases of one operation; valid bodies name the served ``model``; ``seen``
    counts the statuses."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Unsatisfiable

    positive = mode.name == "POSITIVE"

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(case=op.as_strategy(generation_mode=mode))
    def check(case):
        if positive and isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = model
        r = case.call(base_url=url, headers=headers, timeout=120)
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        if r.status_code >= 500 or any(word in r.text for word in INTERNAL_WORDS):
            failures.append(f"{op.method} {op.path} {case.body!r} -> {r.text[:300]}")

    try:
        check()
    except Unsatisfiable:
        pass  # nothing to make invalid (an operation without a body or parameters)


def fuzz_schema(
    url: str,
    headers: dict[str, str],
    model: str,
    examples: int = FUZZ_EXAMPLES,
    skip=(),
    by_operation: dict[str, dict[int, int]] | None = None,
) -> tuple[dict, list]:
    """``examples`` valid and (for POST) invalid cases of every operation but those in
    ``skip`` (``"METHOD /path"``): the status codes seen, and the 5xx answers and the errors
    that name internals (a class, a constructor's complaint). ``by_operation``, when given,
    receives the status codes of each operation (``"METHOD /path"``)."""
    import schemathesis
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_dict(
        httpx.get(url + "/openapi.json", headers=headers, timeout=30).json()
    )
    seen: dict[int, int] = {}
    failures: list[str] = []
    for result in schema.get_all_operations():
        op = result.ok()
        name = f"{op.method.upper()} {op.path}"
        if name in skip:
            continue
        counts = by_operation.setdefault(name, {}) if by_operation is not None else {}
        fuzz(url, op, GenerationMode.POSITIVE, counts, failures, headers, model, examples)
        if op.method.upper() == "POST":
            fuzz(url, op, GenerationMode.NEGATIVE, counts, failures, headers, model, examples)
        for status, n in counts.items():
            seen[status] = seen.get(status, 0) + n
    return seen, failures
