"""Benchmarks of prefix reuse over HTTP: workloads, a load generator, baselines and reports.

``radixserve bench`` (``cli.py``) runs named workloads (``workloads.py``) through the load
generator (``loadgen.py``) against radixserve variants and llama.cpp (``baselines.py``), or
against any OpenAI-compatible server, and writes JSON, Markdown and plots (``report.py``).
This package talks HTTP only; it knows nothing of engine internals.
"""
