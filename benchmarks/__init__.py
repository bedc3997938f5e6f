"""Research benchmarks of radixserve: measurements behind its defaults and its docs' figures.

The product's load generator is ``radixserve bench`` (``radixserve/bench/``); these scripts
measure what it cannot from the outside: engine internals, cache tiers, fleets in the
simulator, RAG segment quality. Each states its method in its docstring and prints JSON; run
one from the repository root as a module, e.g. ``python -m benchmarks.engine.bench_engine``.
Folders: ``engine`` (forward speed, quantization), ``cache`` (the radix tree and the tiers),
``fleet`` (router, disaggregation, simulated fleets), ``rag`` (RAG segments), ``server``
(reliability). ``common`` holds the helpers they share.
"""
