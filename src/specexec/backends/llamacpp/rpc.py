"""A target's layers on other machines, through llama.cpp's RPC backend (ggml-rpc, built in by the
README's install with -DGGML_RPC=ON).

A worker (`specexec worker`, `serve`) holds and computes a contiguous block of a model's layers with ggml's
CPU backend, for one client at a time. A model loaded with `LoadOptions.rpc` (`placement`) sends its
repeating layers to the workers and keeps the token embedding and the output head in this process, so a
verified tree's rows of logits never cross the network: what crosses it per pass is each block's input
activations (n_embd x tokens x 4 bytes), the pass's small inputs and its graph, in one round trip per
worker.

ggml-rpc aborts the whole process when a server cannot be reached, does not answer the handshake, or
speaks another protocol version. Every endpoint is parsed and asked its version, device count and free
memory here first (`probe`), so those are one-line errors, not a dead process.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import ipaddress
import math
import os
import re
import signal
import socket
import struct
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from specexec.backends.llamacpp import heartbeat
from specexec.backends.llamacpp.library import LlamaCppError, ggml_library, llama_cpp_library, rebuild_command

# The protocol of the ggml-rpc.h that llama-cpp-python 0.3.36 vendors (RPC_PROTO_MAJOR/MINOR_VERSION): a
# server must have the same major version and a minor one no newer (ggml-rpc's own handshake rule).
PROTOCOL = (7, 0)
PROBE_SECONDS = 5.0
_HELLO, _DEVICE_MEMORY, _DEVICE_COUNT = 14, 11, 15  # rpc_cmd values
_CAPS = 24  # RPC_CONN_CAPS_SIZE: all zero asks for plain TCP
# The tensors kept in this process: the output head (or the tied embedding that serves as one) and its
# norm. The input embedding stays here anyway (llama.cpp keeps the input layer on the CPU).
LOCAL_TENSORS = rb"^(output|output_norm|token_embd)\.weight$"
_ENDPOINT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):(\d{1,5})$")


def parse_endpoints(text: str) -> tuple[str, ...]:
    """The endpoints of --rpc's HOST:PORT[,HOST:PORT...], or a one-line error."""
    endpoints = tuple(part.strip() for part in text.split(",") if part.strip())
    if not endpoints:
        raise LlamaCppError("--rpc needs at least one worker, HOST:PORT")
    for endpoint in endpoints:
        match = _ENDPOINT.match(endpoint)
        if not match or not 0 < int(match.group(2)) < 65536:
            raise LlamaCppError(f"--rpc: {endpoint!r} is not HOST:PORT (a port from 1 to 65535)")
    if len(set(endpoints)) < len(endpoints):
        raise LlamaCppError("--rpc names a worker twice: a worker serves one client at a time")
    return endpoints


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine only (a worker listening there cannot be reached from others)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Worker:
    """What a worker said when asked (`probe`)."""

    endpoint: str
    version: tuple[int, int, int]
    devices: int
    free: int  # bytes of memory its first device has free
    total: int
    round_trip: float  # seconds, the fastest of its small requests
    heartbeat: bool = False  # answers heartbeats (`specexec worker`; llama.cpp's rpc-server does not)


def probe(endpoint: str, timeout: float = PROBE_SECONDS) -> Worker:
    """Ask a worker its protocol version, devices and free memory, on a connection of our own that ends
    before llama.cpp opens its (a worker serves one client at a time). One-line errors for a worker that
    does not answer within `timeout` or speaks another protocol."""
    host, port = endpoint.rsplit(":", 1)
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sent = time.perf_counter()
            hello = _request(sock, _HELLO, bytes(_CAPS), 4 + _CAPS)
            round_trip = time.perf_counter() - sent
            version = tuple(hello[:3])
            if version[0] != PROTOCOL[0] or version[1] > PROTOCOL[1]:
                raise LlamaCppError(
                    f"worker {endpoint} speaks RPC protocol {'.'.join(map(str, version))}, this llama.cpp "
                    f"{PROTOCOL[0]}.{PROTOCOL[1]}: run the same llama-cpp-python version on both"
                )
            for _ in range(3):
                sent = time.perf_counter()
                (devices,) = struct.unpack("<I", _request(sock, _DEVICE_COUNT, b"", 4))
                round_trip = min(round_trip, time.perf_counter() - sent)
            free, total = struct.unpack("<QQ", _request(sock, _DEVICE_MEMORY, struct.pack("<I", 0), 16))
    except TimeoutError:
        raise LlamaCppError(f"worker {endpoint} did not answer within {timeout:g} s") from None
    except (OSError, struct.error, _Malformed) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        raise LlamaCppError(f"worker {endpoint} cannot be reached: {reason}") from None
    if devices == 0:
        raise LlamaCppError(f"worker {endpoint} serves no device")
    beats = heartbeat.answers(endpoint, timeout=min(timeout, max(1.0, 10 * round_trip)))
    return Worker(endpoint, version, devices, free, total, round_trip, beats)  # type: ignore[arg-type]


class _Malformed(Exception):
    """A worker answered with something ggml-rpc's protocol does not allow."""


def _request(sock: socket.socket, command: int, payload: bytes, answer: int) -> bytes:
    """One RPC command: | command (1 byte) | size (8) | payload |, answered | size (8) | answer |."""
    sock.sendall(struct.pack("<BQ", command, len(payload)) + payload)
    (size,) = struct.unpack("<Q", _receive(sock, 8))
    if size != answer:
        raise _Malformed(f"an answer of {size} bytes where ggml-rpc sends {answer}")
    return _receive(sock, size)


def _receive(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise _Malformed("the connection closed")
        data += chunk
    return data


def layer_blocks(layers: int, shares: list[float]) -> list[range]:
    """Contiguous blocks of `layers` layers in proportion to `shares`, one per worker, in order."""
    if len(shares) > layers:
        raise LlamaCppError(f"{len(shares)} workers for a model of {layers} layers: at most one each")
    total = sum(shares)
    ends = [round(layers * sum(shares[: i + 1]) / total) for i in range(len(shares))]
    blocks, start = [], 0
    for i, end in enumerate(ends):
        end = max(end, start + 1)  # every worker holds at least one layer
        end = min(end, layers - (len(shares) - 1 - i))  # and leaves one for each after it
        blocks.append(range(start, end))
        start = end
    return blocks


def tensor_split(layers: int, blocks: list[range]) -> list[float]:
    """llama.cpp's `tensor_split` that puts exactly `blocks` on the devices. llama.cpp gives layer `il` the
    first device whose cumulative split exceeds il / (layers + 1) (the output layer counts as one more,
    src/llama-model.cpp), so each cumulative point goes half a layer below its block's end."""
    points = [(block.stop - 0.5) / (layers + 1) for block in blocks[:-1]] + [1.0]
    return [point - before for point, before in zip(points, [0.0] + points[:-1], strict=True)]


@dataclass
class Placement:
    """A model's layers on workers: what `apply` sets on llama.cpp's model parameters, and the ctypes
    arrays those point to, kept alive while the model loads."""

    workers: list[Worker]
    blocks: list[range]
    _arrays: tuple = ()
    _watched: bool = False

    def describe(self) -> str:
        """Which layers went where, for the stats line and the server log."""
        held = ", ".join(
            f"{w.endpoint} layers {b.start}-{b.stop - 1}"
            for w, b in zip(self.workers, self.blocks, strict=True)
        )
        return f"target over RPC: {held}; embedding and output head local"

    def apply(self, params) -> None:
        """Set the model parameters: the workers' devices, the layers split as `blocks`, the head local."""
        rpc, ggml = _rpc_library(), _ggml_library()
        devices = []
        for worker in self.workers:
            reg = rpc.ggml_backend_rpc_add_server(worker.endpoint.encode())
            if not reg:
                raise LlamaCppError(f"worker {worker.endpoint} serves no device")
            devices.append(ggml.ggml_backend_reg_dev_get(reg, 0))  # one device a worker: its CPU
        device_array = (ctypes.c_void_p * (len(devices) + 1))(*devices, None)
        layers = self.blocks[-1].stop
        split = (ctypes.c_float * _max_devices())(*tensor_split(layers, self.blocks))
        overrides = (_BufferOverride * 2)(
            _BufferOverride(LOCAL_TENSORS, _cpu_buffer_type()), _BufferOverride()
        )
        params.devices = ctypes.cast(device_array, ctypes.c_void_p)
        params.tensor_split = split
        params.tensor_buft_overrides = ctypes.cast(overrides, ctypes.c_void_p)
        params.n_gpu_layers = -1  # every layer on the devices, but for LOCAL_TENSORS
        self._arrays = (device_array, split, overrides)
        _end_in_one_line_on_abort()
        _note_graphs_sent_whole()

    def watch(self) -> None:
        """Once the workers are connected (`apply`), before the load, and again after it (the load opens
        more connections; the rest is done once): a worker that stops acknowledging what is sent to it
        for LOST_AFTER_MS ends the connection (TCP_USER_TIMEOUT on this process's connections to the
        workers), so a worker gone from the network ends a pass in seconds instead of TCP's minutes.
        Keep-alive probes every second while a pass waits for a worker's answer give the timeout
        something to wait for even when this side has nothing left to send. A worker that answers
        heartbeats and stops answering them for heartbeat.LOST_AFTER seconds while a call waits on the
        workers (`on_workers`: stopped, hung, cut off behind something that still acknowledges) ends the
        call too (`_watch_heartbeats`). And Ctrl-C ends such a call that a worker never answers
        (`_cut_on_interrupt`)."""
        for sock in _connections(tuple(w.endpoint for w in self.workers)):
            with sock:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, LOST_AFTER_MS)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 1)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
        if not self._watched:
            self._watched = True
            beating = [w.endpoint for w in self.workers if w.heartbeat]
            _watch_heartbeats(beating)
            weakref.finalize(self, _unwatch_heartbeats, beating)  # the model gone, its workers may go too
            _cut_on_interrupt()

    def record(self) -> dict:
        """What a benchmark's machine record says of the workers."""
        return {
            "placement": self.describe(),
            "graph_reuse": graph_reuse_on(),
            "workers": [
                {"endpoint": w.endpoint, "layers": [b.start, b.stop - 1], "round_trip_ms": w.round_trip * 1e3,
                 "free_bytes": w.free, "protocol": ".".join(map(str, w.version)), "heartbeat": w.heartbeat}
                for w, b in zip(self.workers, self.blocks, strict=True)
            ],
        }  # fmt: skip

    def key(self) -> str:
        """What the calibration keys on: each worker, its layers, and the round trip to it, rounded to a
        power of two milliseconds (a loopback's jitter stays in one step, a network's delay does not),
        and whether graphs are reused."""
        held = ",".join(
            f"{w.endpoint}[{b.start}-{b.stop - 1}]{_round_trip_step(w.round_trip):g}ms"
            for w, b in zip(self.workers, self.blocks, strict=True)
        )
        return held + ("+graph-reuse" if graph_reuse_on() else "")  # a repeated pass sends no graph


def _round_trip_step(seconds: float) -> float:
    """`seconds` in milliseconds, to the nearest power of two, 0.25 ms at least."""
    return max(0.25, 2.0 ** round(math.log2(max(seconds * 1e3, 1e-6))))


def placement(endpoints: tuple[str, ...], layers: int, split: tuple[float, ...] | None) -> Placement:
    """Where `layers` layers go on the workers at `endpoints`: in proportion to `split`, or by default to
    each worker's free memory (llama.cpp's default)."""
    workers = [_probed(endpoint) for endpoint in endpoints]
    if split is not None and len(split) != len(workers):
        raise LlamaCppError(f"--split gives {len(split)} shares for {len(workers)} workers")
    shares = list(split) if split is not None else [float(w.free or 1) for w in workers]
    return Placement(workers, layer_blocks(layers, shares))


_ANSWERED: dict[str, Worker] = {}  # the workers this process probed, by endpoint


def _probed(endpoint: str) -> Worker:
    """`probe(endpoint)`, or what it answered before while this process is connected to it still: a
    worker serves one client at a time, and llama.cpp keeps its connection to a worker open while any
    model on it lives, so a second model on the same workers (the bench's peers) cannot probe again."""
    if endpoint in _ANSWERED and _connected(endpoint):
        return _ANSWERED[endpoint]
    _ANSWERED[endpoint] = probe(endpoint)
    return _ANSWERED[endpoint]


def _connected(endpoint: str) -> bool:
    """Whether this process holds a connection to `endpoint`."""
    connections = list(_connections((endpoint,)))
    for sock in connections:
        sock.close()
    return bool(connections)


def model_layers(gguf: Path) -> int:
    """The repeating layers of the model in `gguf` (its `<arch>.block_count`)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    return int(reader.fields[f"{arch}.block_count"].parts[-1][0])


@functools.cache
def graph_reuse_safe() -> bool:
    """Whether llama.cpp may reuse graphs of a model on workers here: this llama-cpp-python was built with
    llama_cpp_build.cmake's RPC fix. A reused graph is recomputed on a worker as the graph it stored last
    (RPC_CMD_GRAPH_RECOMPUTE) instead of being sent again, but a worker forgets its stored graphs whenever
    a buffer is freed on it (a context freed, a cache grown) and llama.cpp's client does not: the worker
    refused the next reused graph, closed the connection, and ggml-rpc aborted the process. The fix makes
    the client forget too."""
    ggml = _ggml_library()
    reg = ggml.ggml_backend_reg_by_name(b"RPC")
    return bool(reg) and bool(ggml.ggml_backend_reg_get_proc_address(reg, b"specexec_graph_reuse_safe"))


def graph_reuse_on() -> bool:
    """Whether a model's contexts made now on workers reuse graphs: safe here, and not switched off by
    the user (llama.cpp's switch, read as C's atoi reads it)."""
    number = re.match(r"\s*([+-]?\d+)", os.environ.get(_GRAPH_REUSE_SWITCH, ""))
    return graph_reuse_safe() and not (number and int(number.group(1)) != 0)


@functools.cache
def _note_graphs_sent_whole() -> None:
    """Say once, where this build cannot reuse graphs over RPC, that every pass sends its graph and how
    to rebuild."""
    if not graph_reuse_safe():
        print(
            "specexec: note: this llama-cpp-python was built without specexec's RPC fix, so every pass sends "
            f"the workers its graph (plain decoding is slower); rebuild it: {rebuild_command()}",
            file=sys.stderr,
        )


@contextlib.contextmanager
def graph_reuse_off(on_workers: bool) -> Iterator[None]:
    """While a context of a model is made: llama.cpp's graph reuse off for it if the model is on workers
    and reuse is not safe there (`graph_reuse_safe`); every pass then sends its graph whole. llama.cpp
    reads the switch when it makes a context."""
    if not on_workers or graph_reuse_safe():
        yield
        return
    before = os.environ.get(_GRAPH_REUSE_SWITCH)
    os.environ[_GRAPH_REUSE_SWITCH] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[_GRAPH_REUSE_SWITCH]
        else:
            os.environ[_GRAPH_REUSE_SWITCH] = before


_GRAPH_REUSE_SWITCH = "LLAMA_GRAPH_REUSE_DISABLE"


def serve(host: str, port: int, threads: int) -> None:
    """Serve this machine's CPU as one worker at host:port until the process ends (blocks). Returns only
    if the server could not start (the port taken, say)."""
    rpc, ggml = _rpc_library(), _ggml_library()
    cpu = ggml.ggml_backend_dev_by_type(0)  # GGML_BACKEND_DEVICE_TYPE_CPU
    devices = (ctypes.c_void_p * 1)(cpu)
    rpc.ggml_backend_rpc_start_server(f"{host}:{port}".encode(), None, threads, 1, devices)


_EXITING = False


def exiting() -> bool:
    """Whether the interpreter is exiting. Models on workers then leave their memory to the OS: a worker
    may be gone by then (a test's, a stopped one), and freeing a buffer on it would wait forever."""
    return _EXITING


@atexit.register  # before the interpreter clears modules and finalizes what they held
def _note_exit() -> None:
    global _EXITING
    _EXITING = True


LOST_AFTER_MS = 10_000  # a worker that acknowledges nothing for this long is taken for gone


def traffic(endpoints: tuple[str, ...]) -> tuple[int, int]:
    """Bytes this process has sent to and received from the workers at `endpoints` (the kernel's
    counts of its TCP connections to them: TCP_INFO's bytes_acked and bytes_received)."""
    sent = received = 0
    for sock in _connections(endpoints):
        with sock:
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_BYTES)
        acked, got = struct.unpack_from("<QQ", info, 120)  # tcpi_bytes_acked, tcpi_bytes_received
        sent, received = sent + acked, received + got
    return sent, received


def _connections(endpoints: tuple[str, ...]) -> Iterator[socket.socket]:
    """This process's TCP connections to `endpoints` (llama.cpp's own), each as a socket on a duplicate of
    its descriptor: options set on it are the connection's, closing it closes the duplicate only."""
    wanted = {_address(endpoint) for endpoint in endpoints}
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(fd)))
        except OSError:
            continue  # closed meanwhile
        try:
            if sock.type == socket.SOCK_STREAM and sock.getpeername()[:2] in wanted:
                yield sock
                continue
        except OSError:
            pass  # not connected
        sock.close()


_calls = 0  # calls into llama.cpp that may wait on the workers, in flight (`on_workers`)
_interrupted = False
_lost: str | None = None  # the worker whose heartbeats stopped during a call
INTERRUPT_GRACE = 2.0  # seconds a call on workers may take to end after Ctrl-C before its connections are cut


@contextlib.contextmanager
def on_workers() -> Iterator[None]:
    """Around a call into llama.cpp that may wait on a model's workers (a pass, the cache copied or
    cleared, a context made or freed): one that a worker's missed heartbeats or Ctrl-C may end by cutting
    the connections."""
    global _calls
    _calls += 1
    try:
        yield
    finally:
        _calls -= 1


def _cut_connections() -> None:
    """Shut down this process's connections to every worker a model here is on: ggml-rpc, waiting on
    one of them, then aborts (`_end_in_one_line_on_abort`)."""
    for sock in _connections(tuple(_ANSWERED)):
        with sock, contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


_WATCH: heartbeat.Watch | None = None


def _watch_heartbeats(endpoints: list[str]) -> None:
    """Watch the heartbeats of the workers at `endpoints` during calls on them; cut the connections when
    one stops answering."""
    global _WATCH

    def on_lost(endpoint: str) -> None:
        global _lost
        _lost = endpoint
        _cut_connections()

    if not endpoints:
        return
    if _WATCH is None:
        _WATCH = heartbeat.Watch(in_call=lambda: _calls > 0, on_lost=on_lost)
    for endpoint in endpoints:
        _WATCH.add(endpoint)


def _unwatch_heartbeats(endpoints: list[str]) -> None:
    for endpoint in endpoints:
        _WATCH.remove(endpoint)


_WAKEUP: socket.socket | None = None


def _cut_on_interrupt() -> None:
    """Let Ctrl-C end a call on the workers (`on_workers`) that a worker never answers (a stopped or hung
    worker: it keeps the connection, and its kernel acknowledges what is sent). Python runs its SIGINT
    handler only once the call returns, which it then never does; so where this process takes SIGINT as
    Python's KeyboardInterrupt (its main thread, the default handler, no other wake-up descriptor such as
    an event loop's), the signal also wakes a thread here, and if a call on workers has not ended
    INTERRUPT_GRACE seconds later, the thread cuts the connections to the workers: ggml-rpc then aborts,
    and the abort callback says `specexec: interrupted` and exits with 130. Installed once."""
    global _WAKEUP
    if _WAKEUP is not None or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return
    read, write = socket.socketpair()
    write.setblocking(False)
    previous = signal.set_wakeup_fd(write.fileno(), warn_on_full_buffer=False)
    if previous != -1:
        signal.set_wakeup_fd(previous)  # someone else's: left to them
        read.close()
        write.close()
        return
    _WAKEUP = write  # kept open: the signal machinery writes to it

    def watch() -> None:
        global _interrupted
        while True:
            if signal.SIGINT not in read.recv(64) or not _calls:
                continue
            deadline = time.monotonic() + INTERRUPT_GRACE
            while _calls and time.monotonic() < deadline:
                time.sleep(0.05)
            if _calls:
                _interrupted = True
                _cut_connections()
                return

    threading.Thread(target=watch, name="specexec-rpc-interrupt", daemon=True).start()


_ON_ABORT = None


def _end_in_one_line_on_abort() -> None:
    """ggml-rpc aborts the process when a worker's connection breaks mid-pass (a dead or unreachable
    worker) and cannot carry on without it. Have ggml say it in one line and exit with status 1, instead
    of llama.cpp's message, a backtrace and SIGABRT. Installed once a model goes on workers."""
    global _ON_ABORT
    if _ON_ABORT is not None:
        return

    @ctypes.CFUNCTYPE(None, ctypes.c_char_p)
    def on_abort(message: bytes) -> None:
        if _interrupted:  # Ctrl-C cut the connections of a call a worker did not answer
            sys.stderr.write("specexec: interrupted\n")
            sys.stderr.flush()
            os._exit(128 + signal.SIGINT)
        if _lost is not None:
            sys.stderr.write(
                f"specexec: error: RPC worker {_lost} answered no heartbeat for {heartbeat.LOST_AFTER:g} s "
                "(stopped, hung or cut off); restart it, then specexec\n"
            )
            sys.stderr.flush()
            os._exit(1)
        said = message.decode("utf-8", "replace").split(": ", 1)[-1].strip()  # less the source file:line
        if "RPC" in said or "connect" in said.lower():
            said = f"lost the connection to an RPC worker ({said}); restart it, then specexec"
        sys.stderr.write(f"specexec: error: llama.cpp stopped: {said}\n")
        sys.stderr.flush()
        os._exit(1)

    base = _library("libggml-base")
    base.ggml_set_abort_callback.restype = ctypes.c_void_p
    base.ggml_set_abort_callback.argtypes = (ctypes.c_void_p,)
    base.ggml_set_abort_callback(ctypes.cast(on_abort, ctypes.c_void_p))
    _ON_ABORT = on_abort  # kept: ggml holds the pointer


_TCP_INFO_BYTES = 136  # struct tcp_info up to tcpi_bytes_received (Linux 4.1 and later)


def _address(endpoint: str) -> tuple[str, int]:
    """The (address, port) a socket connected to `endpoint` names as its peer."""
    host, port = endpoint.rsplit(":", 1)
    return socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)[0][4][:2]


class _BufferOverride(ctypes.Structure):
    _fields_ = (("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p))  # llama_model_tensor_buft_override


def _library(name: str) -> ctypes.CDLL:
    library = ggml_library(name)
    if library is None:
        missing = "this llama-cpp-python was built without llama.cpp's RPC backend"
        raise LlamaCppError(f"{missing}; rebuild it: {rebuild_command()}")
    return library


def _rpc_library() -> ctypes.CDLL:
    rpc = _library("libggml-rpc")
    rpc.ggml_backend_rpc_add_server.restype = ctypes.c_void_p
    rpc.ggml_backend_rpc_add_server.argtypes = (ctypes.c_char_p,)
    rpc.ggml_backend_rpc_start_server.restype = None
    rpc.ggml_backend_rpc_start_server.argtypes = (
        ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_void_p,
    )  # fmt: skip
    return rpc


def _ggml_library() -> ctypes.CDLL:
    ggml = _library("libggml")
    ggml.ggml_backend_reg_dev_get.restype = ctypes.c_void_p
    ggml.ggml_backend_reg_dev_get.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    ggml.ggml_backend_dev_by_type.restype = ctypes.c_void_p
    ggml.ggml_backend_dev_by_type.argtypes = (ctypes.c_int,)
    ggml.ggml_backend_reg_by_name.restype = ctypes.c_void_p
    ggml.ggml_backend_reg_by_name.argtypes = (ctypes.c_char_p,)
    ggml.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
    ggml.ggml_backend_reg_get_proc_address.argtypes = (ctypes.c_void_p, ctypes.c_char_p)
    return ggml


def _cpu_buffer_type() -> int:
    cpu = _library("libggml-cpu")
    cpu.ggml_backend_cpu_buffer_type.restype = ctypes.c_void_p
    return cpu.ggml_backend_cpu_buffer_type()


def _max_devices() -> int:
    return llama_cpp_library().llama_max_devices()
