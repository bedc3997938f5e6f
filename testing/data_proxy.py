"""A man in the middle of a KV transfer's sealed data connection, for tests.

``DataProxy()`` listens on a loopback port of its own (``port``: give it to the prefill side
as ``advertise_data_port``, so decode instances connect here); ``connect(data_port)`` points
it at the prefill side's real data port and starts relaying every message between them over
real ZeroMQ sockets, in a thread. ``meddle(frames)`` (settable at
any time) sees every prefill -> decode message and returns the messages to pass on instead:
tamper with it, drop it, repeat it, hold it back. What went the other way (the decode side's
BIND) is kept in ``upstream``, so a test can replay it from a connection of its own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import zmq

Frames = list[bytes]


def relay(frames: Frames) -> list[Frames]:
    return [frames]


class DataProxy:
    def __init__(self):
        self.meddle: Callable[[Frames], list[Frames]] = relay
        self.upstream: list[Frames] = []
        self._ctx = zmq.Context()
        self._front = self._ctx.socket(zmq.ROUTER)  # the decode side connects here
        self._front.linger = 0
        self.port = self._front.bind_to_random_port("tcp://127.0.0.1")
        self._back = self._ctx.socket(zmq.DEALER)  # to the prefill side's data port
        self._back.linger = 0
        self._route: bytes | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="data-proxy", daemon=True)

    def connect(self, data_port: int) -> DataProxy:
        self._back.connect(f"tcp://127.0.0.1:{data_port}")
        self._thread.start()
        return self

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._front, zmq.POLLIN)
        poller.register(self._back, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(50):
                frames = sock.recv_multipart()
                if sock is self._front:
                    self._route, frames = frames[0], frames[1:]
                    self.upstream.append(frames)
                    self._back.send_multipart(frames)
                elif self._route is not None:
                    for out in self.meddle(frames):
                        self._front.send_multipart([self._route, *out])

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        self._ctx.destroy(linger=0)
