"""The ``radixserve`` command: ``generate``, ``chat``, ``serve``, ``pull``, ``bench``, ``simulate``.

The options shared by several commands (every engine option as a flag, the sampling flags)
live in ``cli_options``; each sub-command's parser comes from its own package's CLI module.
"""

from __future__ import annotations

import argparse
import sys
import time

from radixserve.cli_options import (
    add_engine_args,
    add_sampling_args,
    engine_config_from_args,
    sampling_params_from_args,
)


def cmd_generate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from radixserve.engine import LLM

    config = engine_config_from_args(parser, args)
    params = sampling_params_from_args(parser, args, config)
    with LLM.from_config(config) as llm:  # on exit, pending storage writes finish
        for prompt in args.prompts:
            t0 = time.perf_counter()
            out = llm.generate(prompt, params)[0]
            elapsed = time.perf_counter() - t0
            print(out.text)
            print(
                f"[{len(out.prompt_token_ids)} prompt tokens, {out.cached_tokens} from cache; "
                f"{len(out.token_ids)} generated in {elapsed:.2f} s; {out.finish_reason}]",
                file=sys.stderr,
            )
    return 0


def cmd_chat(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from radixserve.engine import LLM

    config = engine_config_from_args(parser, args)
    params = sampling_params_from_args(parser, args, config)
    with LLM.from_config(config) as llm:  # on exit, pending storage writes finish
        return chat_loop(llm, args, params)


def chat_loop(llm, args: argparse.Namespace, params) -> int:
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    print("radixserve chat: type a message; /reset clears the history, /exit or Ctrl-D quits.")
    while True:
        try:
            line = input("> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            history = history[:1] if args.system else []
            continue
        if not line:
            continue
        history.append({"role": "user", "content": line})
        try:
            tracker = stream_answer(llm, history, params)
        except ValueError as e:  # e.g. the history outgrew the context
            print(f"\n[error: {e}]")
            history.pop()
            continue
        history.append({"role": "assistant", "content": tracker.text})


def stream_answer(llm, history: list[dict[str, str]], params):
    """Print the answer as its tokens come, then one line of figures: the prompt's cache
    split (tokens from the cache vs computed) and the decode speed."""
    t0 = time.perf_counter()
    first = tracker = None
    for text, tracker in llm.stream(history, params):
        if first is None and tracker.token_ids:
            first = time.perf_counter()
        print(text, end="", flush=True)
    end = time.perf_counter()
    first = first or end
    n, usage = len(tracker.token_ids), tracker.usage
    prompt, cached = usage.prompt_tokens, usage.cached_tokens
    rate = (n - 1) / (end - first) if n > 1 and end > first else 0.0
    tiers, tier_config = "", llm.config.tiers
    if tier_config.host_kv_memory or tier_config.kv_storage:  # which tier the tokens came from
        split = usage.cached_by_tier().items()
        tiers = " (" + ", ".join(f"{count} {tier}" for tier, count in split) + ")"
    print(
        f"\n[prompt {prompt} tokens: {cached} from the cache{tiers}, {prompt - cached} computed; "
        f"first token after {first - t0:.2f} s; {n} tokens at {rate:.1f} tokens/s]"
    )
    return tracker


COMMANDS = ("generate", "chat", "pull", "serve", "router", "ray-serve", "bench", "simulate")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line, or with ``command`` only that sub-command's parser (each
    sub-command's module is imported to build its parser: ``serve`` starts sooner without
    the benchmark's and the router's)."""
    parser = argparse.ArgumentParser(prog="radixserve", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    wanted = set(COMMANDS) if command is None else {command}
    if "generate" in wanted:
        p = sub.add_parser("generate", help="complete one or more prompts and print the results")
        p.add_argument("prompts", nargs="+", help="prompt text")
        add_sampling_args(p, max_tokens=128)
        add_engine_args(p)
        p.set_defaults(func=cmd_generate, parser=p)
    if "chat" in wanted:
        p = sub.add_parser("chat", help="an interactive multi-turn chat in the terminal")
        p.add_argument("--system", help="a system prompt")
        add_sampling_args(p, max_tokens=512)
        add_engine_args(p)
        p.set_defaults(func=cmd_chat, parser=p)
    if "pull" in wanted:
        from radixserve.model.pull import add_pull_parser

        add_pull_parser(sub)
    _add_optional_parsers(sub, wanted)
    if "simulate" in wanted:
        from radixserve.sim.cli import add_sim_parser

        add_sim_parser(sub)
    return parser


def _add_optional_parsers(sub: argparse._SubParsersAction, wanted: set[str]) -> None:
    """The sub-commands whose dependencies are extras (HTTP, Ray, plots): left out of the
    command line when their modules cannot be imported."""
    if "serve" in wanted:
        try:
            from radixserve.fleet.cli import add_serve_parser
        except ImportError:
            pass
        else:
            add_serve_parser(sub)
    if wanted & {"router", "ray-serve"}:
        try:
            from radixserve.router.cli import add_router_parser
        except ImportError:
            pass
        else:
            if "router" in wanted:
                add_router_parser(sub)
            if "ray-serve" in wanted:
                from radixserve.fleet.ray_cli import add_ray_parser  # Ray Serve

                add_ray_parser(sub)
    if "bench" in wanted:
        try:
            from radixserve.bench.cli import add_bench_parser
        except ImportError:
            pass
        else:
            add_bench_parser(sub)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv and argv[0] in COMMANDS else None
    parser = build_parser(command)
    args = parser.parse_args(argv)
    args.argv = argv  # serve --dp passes them on
    return args.func(args.parser, args) or 0


if __name__ == "__main__":
    sys.exit(main())
