"""llama.cpp's OpenAI-compatible server as a process (``python -m`` this module).

The PyPI package ``xllamacpp`` is a prebuilt CPU build of llama.cpp whose ``Server`` object
runs llama.cpp's own C++ HTTP server (``tools/server``) in background threads once it is
constructed; the package ships no command-line program, so this module is one. It serves until
it is sent SIGTERM or SIGINT.

Settings, and why:

- ``hostnames=["127.0.0.1"]``: loopback only.
- ``n_parallel``: slots, set to the benchmark's concurrency so no request waits for a slot.
- ``n_ctx = n_parallel * ctx_per_slot`` with ``kv_unified=False``: every slot gets
  ``ctx_per_slot`` tokens of context, the limit radixserve gets as ``--max-model-len``.
- ``cache_prompt=True``: llama.cpp's prompt cache, which reuses the longest common prefix of a
  slot's previous prompt (and picks the slot whose cached prompt is most similar); its host
  RAM prompt cache (``cache_ram_mib``) keeps its default.
- ``endpoint_metrics=True``: ``/metrics`` (Prometheus text, names ``llamacpp:*``).
- CPU threads for generation and prompt batches alike: ``--threads``.
- ``ui=False``: no web UI.
- ``--ubatch``: llama.cpp's micro-batch (``n_ubatch``, default 512 tokens). ``1`` sends every
  prompt token through the one-token (decode) kernels, one micro-batch each: llama.cpp picks
  its matmul kernels by the number of rows, so on a quantized model its logits depend on it
  (docs/benchmarks.md, *Gemma 3 270M against llama.cpp*, says by how much).
- ``--flash-attn`` (``auto``, ``on``, ``off``) and ``--kv-type`` (``f16``, ``f32``): its
  attention kernel and KV cache type (defaults ``auto`` and ``f16``), to see which of its
  numerics an answer depends on.
- ``--spec``: llama.cpp's model-free drafts (its speculative ``types``: ``ngram_mod``,
  ``ngram_simple``, ``ngram_map_k``, ``ngram_cache``) with their default settings; ``none``
  (the default) decodes token by token.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys


def build_params(args: argparse.Namespace):
    import xllamacpp

    params = xllamacpp.CommonParams()
    params.model.path = args.model
    params.hostnames = ["127.0.0.1"]
    params.port = args.port
    params.n_parallel = args.parallel
    params.kv_unified = False
    params.n_ctx = args.parallel * args.ctx_per_slot
    params.cache_prompt = True
    params.endpoint_metrics = True
    params.ui = False
    params.cpuparams.n_threads = args.threads
    params.cpuparams_batch.n_threads = args.threads
    if args.ubatch is not None:
        params.n_ubatch = args.ubatch
    params.flash_attn_type = getattr(xllamacpp.llama_flash_attn_type, FLASH_ATTN[args.flash_attn])
    kv_type = getattr(xllamacpp.ggml_type, f"GGML_TYPE_{args.kv_type.upper()}")
    params.cache_type_k = params.cache_type_v = kv_type
    if args.spec != "none":
        kind = getattr(
            xllamacpp.common_speculative_type, f"COMMON_SPECULATIVE_TYPE_{args.spec.upper()}"
        )
        params.speculative.types = [kind]
    return params


SPEC_TYPES = ("none", "ngram_mod", "ngram_simple", "ngram_map_k", "ngram_cache")


FLASH_ATTN = {"auto": "LLAMA_FLASH_ATTN_TYPE_AUTO", "on": "LLAMA_FLASH_ATTN_TYPE_ENABLED",
              "off": "LLAMA_FLASH_ATTN_TYPE_DISABLED"}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a .gguf file")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--parallel", type=int, default=1, help="slots (concurrent requests)")
    parser.add_argument("--ctx-per-slot", type=int, default=4096, help="context tokens per slot")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads")
    parser.add_argument("--ubatch", type=int, default=None,
                        help="prompt tokens per micro-batch (llama.cpp's n_ubatch)")  # fmt: skip
    parser.add_argument("--flash-attn", choices=FLASH_ATTN, default="auto")
    parser.add_argument("--kv-type", choices=("f16", "f32"), default="f16")
    parser.add_argument("--spec", choices=SPEC_TYPES, default="none",
                        help="model-free drafts (llama.cpp's speculative type)")  # fmt: skip
    args = parser.parse_args(argv)
    for name in ("port", "parallel", "ctx_per_slot", "threads", "ubatch"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    try:
        import xllamacpp
    except ImportError:
        print("xllamacpp is not installed: run `pip install xllamacpp`", file=sys.stderr)
        return 2
    stop_signals = {signal.SIGTERM, signal.SIGINT}
    # Blocked before the server's threads start, so that they inherit the mask and the
    # signals reach sigwait below; the server lives in C++ threads until the process ends.
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
    server = xllamacpp.Server(build_params(args))
    print(f"llama.cpp server listening on {server.listening_address}", flush=True)
    signal.sigwait(stop_signals)
    os._exit(0)  # skip interpreter teardown: the native server threads are not joinable


if __name__ == "__main__":
    sys.exit(main())
