"""The trace-driven simulator (``radixserve simulate``): the engine's own tree, eviction
policies, ledger and scheduler, and the router's policies, with a fitted timing model in place
of the model. See ``loop.py`` (the event loop), ``replay.py`` (cache-only replays, Belady)."""
