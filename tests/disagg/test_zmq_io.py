"""The I/O thread behind the ZeroMQ KV transfer: closing it never frees its sockets under it.

A handler that does not return (here: one waiting for the test's word) keeps the thread
running past ``close_timeout``; close then returns, the thread's context and sockets stay
open while it still runs, and the thread frees them as it ends.
"""

from __future__ import annotations

import logging
import threading

import zmq

from radixserve.disagg.zmq_io import IOThread


class HeldIO(IOThread):
    """One bound socket; the command ``hold`` blocks the thread until ``release`` is set."""

    def __init__(self):
        super().__init__("test-held-io")
        self.entered, self.release = threading.Event(), threading.Event()

    def setup(self) -> None:
        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.bind("inproc://held-io")
        self.poller.register(self.sock, zmq.POLLIN)

    def on_message(self, sock, frames) -> None:
        pass

    def on_command(self, cmd: tuple) -> None:
        self.entered.set()
        self.release.wait(30)

    def on_tick(self, now: float) -> None:
        pass


def test_close_frees_the_context_once_the_thread_stopped():
    io = HeldIO()
    io.start()
    io.close()
    assert not io._thread.is_alive() and io.ctx.closed and io.sock.closed


def test_close_leaves_a_thread_still_running_its_sockets_and_it_frees_them_itself(caplog):
    io = HeldIO()
    io.close_timeout = 0.05
    io.start()
    io.command("hold")
    assert io.entered.wait(10)
    with caplog.at_level(logging.WARNING, logger="radixserve.disagg"):
        io.close()  # returns although the thread is still inside on_command
    assert io._thread.is_alive()
    assert not io.ctx.closed and not io.sock.closed
    assert "test-held-io did not stop" in caplog.text
    io.release.set()
    io._thread.join(10)
    assert not io._thread.is_alive() and io.ctx.closed and io.sock.closed
