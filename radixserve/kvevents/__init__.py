"""KV events: which blocks of KV an engine stores and removes, named by chained hashes.

Pure pieces (``hashing``, ``types``, ``wire``) import no torch and know no tree, so a router
computes the same block hashes from a request as the engine does from its radix tree. The
ZeroMQ ``publisher`` runs in the engine process; the ``subscriber`` in routers and tests.
"""
