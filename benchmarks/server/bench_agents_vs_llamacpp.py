"""Claude Code sessions end to end: radixserve against llama.cpp's server, same GGUF file.

Method. Each server is started on a free loopback port serving the same GGUF file (default
Qwen2.5-Coder-0.5B-Instruct, Q4_K_M) with the same CPU threads (``--threads``: llama.cpp's
``n_threads``, ``OMP_NUM_THREADS`` for radixserve's engine) and the same window per request
(``--context``). llama.cpp gets two slots of ``--context`` tokens each (Claude Code sends a
small request beside its main one now and then) with its prompt cache on (it reuses a slot's
longest common prefix, and keeps prompts in host RAM: ``cache_ram_mib``'s default); radixserve
gets a KV pool of two windows. Against each, in turn, ``--sessions`` Claude Code sessions
(``claude -p`` at its pinned version, ``radixserve/bench/agent_sessions.py``: offline, the
model's real window, ``--max-turns``) run one after the other in a fresh scratch git
repository, each a new session of one user (one home, as a user's sessions share one: Claude
Code writes its home's path into its system prompt, so a home per session would part every
session's prompt from the last one's after about 750 tokens): the first asks what
``hello.py`` prints, the next ones ask for a file to be written; each request's output is
capped (``--max-output``, Claude Code's ``CLAUDE_CODE_MAX_OUTPUT_TOKENS``). Every request
goes through a recording proxy (``radixserve/bench/agent_record.py``), so each session's
requests, prompt tokens, cached tokens (as the server reports them), TTFT and status are
known; the transcripts are kept in ``--out``.

The figure is the sum of the sessions' wall times per server, and the ratio llama.cpp /
radixserve. The two servers' models do not compute bit-identical logits and Claude Code
samples, so the sessions may take different paths (more or fewer requests): the request
counts and prompt tokens are printed beside the times, and the per-token figure
``seconds_per_1k_prompt_tokens`` (end-to-end seconds over all the prompt tokens sent) is a
check that a ratio is not just a shorter session. ``--order`` picks which server goes first.

Prints one JSON line. Usage:
``python -m benchmarks.server.bench_agents_vs_llamacpp [--model qwen2.5-coder-0.5b]
[--threads 2] [--sessions 2] [--max-turns 3] [--max-output 512] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
from pathlib import Path

from radixserve.bench import baselines
from radixserve.bench.agent_record import Recorded, record_session
from radixserve.bench.agent_sessions import Served, claude_session
from radixserve.bench.agents import CLAUDE_CODE, READ_TASK, WRITE_TASK, npm_bin, scratch_repo

SERVED_NAME = "qwen2.5-coder"
SYSTEMS = ("radix", "llamacpp")


def run_system(system: str, args: argparse.Namespace, exe: Path, out: Path) -> dict:
    """Start ``system``, run the sessions one after the other, stop it; the figures."""
    radix_args = ("--served-model-name", SERVED_NAME, "--max-total-tokens",
                  str(2 * args.context))  # fmt: skip
    settings = baselines.ServerSettings(
        model=args.model, slots=2, context_length=args.context, threads=args.threads,
        radix_args=radix_args, log_dir=out, startup_timeout=900.0,
    )  # fmt: skip
    repo = scratch_repo(out / f"{system}-repo")
    home = out / f"{system}-home"
    sessions: list[Recorded] = []
    with baselines.ManagedServer(system, baselines.command(system, settings), settings) as srv:
        served = Served(srv.base_url, SERVED_NAME, args.context, args.max_output)
        for i in range(args.sessions):
            task = READ_TASK if i == 0 else WRITE_TASK

            def launch(served, home, trap, task=task):
                return claude_session(exe, served, repo, task, home, egress=trap,
                                      max_turns=args.max_turns)  # fmt: skip

            name = f"{system}-session{i + 1}"
            session = record_session(srv.base_url, out, name, launch, repo, served,
                                     args.timeout, home)  # fmt: skip
            print(f"== {name}\n{session.report()}", file=sys.stderr, flush=True)
            sessions.append(session)
    figures = [s.summary() for s in sessions]
    seconds = sum(f["seconds"] for f in figures)
    prompt = sum(f["prompt_tokens"] for f in figures)
    return {
        "seconds": round(seconds, 2),
        "seconds_per_1k_prompt_tokens": round(1000 * seconds / prompt, 3) if prompt else None,
        "startup_s": round(srv.startup_s or 0.0, 1),
        "sessions": figures,
        "egress": [a for s in sessions for a in s.egress],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b",
                        help="a .gguf file or a model registry name")  # fmt: skip
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--context", type=int, default=32768, help="the window per request")
    parser.add_argument("--sessions", type=int, default=2)
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--max-output", type=int, default=512, help="output tokens per request")
    parser.add_argument("--timeout", type=float, default=5400.0, help="seconds per session")
    parser.add_argument("--order", default="radix,llamacpp")
    parser.add_argument("--out", default=None, help="transcripts and logs (default: a temp dir)")
    args = parser.parse_args()
    order = [s for s in args.order.split(",") if s]
    if sorted(order) != sorted(SYSTEMS):
        parser.error("--order names radix and llamacpp, each once")
    for name in ("threads", "context", "sessions", "max_turns", "max_output"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    args.model = baselines.gguf_path(args.model)
    out = Path(args.out or tempfile.mkdtemp(prefix="bench-agents-"))
    out.mkdir(parents=True, exist_ok=True)
    exe = npm_bin(CLAUDE_CODE)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # radixserve's engine inherits it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stop the servers on the way out
    result = {system: run_system(system, args, exe, out) for system in order}
    ours, peer = result["radix"]["seconds"], result["llamacpp"]["seconds"]
    print(json.dumps({
        "bench": "agents_vs_llamacpp", "agent": CLAUDE_CODE.spec,
        "model": Path(args.model).name, "threads": args.threads, "context": args.context,
        "sessions": args.sessions, "max_turns": args.max_turns,
        "max_output": args.max_output, "order": order,
        "out": str(out), **result,
        "llamacpp_over_radix_e2e": round(peer / ours, 2) if ours else None,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
