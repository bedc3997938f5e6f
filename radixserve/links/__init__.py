"""Who may connect to the fleet's sockets: CurveZMQ keys for the ZeroMQ links (KV events and
their replay, KV transfers) and TLS settings for the HTTP links.

``keys``: key pairs, allow-lists, their files and environment variables, and the security of
one process's ZeroMQ sockets (``ZmqSecurity``: CurveZMQ keys, or ``PLAIN`` when asked for
unauthenticated sockets). ``guard``: the ZAP handler that admits clients by key on a
process's server sockets and counts (and logs once) the connections it turns away.
``sealed``: bulk payloads (the KV of transfers) under AES-256-GCM with per-connection keys
agreed over a CurveZMQ channel. ``tls``: the SSL contexts of HTTPS servers and of clients that
check their certificates. ``flags``: their command-line flags (``serve``, ``router``);
``cli``: ``radixserve keys``.
"""
