"""Heartbeats between a client and its RPC workers, beside llama.cpp's RPC protocol, which has none.

A worker that is stopped, hung or cut off behind a proxy keeps its TCP connection, and something still
acknowledges what is sent to it, so a call waiting on it would wait for good. `specexec worker` therefore
answers small UDP datagrams on the port number its RPC server listens on (`answer`), from a thread that
runs while the server computes; a client (`Watch`) asks every worker every second while a call into
llama.cpp waits on the workers (a pass, the cache copied or cleared), and takes one that has answered
nothing for LOST_AFTER seconds for gone. A worker that answers no heartbeat at load (llama.cpp's own
rpc-server, a TCP-only proxy, a firewall) is not watched.

A datagram is _ASK or _ANSWER followed by the asker's 8-byte count; the answer is as long as the question.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable

LOST_AFTER = 10.0  # seconds without an answer, while a call waits on the workers, before a worker is gone
EVERY = 1.0  # seconds between questions
_ASK = b"specexec worker?"
_ANSWER = b"specexec worker!"
_SIZE = len(_ASK) + 8


def answer(host: str, port: int) -> bool:
    """Answer heartbeats on UDP `host`:`port` from a daemon thread, for as long as this process lives.
    False if that port cannot be bound (then clients wait on this worker, if it hangs, until Ctrl-C)."""
    family, _, _, _, address = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_DGRAM)[0]
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        sock.bind(address)
    except OSError:
        sock.close()
        return False

    def serve() -> None:
        while True:
            data, peer = sock.recvfrom(_SIZE)
            if len(data) == _SIZE and data.startswith(_ASK):
                with contextlib.suppress(OSError):
                    sock.sendto(_ANSWER + data[len(_ASK) :], peer)

    threading.Thread(target=serve, name="specexec-heartbeats", daemon=True).start()
    return True


def answers(endpoint: str, timeout: float) -> bool:
    """Whether the worker at `endpoint` answers a heartbeat within `timeout` seconds."""
    with _socket(endpoint) as sock:
        sock.settimeout(timeout)
        with contextlib.suppress(OSError):
            sock.send(_ASK + bytes(8))
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if sock.recv(_SIZE) == _ANSWER + bytes(8):
                    return True
    return False


def _socket(endpoint: str) -> socket.socket:
    """A UDP socket connected to `endpoint` (only its answers arrive; a refusal shows as an error)."""
    host, port = endpoint.rsplit(":", 1)
    family, _, _, _, address = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_DGRAM)[0]
    sock = socket.socket(family, socket.SOCK_DGRAM)
    sock.connect(address)
    return sock


class Watch:
    """While `in_call()`, ask each watched worker for a heartbeat every `every` seconds; call
    `on_lost(endpoint)` once, and stop, when one has answered nothing for `lost_after` seconds. Between
    calls nothing is asked, and silence does not count."""

    def __init__(
        self,
        in_call: Callable[[], bool],
        on_lost: Callable[[str], None],
        lost_after: float = LOST_AFTER,
        every: float = EVERY,
    ) -> None:
        self.in_call, self.on_lost = in_call, on_lost
        self.lost_after, self.every = lost_after, every
        self._sockets: dict[str, socket.socket] = {}
        self._holders: dict[str, int] = {}  # models on each watched worker
        self._heard: dict[str, float] = {}
        self._lock = threading.Lock()
        self._asked = 0
        threading.Thread(target=self._run, name="specexec-rpc-watch", daemon=True).start()

    def add(self, endpoint: str) -> None:
        """Watch the worker at `endpoint` from now on, for one more model on it."""
        with self._lock:
            if endpoint not in self._sockets:
                sock = _socket(endpoint)
                sock.setblocking(False)
                self._sockets[endpoint] = sock
                self._heard[endpoint] = time.monotonic()
            self._holders[endpoint] = self._holders.get(endpoint, 0) + 1

    def remove(self, endpoint: str) -> None:
        """One model fewer on the worker at `endpoint`: with none left, it is no longer watched (it may
        be gone for good, and no call waits on it)."""
        with self._lock:
            self._holders[endpoint] -= 1
            if not self._holders[endpoint]:
                del self._holders[endpoint], self._heard[endpoint]
                self._sockets.pop(endpoint).close()

    def _run(self) -> None:
        while True:
            time.sleep(self.every)
            with self._lock:
                lost = self._round(time.monotonic())
            if lost is not None:
                self.on_lost(lost)
                return

    def _round(self, now: float) -> str | None:
        """Read the answers; return a worker silent for `lost_after` seconds during a call, or ask again."""
        for endpoint, sock in self._sockets.items():
            if self._answered(sock):
                self._heard[endpoint] = now
        if not self.in_call():
            self._heard.update(dict.fromkeys(self._sockets, now))
            return None
        lost = [endpoint for endpoint in self._sockets if now - self._heard[endpoint] > self.lost_after]
        if lost:
            return lost[0]
        self._asked += 1
        for sock in self._sockets.values():
            with contextlib.suppress(OSError):  # refused: a dead worker, which its connection tells
                sock.send(_ASK + self._asked.to_bytes(8, "little"))
        return None

    @staticmethod
    def _answered(sock: socket.socket) -> bool:
        """Whether any answer waits on `sock` (every waiting datagram read)."""
        answered = False
        while True:
            try:
                data = sock.recv(_SIZE)
            except (BlockingIOError, InterruptedError):
                return answered
            except OSError:
                continue  # a refusal noted by the kernel: read past it
            answered = answered or data.startswith(_ANSWER)
