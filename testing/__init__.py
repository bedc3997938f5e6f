"""Fixtures shared by the tests and the benchmarks (not part of the installed package): real
servers, routers and a Redis-protocol server on free loopback ports, a tiny random model, GGUF
files written like llama.cpp's converter writes them, a KV-transfer peer, the soak run."""
