"""An emulated cluster on loopback for `specexec bench --rpc`: N `specexec worker`s, each behind a TCP
proxy that delays every byte by a one-way delay and paces it to a bandwidth, in each direction; runs one
bench over them and tears everything down. A bench run with --batch-invariant gets workers started with
it.

An emulation, not a network: the kernel here has no netem, so the delay and the bandwidth are applied in
user space, per connection and direction (a chunk leaves when the link is free, takes size / rate on
the wire, and arrives `delay` later). The workers share this machine's cores with the client, unless
--pin gives them CPUs of their own, as separate machines would have: the bench the first half of the CPUs
this process may use, the workers the rest (on 2 cores, one each: then --threads 1 --worker-threads 1, or
llama.cpp's threads spin against each other). The workers take turns on theirs: a pass goes through
them one after the other.

    python benchmarks/rpc_cluster.py --workers 2 --delay-ms 10 --mbit 200 --worker-threads 2 -- \\
        --prompts humaneval --n-prompts 4 --max-new-tokens 64 --threads 2 --out OUT
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

from specexec.backends.llamacpp import rpc

CHUNK = 1 << 16


class DelayLink:
    """One direction of a proxied connection: what `source` sends reaches `sink` `delay` seconds after it
    left a link of `rate` bytes per second."""

    def __init__(self, source: socket.socket, sink: socket.socket, delay: float, rate: float) -> None:
        self.source, self.sink, self.delay, self.rate = source, sink, delay, rate
        self.queue: list[tuple[float, int, bytes]] = []
        self.ready = threading.Condition()
        self.closed = False
        self.sent = 0
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._write, daemon=True).start()

    def _read(self) -> None:
        free_at, order = 0.0, 0
        while True:
            try:
                data = self.source.recv(CHUNK)
            except OSError:
                data = b""
            now = time.perf_counter()
            with self.ready:
                if not data:
                    self.closed = True
                    self.ready.notify()
                    return
                leaves = max(now, free_at)
                free_at = leaves + len(data) / self.rate
                heapq.heappush(self.queue, (free_at + self.delay, order, data))
                order += 1
                self.ready.notify()

    def _write(self) -> None:
        while True:
            with self.ready:
                while not self.queue and not self.closed:
                    self.ready.wait()
                if not self.queue:
                    with contextlib.suppress(OSError):
                        self.sink.shutdown(socket.SHUT_WR)
                    return
                arrives, _, data = self.queue[0]
                wait = arrives - time.perf_counter()
                if wait > 0:
                    self.ready.wait(wait)
                    continue
                heapq.heappop(self.queue)
            try:
                self.sink.sendall(data)
                self.sent += len(data)
            except OSError:
                return


class DelayProxy:
    """Listens on 127.0.0.1 (`port`) and links every connection to `target` through two DelayLinks; relays
    the worker's heartbeats (UDP, the same port numbers) `delay` late each way."""

    def __init__(self, target: tuple[str, int], delay: float, rate: float) -> None:
        self.target, self.delay, self.rate = target, delay, rate
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.beats = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.beats.bind(("127.0.0.1", self.port))
        self.upstream_beats = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.upstream_beats.connect(target)
        threading.Thread(target=self._accept, daemon=True).start()
        threading.Thread(target=self._relay_beats, daemon=True).start()

    def _relay_beats(self) -> None:
        """Each question to the worker, each answer back to whoever asked last."""
        asker = None

        def answer() -> None:
            while True:
                try:
                    data = self.upstream_beats.recv(64)
                except ConnectionRefusedError:
                    continue  # the worker gone: no answer
                except OSError:
                    return
                if asker is not None:
                    _later(self.delay, self.beats.sendto, data, asker)

        threading.Thread(target=answer, daemon=True).start()
        while True:
            try:
                data, asker = self.beats.recvfrom(64)
            except OSError:
                return
            _later(self.delay, self.upstream_beats.send, data)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            DelayLink(client, upstream, self.delay, self.rate)
            DelayLink(upstream, client, self.delay, self.rate)

    def close(self) -> None:
        self.server.close()
        self.beats.close()
        self.upstream_beats.close()


def _later(delay: float, send, *args) -> None:
    """`send(*args)` `delay` seconds from now, on a timer's thread; nothing if the socket closed meanwhile."""

    def run() -> None:
        with contextlib.suppress(OSError):
            send(*args)

    threading.Timer(delay, run).start()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def cluster(
    workers: int,
    threads: int,
    delay: float,
    rate: float,
    options: tuple[str, ...] = (),
    cpus: set[int] | None = None,
) -> Iterator[str]:
    """`workers` workers (`specexec worker` with `options`, on `cpus` if given) behind delay proxies;
    yields the --rpc value that reaches them."""
    ports = [free_port() for _ in range(workers)]
    worker = [sys.executable, "-m", "specexec.cli", "worker", "--threads", str(threads), *options]
    started = [
        subprocess.Popen([*worker, "--port", str(port)], stdout=subprocess.DEVNULL, preexec_fn=_on(cpus))
        for port in ports
    ]
    proxies: list[DelayProxy] = []
    try:
        for port in ports:
            deadline = time.monotonic() + 60
            while True:
                try:
                    rpc.probe(f"127.0.0.1:{port}", timeout=1)
                    break
                except rpc.LlamaCppError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
        proxies = [DelayProxy(("127.0.0.1", port), delay, rate) for port in ports]
        yield ",".join(f"127.0.0.1:{proxy.port}" for proxy in proxies)
    finally:
        for proxy in proxies:
            proxy.close()
        for worker in started:
            worker.kill()
            worker.wait()


def _on(cpus: set[int] | None):
    """What runs a child on `cpus` (None: wherever the OS puts it)."""
    return None if cpus is None else lambda: os.sched_setaffinity(0, cpus)


def split_cpus() -> tuple[set[int], set[int]]:
    """The CPUs this process may use, halved: the bench's, then the workers'."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("rpc_cluster: --pin needs 2 CPUs at least")
    half = len(cpus) // 2
    return set(cpus[:half]), set(cpus[half:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--worker-threads", type=int, default=2)
    parser.add_argument("--delay-ms", type=float, default=1.0, help="one-way delay of every link")
    parser.add_argument("--mbit", type=float, default=1000.0, help="each link's bandwidth, each way")
    parser.add_argument(
        "--pin", action="store_true", help="the bench and the workers on CPUs of their own (halves)"
    )
    parser.add_argument("bench", nargs=argparse.REMAINDER, help="-- then `specexec bench`'s arguments")
    args = parser.parse_args()
    bench = [a for a in args.bench if a != "--"]
    options = ("--batch-invariant",) if "--batch-invariant" in bench else ()  # the bench checks the workers
    link = (args.delay_ms / 1e3, args.mbit * 1e6 / 8)
    bench_cpus, worker_cpus = split_cpus() if args.pin else (None, None)
    with cluster(args.workers, args.worker_threads, *link, options, worker_cpus) as endpoints:
        link = f"{args.delay_ms:g} ms one-way, {args.mbit:g} Mbit/s"
        pinned = (
            f"; the bench on CPUs {sorted(bench_cpus)}, the workers on {sorted(worker_cpus)}"
            if args.pin
            else ""
        )
        print(
            f"rpc_cluster: {args.workers} workers behind {link}: --rpc {endpoints}{pinned}",
            file=sys.stderr,
            flush=True,
        )
        command = [sys.executable, "-m", "specexec.cli", "bench", "--rpc", endpoints, *bench]
        return subprocess.run(command, preexec_fn=_on(bench_cpus)).returncode


if __name__ == "__main__":
    sys.exit(main())
