"""The egress trap records the proxy requests an agent makes (CONNECT, absolute URLs) and
refuses them; a bare-path request from some other program on the machine is refused but is
no agent's attempt to go outside."""

from __future__ import annotations

import socket

from radixserve.bench.agents import EgressTrap


def send(url: str, request: bytes) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(request)
        return s.recv(1024)


def test_proxy_requests_are_refused_and_recorded_bare_paths_only_refused():
    with EgressTrap() as trap:
        for request in (b"CONNECT api.example.com:443 HTTP/1.1\r\nHost: x\r\n\r\n",
                        b"GET http://example.com/x HTTP/1.1\r\nHost: example.com\r\n\r\n",
                        b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"):  # fmt: skip
            assert send(trap.url, request).startswith(b"HTTP/1.1 403")
    assert trap.attempts == ["CONNECT api.example.com:443 HTTP/1.1",
                             "GET http://example.com/x HTTP/1.1"]  # fmt: skip
