"""A target's layers on RPC workers (`specexec worker`, `--rpc`), on tiny GGUFs with workers on loopback:
logits over RPC are the local ones bit for bit (the same kernels: repacking off on both sides), every
method's greedy output over RPC is `ar`'s over RPC, and bad endpoints are one-line errors, each with its
negative control."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from rpc_workers import free_port, start_worker, start_workers, stop
from test_batch_invariant import FLAT, PROMPT, assert_methods_give_ars_tokens, differing_blocks, k_quant_gguf
from test_batch_invariant import METHODS as BATCH_INVARIANT_METHODS

from specexec.backends.llamacpp import heartbeat, library, rpc, weights
from specexec.backends.llamacpp import model as model_module
from specexec.backends.llamacpp.library import LlamaCppError
from specexec.backends.llamacpp.model import LlamaCppModel
from specexec.backends.llamacpp.runner import LlamaCppRunner

NEW = 32


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = str(tmp_path_factory.mktemp("rpc"))
    return k_quant_gguf(folder, 0.0, layers=4), k_quant_gguf(folder, 0.05, layers=4)


@pytest.fixture(scope="module")
def wide_ggufs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A target and draft whose feed-forward rows span 8 K-quant blocks: ggml's tiled matmul then sums a
    row of a block in another order than one row alone (at 2, the orders agree)."""
    folder = str(tmp_path_factory.mktemp("rpc-wide"))
    return k_quant_gguf(folder, 0.0, ffn=2048), k_quant_gguf(folder, 0.05, ffn=2048)


@pytest.fixture
def plain_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Repacking off here too: a worker's CPU backend computes on plain buffers."""
    monkeypatch.setattr(weights, "extra_buffers_usable", lambda: False)


def test_the_layers_go_in_the_blocks_asked(ggufs, rpc_workers, plain_buffers) -> None:
    model = LlamaCppModel(ggufs[0], threads=1, rpc=rpc_workers, split=(3.0, 1.0))
    assert [(b.start, b.stop) for b in model.workers.blocks] == [(0, 3), (3, 4)]
    first, second = rpc_workers
    assert model.placement() == (
        f"target over RPC: {first} layers 0-2, {second} layers 3-3; embedding and output head local"
    )
    assert ":rpc127.0.0.1" in model.cost_key()


def test_llama_cpp_assigns_layers_as_tensor_split_says() -> None:
    """`tensor_split` against llama.cpp's own rule (src/llama-model.cpp: the first device whose cumulative
    share exceeds il / (layers + 1)), for every block layout of up to 3 workers on up to 40 layers."""
    for layers in range(1, 41):
        for shares in ([1.0], [1.0, 1.0], [3.0, 1.0], [1.0, 5.0, 2.0], [0.1, 0.1, 10.0]):
            if len(shares) > layers:
                continue
            blocks = rpc.layer_blocks(layers, shares)
            assert blocks[0].start == 0 and blocks[-1].stop == layers
            assert all(
                len(b) >= 1 and b.stop == after.start for b, after in zip(blocks, blocks[1:], strict=False)
            )
            cumulative, total = [], 0.0
            for share in rpc.tensor_split(layers, blocks):
                total += share
                cumulative.append(total)
            for il in range(layers):
                device = next(i for i, c in enumerate(cumulative) if c / total > il / (layers + 1))
                assert il in blocks[device], (layers, shares, il)


def test_logits_over_rpc_equal_local_logits(ggufs, rpc_workers, plain_buffers) -> None:
    local = LlamaCppModel(ggufs[0], threads=1)
    remote = LlamaCppModel(ggufs[0], threads=1, rpc=rpc_workers)
    assert not local.extra_buffers and not remote.extra_buffers
    block = torch.tensor(PROMPT[::-1] * 3)
    results = []
    for model in (local, remote):
        runner = LlamaCppRunner(model, 64)
        prefill = runner.extend(torch.tensor(PROMPT), logits_to_keep=len(PROMPT))
        n = runner.length
        positions = torch.arange(n, n + len(block))
        allowed = torch.ones(len(block), n + len(block), dtype=torch.bool).tril(n)
        results.append((prefill, runner.forward_tree(block, positions, positions, allowed, len(block))))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    sent, received = rpc.traffic(rpc_workers)
    assert sent > 0 and received > 0  # the layers did run on the workers


# One-token passes of a runner over two workers, the bytes each sent to them and their logits' sum. A
# second runner's context is made and then freed (no spare kept) between passes: a worker forgets its
# stored graphs when a buffer is freed on it.
PASSES_ROUND_A_FREE = """
import sys, torch
from specexec.backends.llamacpp import model as model_module, rpc
from specexec.backends.llamacpp.model import LlamaCppModel
from specexec.backends.llamacpp.runner import LlamaCppRunner

model_module.SPARE_CONTEXTS = 0
endpoints = tuple(sys.argv[2].split(","))
model = LlamaCppModel(sys.argv[1], threads=1, rpc=endpoints)
runner = LlamaCppRunner(model, 64)
runner.extend(torch.tensor([3, 17, 42, 7]))
sent, total = [], 0.0

def step(token):
    global total
    before = rpc.traffic(endpoints)[0]
    total += float(runner.extend(torch.tensor([token])).double().sum())
    sent.append(rpc.traffic(endpoints)[0] - before)

step(5), step(6), step(7)
other = LlamaCppRunner(model, 32)
step(8)
del other
step(9), step(10)
print(*sent, total)
"""


def test_a_repeated_pass_sends_no_graph_and_a_freed_context_ends_reuse_without_a_crash(
    ggufs, tmp_path: Path
) -> None:
    """With the README's build, llama.cpp reuses a pass's graph over RPC: a pass of the shape of the one
    before sends the workers a fraction of what a pass sends with reuse off, and gives the same logits.
    After a buffer is freed on the workers, the next pass sends its graph whole: without the build fix
    (reuse forced on), the workers refused it and the process died ("lost the connection")."""
    assert rpc.graph_reuse_safe()
    script = tmp_path / "passes.py"
    script.write_text(PASSES_ROUND_A_FREE)
    endpoints, started = start_workers(2)
    runs = {}
    try:
        for reuse in (True, False):
            env = dict(os.environ, LLAMA_GRAPH_REUSE_DISABLE="0" if reuse else "1")
            done = subprocess.run(
                [sys.executable, str(script), str(ggufs[0]), ",".join(endpoints)],
                capture_output=True, text=True, timeout=120, env=env,
            )  # fmt: skip
            assert done.returncode == 0, done.stderr
            *sent, total = done.stdout.split()
            runs[reuse] = [int(b) for b in sent], float(total)
    finally:
        for worker in started:
            stop(worker)
    (reused, reused_total), (whole, whole_total) = runs[True], runs[False]
    assert reused_total == whole_total
    graph = min(whole)  # every pass without reuse sends its graph
    assert reused[0] > graph / 2  # the first one-token pass: a new graph
    assert max(reused[1], reused[2], reused[5]) < graph / 4  # the same shape again: no graph
    assert reused[4] > graph / 2  # after the free: sent whole, and computed


def test_a_build_without_the_rpc_fix_says_once_that_graphs_are_sent_whole(
    ggufs, rpc_workers, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setattr(rpc, "graph_reuse_safe", lambda: False)
    rpc._note_graphs_sent_whole.cache_clear()
    for _ in range(2):
        LlamaCppModel(ggufs[0], threads=1, rpc=rpc_workers)
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("specexec:")]
    assert "every pass sends the workers its graph" in line and "--force-reinstall --no-cache-dir" in line
    monkeypatch.undo()
    rpc._note_graphs_sent_whole.cache_clear()
    LlamaCppModel(ggufs[0], threads=1, rpc=rpc_workers)  # the control: this build has the fix
    assert "specexec:" not in capsys.readouterr().err


def test_every_method_gives_ars_greedy_tokens_over_rpc(ggufs, rpc_workers) -> None:
    target = LlamaCppModel(ggufs[0], threads=1, rpc=rpc_workers)
    draft = LlamaCppModel(ggufs[1], threads=1)
    assert draft.workers is None
    methods = [
        dict(method="sd", budget=4),
        dict(method="dsl", budget="auto", cost_model=FLAT),
        dict(method="specinfer", budget=16, branches=4),
        dict(method="specexec", budget=32),
        dict(method="specexec", budget="auto", cost_model=FLAT),
    ]
    assert_methods_give_ars_tokens(target, draft, methods, NEW, 6)


@pytest.fixture
def default_kernel_workers() -> Iterator[Callable[..., tuple[str, ...]]]:
    """Two workers started with the given `specexec worker` options and ggml's kernels as a user's are:
    the tiled matmul on (this process turns it off for --batch-invariant, conftest)."""
    env = {name: value for name, value in os.environ.items() if name != library.TILED_MATMUL_SWITCH}
    started = []

    def start(*options: str) -> tuple[str, ...]:
        endpoints, workers = start_workers(2, *options, env=env)
        started.extend(workers)
        return endpoints

    yield start
    for worker in started:
        stop(worker)


def test_batch_invariant_workers_compute_a_row_of_a_block_as_the_row_alone(
    wide_ggufs, default_kernel_workers, monkeypatch: pytest.MonkeyPatch
) -> None:
    workers = default_kernel_workers("--batch-invariant")
    model = LlamaCppModel(wide_ggufs[0], threads=1, rpc=workers, batch_invariant=True)
    for prefix in (8, 600):
        assert differing_blocks(model, prefix) == [], prefix
    # The negative control: the default workers' rows differ, in every block the tiled matmul takes.
    monkeypatch.setattr(model_module, "_rows_as_alone", lambda model: True)
    model = LlamaCppModel(wide_ggufs[0], threads=1, rpc=default_kernel_workers(), batch_invariant=True)
    assert differing_blocks(model, 8) == [8, 16, 64, 130]


def test_batch_invariant_over_rpc_needs_batch_invariant_workers(wide_ggufs, default_kernel_workers) -> None:
    """The check at load: workers with the tiled matmul on are a one-line error."""
    workers = default_kernel_workers()
    with pytest.raises(LlamaCppError) as error:
        LlamaCppModel(wide_ggufs[0], threads=1, rpc=workers, batch_invariant=True)
    assert str(error.value) == (
        "--batch-invariant: the RPC workers compute a row of a block other than the row alone (ggml's tiled "
        "matmul is on there): start each with `specexec worker --batch-invariant`"
    )
    LlamaCppModel(wide_ggufs[0], threads=1, rpc=workers)  # without the mode, the same workers serve


def test_batch_invariant_over_rpc_gives_every_methods_greedy_tokens_as_ar(
    wide_ggufs, default_kernel_workers
) -> None:
    workers = default_kernel_workers("--batch-invariant")
    target = LlamaCppModel(wide_ggufs[0], threads=1, rpc=workers, batch_invariant=True)
    draft = LlamaCppModel(wide_ggufs[1], threads=1)
    assert_methods_give_ars_tokens(target, draft, BATCH_INVARIANT_METHODS, NEW, 6)


def test_malformed_endpoints_are_one_line_errors() -> None:
    assert rpc.parse_endpoints("10.0.0.2:50052, host-b:7000,[::1]:9") == (
        "10.0.0.2:50052",
        "host-b:7000",
        "[::1]:9",
    )
    for text, said in (
        ("", "at least one worker"),
        ("10.0.0.2", "not HOST:PORT"),
        ("10.0.0.2:0", "not HOST:PORT"),
        ("10.0.0.2:70000", "not HOST:PORT"),
        ("a b:1", "not HOST:PORT"),
        ("h:1,h:1", "names a worker twice"),
    ):
        with pytest.raises(LlamaCppError, match=said):
            rpc.parse_endpoints(text)


def test_a_worker_that_does_not_answer_is_a_one_line_error() -> None:
    with fake_worker(answer=(*rpc.PROTOCOL, 0)) as endpoint:
        rpc.probe(endpoint)  # the negative control: a worker that answers
    with pytest.raises(LlamaCppError, match=r"cannot be reached: Connection refused"):
        rpc.probe(f"127.0.0.1:{free_port()}")
    with fake_worker(answer=None) as endpoint, pytest.raises(LlamaCppError, match="did not answer within"):
        rpc.probe(endpoint, timeout=0.5)


@pytest.mark.parametrize(("version", "error"), [((7, 0, 0), None), ((6, 1, 0), "speaks RPC protocol 6.1.0")])
def test_another_protocol_version_is_a_one_line_error(version, error) -> None:
    with fake_worker(answer=version) as endpoint:
        if error is None:
            assert rpc.probe(endpoint).version == version  # the control: the same version passes
        else:
            with pytest.raises(LlamaCppError, match=error):
                rpc.probe(endpoint)


class fake_worker:
    """A server on loopback that answers HELLO with `answer` (a version) and the device questions as a
    worker would, or (None) accepts and never answers."""

    def __init__(self, answer: tuple[int, int, int] | None) -> None:
        self.answer = answer
        self.server = socket.create_server(("127.0.0.1", 0))
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        return f"127.0.0.1:{self.server.getsockname()[1]}"

    def __exit__(self, *exc) -> None:
        self.server.close()

    def _serve(self) -> None:
        try:
            client, _ = self.server.accept()
        except OSError:
            return
        with client:
            if self.answer is None:
                client.recv(64)
                time.sleep(2)
                return
            replies = {
                14: bytes(self.answer) + bytes(1 + 24),
                15: struct.pack("<I", 1),
                11: struct.pack("<QQ", 1, 2),
            }
            while header := client.recv(9):
                command, size = struct.unpack("<BQ", header)
                if size:
                    client.recv(size)
                reply = replies[command]
                client.sendall(struct.pack("<Q", len(reply)) + reply)


def test_rpc_is_refused_with_ram_and_split_needs_it(ggufs, rpc_workers) -> None:
    with pytest.raises(LlamaCppError, match="--rpc puts the target's layers on workers, --ram"):
        LlamaCppModel(ggufs[0], threads=1, rpc=rpc_workers, ram=1 << 20)
    with pytest.raises(LlamaCppError, match="--split gives the shares of RPC workers: it needs --rpc"):
        LlamaCppModel(ggufs[0], threads=1, split=(1.0, 1.0))
    with pytest.raises(LlamaCppError, match="--split gives 3 shares for 2 workers"):
        LlamaCppModel(ggufs[0], threads=1, rpc=rpc_workers, split=(1.0, 1.0, 1.0))
    LlamaCppModel(ggufs[0], threads=1, rpc=rpc_workers, split=(1.0, 1.0))  # the control: all well given


def test_the_worker_command_refuses_a_taken_port_and_warns_off_loopback(rpc_workers) -> None:
    port = rpc_workers[0].rsplit(":", 1)[1]
    taken = subprocess.run(
        [sys.executable, "-m", "specexec.cli", "worker", "--port", port],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert taken.returncode == 1
    assert taken.stderr.strip().splitlines() == [
        f"specexec worker: error: cannot serve on 127.0.0.1:{port}: Address already in use"
    ]
    anywhere = subprocess.run(
        [sys.executable, "-m", "specexec.cli", "worker", "--host", "0.0.0.0", "--port", port],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    warning, error = anywhere.stderr.strip().splitlines()
    assert "warning: listening on 0.0.0.0: llama.cpp's RPC protocol has no authentication" in warning
    assert "Address already in use" in error and anywhere.returncode == 1
    assert rpc.is_loopback("127.0.0.1") and rpc.is_loopback("localhost") and rpc.is_loopback("::1")
    assert not rpc.is_loopback("0.0.0.0") and not rpc.is_loopback("10.1.2.3")


GENERATE = """
import signal
import sys
import specexec
from specexec.backends.llamacpp.model import LlamaCppModel

signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, even in a background job
if sys.argv[4:] == ["wait-before-load"]:  # the worker connected, its layers not sent: go on when told
    from specexec.backends.llamacpp import rpc

    watch = rpc.Placement.watch

    def watch_then_wait(placement):
        watch(placement)
        print("connected", flush=True)
        sys.stdin.readline()

    rpc.Placement.watch = watch_then_wait
target = LlamaCppModel(sys.argv[1], threads=1, rpc=(sys.argv[2],))
print("loaded", flush=True)
for _ in range(int(sys.argv[3])):
    specexec.generate(target, None, [3, 17, 42], method="ar", max_new_tokens=64)
print("done", flush=True)
"""


def test_a_worker_killed_mid_generation_ends_it_in_one_line_and_a_restarted_one_serves(
    ggufs, tmp_path: Path
) -> None:
    script = tmp_path / "generate.py"
    script.write_text(GENERATE)
    port = free_port()
    endpoint = f"127.0.0.1:{port}"
    worker = start_worker(port)
    child = subprocess.Popen(
        [sys.executable, str(script), str(ggufs[0]), endpoint, "100000"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert child.stdout.readline() == "loaded\n"
        time.sleep(1.0)  # generating
        stop(worker)
        killed = time.monotonic()
        child.wait(timeout=30)
        assert time.monotonic() - killed < 10
    finally:
        child.kill()
    assert child.returncode == 1
    (line,) = child.stderr.read().strip().splitlines()
    assert line.startswith("specexec: error: llama.cpp stopped: lost the connection to an RPC worker")
    worker = start_worker(port)  # the next generation, once the worker is back
    try:
        again = subprocess.run(
            [sys.executable, str(script), str(ggufs[0]), endpoint, "1"], capture_output=True, text=True,
            timeout=120,
        )  # fmt: skip
    finally:
        stop(worker)
    assert again.returncode == 0 and again.stdout.splitlines() == ["loaded", "done"], again.stderr


@contextlib.contextmanager
def stopped_mid_generation(
    gguf: Path, tmp_path: Path, after: float | None = 1.0
) -> Iterator[tuple[subprocess.Popen, str]]:
    """A process generating on one worker, and the worker stopped (SIGSTOP) `after` seconds after the
    model loaded, or (None) once connected, before the model's layers are sent to it: the process and the
    worker's endpoint. The worker is continued and killed after."""
    script = tmp_path / "generate.py"
    script.write_text(GENERATE)
    port = free_port()
    worker = start_worker(port)
    before_load = ["wait-before-load"] if after is None else []
    child = subprocess.Popen(
        [sys.executable, str(script), str(gguf), f"127.0.0.1:{port}", "100000", *before_load],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        if after is None:
            assert child.stdout.readline() == "connected\n"
            worker.send_signal(signal.SIGSTOP)
            child.stdin.write("load\n")
            child.stdin.flush()
        else:
            assert child.stdout.readline() == "loaded\n"
            time.sleep(after)
            worker.send_signal(signal.SIGSTOP)
        yield child, f"127.0.0.1:{port}"
    finally:
        child.kill()
        worker.send_signal(signal.SIGCONT)
        stop(worker)


def test_ctrl_c_ends_a_pass_that_a_stopped_worker_never_answers(ggufs, tmp_path: Path) -> None:
    """A stopped worker keeps its connection, and its kernel acknowledges what is sent, so a pass waits on
    it until its heartbeats are missed (below): the negative control, the generation still waiting seconds
    later. Ctrl-C (SIGINT) ends it sooner, in one line, with status 130."""
    with stopped_mid_generation(ggufs[0], tmp_path) as (child, _):
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(timeout=rpc.INTERRUPT_GRACE)
        child.send_signal(signal.SIGINT)
        interrupted = time.monotonic()
        child.wait(timeout=30)
        assert time.monotonic() - interrupted < heartbeat.LOST_AFTER - 2 * rpc.INTERRUPT_GRACE
    assert child.returncode == 130
    assert child.stderr.read().strip() == "specexec: interrupted"


@pytest.mark.parametrize("after", [None, 0.0, 1.0])
def test_a_worker_that_stops_answering_heartbeats_ends_the_generation_in_one_line(
    after: float | None, ggufs, tmp_path: Path
) -> None:
    """A stopped worker, no Ctrl-C: its heartbeats missed for heartbeat.LOST_AFTER seconds end the
    generation in one line, with status 1 (before heartbeats, it waited for good: the test above),
    whether the worker stopped before its layers were sent (`after` None: the load, which once went
    unwatched), as the first context was made on it (0: a call that is not a pass, which once went
    unwatched too) or while it generated."""
    with stopped_mid_generation(ggufs[0], tmp_path, after) as (child, endpoint):
        stopped = time.monotonic()
        child.wait(timeout=60)
        waited = time.monotonic() - stopped
    assert heartbeat.LOST_AFTER - heartbeat.EVERY <= waited < heartbeat.LOST_AFTER + 5
    assert child.returncode == 1
    assert child.stderr.read().strip() == (
        f"specexec: error: RPC worker {endpoint} answered no heartbeat for 10 s (stopped, hung or cut "
        "off); restart it, then specexec"
    )


class heartbeats:
    """A worker's heartbeats on a UDP port of loopback, answered while `answering` is set."""

    def __init__(self) -> None:
        self.answering = threading.Event()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            data, peer = self.sock.recvfrom(64)
            if self.answering.is_set():
                self.sock.sendto(b"specexec worker!" + data[16:], peer)


def test_heartbeats_keep_a_busy_worker_and_give_up_a_silent_one_during_passes_only() -> None:
    """The watch on its own, with a worker whose answers the test turns on and off: silence between calls
    on the workers does not count, answers during a long call (a pass) keep the worker, silence during a
    call gives it up after `lost_after` seconds, and only that worker."""
    silent, steady = heartbeats(), heartbeats()
    steady.answering.set()
    in_call = threading.Event()
    lost: list[tuple[str, float]] = []
    watch = heartbeat.Watch(
        in_call.is_set, lambda e: lost.append((e, time.monotonic())), lost_after=0.6, every=0.1
    )
    watch.add(silent.endpoint)
    watch.add(steady.endpoint)
    time.sleep(1.5)  # between calls, silent
    assert lost == []
    silent.answering.set()
    in_call.set()
    time.sleep(1.5)  # a long pass, answered
    assert lost == []
    silent.answering.clear()
    quiet = time.monotonic()
    time.sleep(3.0)
    assert [endpoint for endpoint, _ in lost] == [silent.endpoint]
    assert 0.6 - 0.1 <= lost[0][1] - quiet < 1.5  # its last answer may have come a question before


def test_the_watch_lets_go_of_a_worker_once_no_model_is_on_it() -> None:
    """A worker two models were on, one freed: still watched (its silence during a call is a loss). Both
    freed: no longer watched, so a worker gone with its models is not taken for lost in a later call on
    other workers (the negative control: the same silence, watched, was)."""
    gone, steady = heartbeats(), heartbeats()
    steady.answering.set()
    lost: list[str] = []
    watch = heartbeat.Watch(lambda: True, lost.append, lost_after=0.6, every=0.1)
    watch.add(steady.endpoint)
    watch.add(gone.endpoint)
    watch.add(gone.endpoint)
    watch.remove(gone.endpoint)
    time.sleep(1.5)
    assert lost == [gone.endpoint]
    lost.clear()
    watch = heartbeat.Watch(lambda: True, lost.append, lost_after=0.6, every=0.1)
    watch.add(steady.endpoint)
    watch.add(gone.endpoint)
    watch.add(gone.endpoint)
    watch.remove(gone.endpoint)
    watch.remove(gone.endpoint)
    time.sleep(1.5)
    assert lost == []


def test_a_freed_models_workers_leave_the_watch(ggufs) -> None:
    endpoints, started = start_workers(2)
    try:
        model = LlamaCppModel(ggufs[0], threads=1, rpc=endpoints)
        assert set(endpoints) <= set(rpc._WATCH._holders)
        del model
        assert not set(endpoints) & set(rpc._WATCH._holders)
    finally:
        for worker in started:
            stop(worker)


def test_probe_says_whether_a_worker_answers_heartbeats() -> None:
    port = free_port()
    worker = start_worker(port)
    try:
        assert rpc.probe(f"127.0.0.1:{port}").heartbeat
    finally:
        stop(worker)
    with fake_worker(answer=(*rpc.PROTOCOL, 0)) as endpoint:  # the control: llama.cpp's rpc-server has none
        assert not rpc.probe(endpoint).heartbeat


def test_a_worker_that_acknowledges_nothing_is_given_up_after_a_bound(ggufs, rpc_workers) -> None:
    """TCP_USER_TIMEOUT on llama.cpp's connections to the workers: a worker gone from the network (the
    data sent to it never acknowledged) breaks the connection after LOST_AFTER_MS, which ends the pass
    as a killed worker does (above). Checked here on the connections; a lost network is not emulated."""
    model = LlamaCppModel(ggufs[0], threads=1, rpc=rpc_workers)
    connections = list(rpc._connections(rpc_workers))
    assert len(connections) >= 2 and model.workers is not None
    for sock in connections:
        with sock:
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == rpc.LOST_AFTER_MS
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 1


@pytest.mark.parametrize("loss", ["killed", "stopped"])
def test_a_server_whose_worker_is_lost_answers_503_and_serves_again_once_it_is_back(
    loss: str, tmp_path: Path
) -> None:
    """`specexec serve --rpc`: the worker killed (the next request's first pass breaks the connection) or
    stopped (its heartbeats stop), the next request is a 503 within seconds, so are the requests after
    it and /health, and once the worker is back the same server answers 200 again. Negative control:
    before the loss, the request is a 200."""
    pytest.importorskip("fastapi", reason="the server needs specexec[server]")
    import httpx
    from server_helpers import wait_serving
    from test_models import write_tiny_gguf

    target = tmp_path / "tiny.gguf"
    write_tiny_gguf(target)
    port, server_port = free_port(), free_port()
    worker = start_worker(port)
    argv = ["serve", "--target", str(target), "--draft", str(target), "--backend", "llamacpp", "--threads",
            "1", "--budget", "4", "--rpc", f"127.0.0.1:{port}", "--port", str(server_port)]  # fmt: skip
    script = "import sys; from specexec.cli import main; sys.exit(main(sys.argv[1:]))"
    server = subprocess.Popen(
        [sys.executable, "-c", script, *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "SPECEXEC_CACHE": str(tmp_path / "cache")},
    )  # fmt: skip
    url = f"http://127.0.0.1:{server_port}"
    request = {"model": "tiny", "prompt": "ab a", "max_tokens": 8}
    try:
        wait_serving(server, url, 180)
        assert httpx.post(url + "/v1/completions", json=request, timeout=60).status_code == 200
        if loss == "killed":
            stop(worker)
        else:
            worker.send_signal(signal.SIGSTOP)
        started = time.monotonic()
        lost = httpx.post(url + "/v1/completions", json=request, timeout=60)
        bound = 10 if loss == "killed" else heartbeat.LOST_AFTER + 5
        assert lost.status_code == 503 and time.monotonic() - started < bound, lost.text
        assert lost.json()["error"]["code"] == "unavailable" and "Retry-After" in lost.headers
        again = httpx.post(url + "/v1/completions", json=request, timeout=60)
        assert again.status_code == 503 and "unavailable" in again.json()["error"]["message"]
        assert httpx.get(url + "/health", timeout=10).status_code == 503
        if loss == "killed":
            worker = start_worker(port)
        else:
            worker.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 60
        while (answer := httpx.post(url + "/v1/completions", json=request, timeout=60)).status_code == 503:
            assert time.monotonic() < deadline, answer.text
            time.sleep(0.5)
        assert answer.status_code == 200 and server.poll() is None
        assert httpx.get(url + "/health", timeout=30).status_code == 200
    finally:
        server.terminate()
        output = server.communicate(timeout=30)[0]
        worker.send_signal(signal.SIGCONT)
        stop(worker)
    assert "an RPC worker lost?" in output and "serving again" in output, output
