"""`specexec worker`s on loopback for the tests of `--rpc`."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

from specexec.backends.llamacpp import rpc
from specexec.backends.llamacpp.library import LlamaCppError


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_worker(port: int, *options: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`specexec worker` on 127.0.0.1:`port` with `options`, once it answers; `env` its environment
    (default: this process's)."""
    worker = subprocess.Popen(
        [sys.executable, "-m", "specexec.cli", "worker", "--port", str(port), "--threads", "1", *options],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while True:
        try:
            rpc.probe(f"127.0.0.1:{port}", timeout=1)
            return worker
        except LlamaCppError:
            if worker.poll() is not None:
                raise AssertionError(f"the worker exited: {worker.stderr.read()}") from None
            assert time.monotonic() < deadline, "the worker did not start"
            time.sleep(0.2)


def start_workers(
    count: int, *options: str, env: dict[str, str] | None = None
) -> tuple[tuple[str, ...], list[subprocess.Popen]]:
    """`count` workers (`start_worker`): their endpoints, for --rpc, and their processes."""
    ports = [free_port() for _ in range(count)]
    started = [start_worker(port, *options, env=env) for port in ports]
    return tuple(f"127.0.0.1:{port}" for port in ports), started


def stop(worker: subprocess.Popen) -> None:
    worker.kill()
    worker.wait()
