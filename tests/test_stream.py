"""Streaming a GGUF target from disk (`--ram`): the plan, bytes read per pass, residency, exactness, errors.

The models are tiny random GGUFs written here (8 qwen2 layers of about 4 MB in float32, so each layer is
many pages) and synced to storage, so that evicting them really sends the next pass to the disk.
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
import torch
from test_llamacpp import FLAT, METHODS
from tiny_gguf import on_storage, synced, write_random_gguf

import specexec
from specexec.backends.gguf_files import GGUFFileError, shards, split
from specexec.budget.costs import CostModel
from specexec.sizes import format_bytes
from specexec.storage import read_bytes

pytest.importorskip("llama_cpp", reason="the llama.cpp backend needs specexec[llamacpp]")

from specexec.backends.llamacpp import stream  # noqa: E402
from specexec.backends.llamacpp.library import LlamaCppError  # noqa: E402
from specexec.backends.llamacpp.model import LlamaCppModel  # noqa: E402
from specexec.backends.llamacpp.stream import reader  # noqa: E402
from specexec.backends.llamacpp.stream.os_calls import PAGE, Ring  # noqa: E402
from specexec.prefix_cache import PrefixCache  # noqa: E402

LAYERS = 8
PROMPT = [3, 17, 42, 5, 9, 11, 60, 2]
MiB = 2**20


def write_streamable(path: Path, seed: int = 0, noise: float = 0.0, **files) -> Path:
    """The model; with `files` (`write_random_gguf`'s split options), as a split GGUF (its first file
    returned)."""
    first = write_random_gguf(
        path, "qwen2", "f32", seed=seed, noise=noise, hidden=256, ffn=1024, layers=LAYERS, **files
    )
    for shard in shards(first):
        synced(shard)
    return first


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("stream")
    if not on_storage(folder):
        pytest.skip("the temporary folder is in memory (tmpfs): nothing can be streamed from it")
    write_streamable(folder / "perturbed.gguf", noise=0.01)
    return write_streamable(folder / "target.gguf")


@pytest.fixture(scope="module")
def split_gguf(gguf: Path) -> Path:
    """The same model in 4 files (`llama-gguf-split`'s layout, as large models are published), the first
    of metadata only: the first."""
    return write_streamable(gguf.parent / "split.gguf", split_max_tensors=40, metadata_first=True)


def direct_reads(path: Path) -> bool:
    """Whether the file system holding `path` takes O_DIRECT reads."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return False
    try:
        with mmap.mmap(-1, PAGE) as page:
            return os.preadv(fd, [page], 0) == PAGE
    except OSError:
        return False
    finally:
        os.close(fd)


@pytest.fixture(params=["direct", "cached"])
def reads(request: pytest.FixtureRequest, gguf: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """How streamed units are read: past the page cache into a ring (where O_DIRECT works), or through
    the page cache (elsewhere)."""
    if request.param == "direct" and not direct_reads(gguf):
        pytest.skip("this file system refuses O_DIRECT reads")
    if request.param == "cached":

        def refused(*args) -> None:  # as a file system without O_DIRECT
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))

        monkeypatch.setattr(reader, "Ring", refused)
    return request.param


def streamed_model(gguf: Path, reads: str, **kwargs) -> LlamaCppModel:
    model = LlamaCppModel(gguf, **kwargs)
    assert model.stream.reads == reads
    return model


def total_bytes(path: Path) -> int:
    """The bytes of the model's tensors, in all of its files."""
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for shard in shards(path) for t in GGUFReader(shard).tensors)


def half(path: Path) -> int:
    """A RAM size that keeps some layers resident and streams the others."""
    return stream.plan(path, 0).window_bytes + total_bytes(path) // 3


# -- the plan ---------------------------------------------------------------------------------------------


def test_the_plan_covers_every_tensor_once_and_fits_its_ram(gguf: Path) -> None:
    units, embedding = stream.layout(gguf)
    assert [u.name for u in units] == [f"blk.{i}" for i in range(LAYERS)] + ["head"]
    spans = sorted([s for u in units for s in u.spans] + [embedding])
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))  # no byte in two units
    # Every tensor's bytes, up to the 32-byte alignment between tensors merged into one span.
    assert 0 <= sum(e - s for s, e in spans) - total_bytes(gguf) < 32 * 20 * LAYERS

    everything = stream.plan(gguf, 0)
    assert everything.streamed == {u.name for u in units} and everything.resident_bytes == 0
    assert not stream.plan(gguf, total_bytes(gguf)).streamed
    ram = half(gguf)
    part = stream.plan(gguf, ram)
    assert part.resident_bytes > 0 and part.streamed and part.ram_bytes <= ram
    resident = [u.name for u in units if u.name not in part.streamed]
    layers = [u.name for u in units if u.layer is not None]
    # The head first, then layers spread over the pass: compute on them is when the reader reads ahead.
    assert len(resident) > 2 and resident[-1] == "head", resident
    assert resident[:-1] == stream.spread(layers, len(resident) - 1), resident
    assert stream.spread(layers, 3) == ["blk.1", "blk.4", "blk.6"] and stream.spread(layers, 8) == layers
    assert stream.spread(layers, 1) == ["blk.4"]


def test_a_size_below_the_minimum_is_a_one_line_error_naming_it(gguf: Path) -> None:
    minimum = stream.plan(gguf, 0).window_bytes
    with pytest.raises(LlamaCppError) as error:
        stream.plan(gguf, minimum - 1)
    message = str(error.value)
    assert "\n" not in message and f"at least {minimum / MiB:.1f} MiB" in message, message
    stream.plan(gguf, minimum)  # the minimum itself runs


# -- exactness --------------------------------------------------------------------------------------------


def logits_of(model: LlamaCppModel) -> torch.Tensor:
    """Logits of a prompt, a 16-token block and eight one-token passes: every shape a generation has."""
    runner = model.make_runner(64)
    rows = [runner.extend(torch.tensor(PROMPT), logits_to_keep=len(PROMPT))]
    rows.append(runner.extend(torch.arange(20, 36), logits_to_keep=16))
    rows += [runner.extend(torch.tensor([t])) for t in range(40, 48)]
    return torch.cat(rows)


def test_streamed_logits_equal_resident_logits_bit_for_bit(gguf: Path, reads: str) -> None:
    resident = logits_of(LlamaCppModel(gguf, threads=2))
    for ram in (0, half(gguf)):
        streamed = streamed_model(gguf, reads, threads=2, ram=ram)
        before = read_bytes()
        assert torch.equal(logits_of(streamed), resident), ram
        # The streamed units came from storage in each of the ten passes (where the kernel counts reads).
        passes = streamed.stream.passes
        assert passes == 10, passes
        if before:
            streamed_bytes = streamed.stream.plan.streamed_bytes
            assert read_bytes() - before >= 0.8 * passes * streamed_bytes, (ram, read_bytes() - before)
        del streamed  # one model of a file at a time: another's mapping would hold its pages in RAM


def test_a_split_gguf_streams_as_one_file_does(gguf: Path, split_gguf: Path, reads: str) -> None:
    """Every tensor of the split GGUF in the plan, the same logits bit for bit, each pass reading its
    streamed bytes, and the streamed pages not piling up in any of the files."""
    first = split_gguf
    files = shards(first)
    assert [f.name for f in files] == [f"split-0000{k}-of-00004.gguf" for k in (1, 2, 3, 4)]
    units, _ = stream.layout(first)
    one_file = {u.name: u.nbytes for u in stream.layout(gguf)[0]}
    assert {u.name: u.nbytes for u in units} == one_file
    assert {split(s)[0] for u in units for s, _ in u.spans} == {1, 2, 3}

    resident = logits_of(LlamaCppModel(gguf, threads=2))
    for ram in (0, half(gguf)):
        model = streamed_model(first, reads, threads=2, ram=ram)
        assert torch.equal(logits_of(model), resident), ram
        if read_bytes():
            assert read_per_pass(model) == pytest.approx(model.stream.plan.streamed_bytes, rel=0.1), ram
        kept, streamed = model.stream.residency()
        slack = 2 * PAGE * len(units) + 256 * 1024
        assert (
            kept >= model.stream.plan.resident_bytes - slack
            and streamed <= model.stream.plan.window_bytes + slack
        )
        del model


def test_a_split_gguf_given_by_another_file_or_missing_one_is_a_one_line_error(gguf: Path) -> None:
    first = write_streamable(gguf.parent / "parts.gguf", split_max_tensors=40)
    second = first.with_name("parts-00002-of-00003.gguf")
    with pytest.raises(GGUFFileError) as error:
        LlamaCppModel(second, threads=1)  # streamed or not
    assert str(error.value) == (
        f"{second} is part of a split GGUF of 3 files: give its first, NAME-00001-of-00003.gguf"
    )
    second.rename(second.with_suffix(".moved"))
    with pytest.raises(GGUFFileError) as error:
        LlamaCppModel(first, threads=1)
    assert (
        str(error.value)
        == "parts-00002-of-00003.gguf, part 2 of the split GGUF parts-00001-of-00003.gguf, is missing"
    )


def test_every_method_reproduces_greedy_decoding_streamed(gguf: Path, reads: str) -> None:
    resident = LlamaCppModel(gguf, threads=1)
    reference = specexec.generate(resident, None, PROMPT, method="ar", max_new_tokens=24).tokens
    del resident
    target = streamed_model(gguf, reads, threads=1, ram=0)
    draft = LlamaCppModel(gguf.with_name("perturbed.gguf"), threads=1)
    assert specexec.generate(target, None, PROMPT, method="ar", max_new_tokens=24).tokens == reference
    for args in METHODS:
        cost = {"cost_model": FLAT} if args["budget"] == "auto" else {}
        out = specexec.generate(target, draft, PROMPT, max_new_tokens=24, **args, **cost)
        assert out.tokens == reference, args
        assert sum(out.stats.accepted) > 0, args  # the draft was used
        assert out.stats.cache_bytes > 0, args  # what the stats line reports apart from --ram


# A target pass that costs more from 8 tokens on: the auto budget leaves most leaves to draft ahead.
SMALL_TREES = CostModel({1: 1.0, 8: 1.05, 32: 2.0, 1024: 40.0}, {1: 0.05, 128: 0.1})


def test_drafting_ahead_beside_a_streamed_target_stays_exact(gguf: Path) -> None:
    """The draft grows the next tree while the target reads its weights (`draft_ahead`): the output is
    still the target's greedy output, and trees are carried from step to step."""
    target = LlamaCppModel(gguf, threads=1, ram=0)
    draft = LlamaCppModel(gguf.with_name("perturbed.gguf"), threads=1)
    reference = specexec.generate(target, None, PROMPT, method="ar", max_new_tokens=32).tokens
    layer_done = target.stream.layer_done

    def slow_disk(layer: int) -> None:  # a pass long enough for the draft to grow well ahead, on any host
        time.sleep(0.005)
        layer_done(layer)

    target.stream.layer_done = slow_disk
    for budget in (8, "auto"):
        cost = {"cost_model": SMALL_TREES} if budget == "auto" else {}
        out = specexec.generate(
            target,
            draft,
            PROMPT,
            method="specexec",
            budget=budget,
            max_new_tokens=32,
            draft_ahead=True,
            **cost,
        )
        assert out.tokens == reference, budget
        assert out.stats.ahead_calls > 0, budget
        # A fixed budget's tree is full, its leaves all expanded: what the draft grows on is carried only
        # below nodes an auto budget leaves for later.
        assert out.stats.carried > 0 or budget != "auto", out.stats


# -- what is read, what stays -----------------------------------------------------------------------------


def read_per_pass(model: LlamaCppModel, passes: int = 10) -> float:
    runner = model.make_runner(64)
    runner.extend(torch.tensor(PROMPT))
    if model.stream is not None:
        model.stream.settle()
    before = read_bytes()
    for t in range(passes):
        runner.extend(torch.tensor([t + 20]))
    if model.stream is not None:
        model.stream.settle()
    return (read_bytes() - before) / passes


def test_each_pass_reads_the_streamed_bytes_and_no_more(gguf: Path, reads: str) -> None:
    if read_bytes() == 0:
        pytest.skip("this kernel does not count the bytes a process reads (/proc/self/io)")
    for ram in (0, half(gguf)):
        model = streamed_model(gguf, reads, threads=2, ram=ram)
        streamed = model.stream.plan.streamed_bytes
        assert read_per_pass(model) == pytest.approx(streamed, rel=0.1), ram
        del model
    everything = LlamaCppModel(gguf, threads=2, ram=2 * total_bytes(gguf))
    assert everything.stream is None and everything.memory() is None
    assert read_per_pass(everything) < 0.01 * total_bytes(gguf)


@pytest.mark.parametrize("lazily", [True, False])
def test_loading_a_streamed_target_reads_only_what_stays_resident(
    gguf: Path, lazily: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """llama.cpp maps a GGUF with MAP_POPULATE and advises WILLNEED (the whole file read at load); a
    streamed target loads without both (`lazy_load`): the load reads the header and the resident units,
    which are in RAM before the first pass. The negative control loads the way llama.cpp would."""
    from specexec.backends.llamacpp import lazy_load

    if not Path("/proc/self/io").exists():
        pytest.skip("this kernel does not count the bytes a process reads (/proc/self/io)")
    monkeypatch.setattr(stream.Streamer, "_read_speed", lambda self: 1e9)  # its probe reads streamed units
    if not lazily:
        monkeypatch.setattr(lazy_load, "_slots", lambda library: [])
    stream.evict(gguf)
    before = read_bytes()
    model = LlamaCppModel(gguf, threads=1, ram=half(gguf))
    read = read_bytes() - before
    plan = model.stream.plan
    kept, _ = model.stream.residency()
    assert kept >= plan.resident_bytes - 2 * PAGE * len(plan.units)
    if lazily:
        assert read < plan.resident_bytes + 0.1 * plan.streamed_bytes, (read, plan.resident_bytes)
    else:
        assert read > total_bytes(gguf) - 0.1 * plan.streamed_bytes, (read, total_bytes(gguf))


def test_the_resident_part_stays_and_streamed_pages_do_not_pile_up(gguf: Path, reads: str) -> None:
    model = streamed_model(gguf, reads, threads=2, ram=half(gguf))
    streamer, plan = model.stream, model.stream.plan
    # Pages shared by neighbouring units, and the kernel reading around a page fault (128 KiB by default).
    slack = 2 * PAGE * len(plan.units) + 256 * 1024
    peak = [0]
    layer_done = streamer.layer_done

    def watched(layer: int) -> None:  # the streamed pages in RAM at each layer's end, before its drop
        peak[0] = max(peak[0], streamer.residency()[1])
        layer_done(layer)

    streamer.layer_done = watched
    runner = model.make_runner(64)
    runner.extend(torch.tensor(PROMPT))
    for t in range(20):
        runner.extend(torch.arange(t, t + (16 if t % 4 == 0 else 1)))
        streamer.settle()
        kept, streamed = streamer.residency()
        assert kept >= plan.resident_bytes - slack, t
        assert streamed <= plan.window_bytes + slack, t
    assert 0 < peak[0] <= plan.window_bytes + slack
    memory = model.memory()
    assert memory.resident == plan.resident_bytes and memory.in_ram <= plan.ram_bytes + slack
    assert memory.disk_bytes_per_second > 0


def test_between_passes_the_reader_fills_the_window_with_the_next_passs_first_units(
    tmp_path: Path, reads: str
) -> None:
    # An output head as large as four layers sets the window (head + 2 layers): after a pass, while the
    # draft works, the reader has room for the next pass's first six layers, not just two.
    path = synced(write_random_gguf(tmp_path / "big-head.gguf", "qwen2", "f32", vocab=16384, hidden=256,
                                    ffn=1024, layers=LAYERS))  # fmt: skip
    model = streamed_model(path, reads, threads=2, ram=0)
    streamer = model.stream
    layers = [u for u in streamer.streamed if u.layer is not None]
    head = next(u for u in streamer.streamed if u.layer is None)
    assert head.nbytes > 3.5 * layers[0].nbytes
    fitting = 0
    while sum(u.nbytes for u in layers[: fitting + 1]) <= streamer.plan.window_bytes:
        fitting += 1
    assert fitting >= 5
    runner = model.make_runner(64)
    runner.extend(torch.tensor(PROMPT))
    slack = 2 * PAGE * len(layers)
    for t in range(3):
        runner.extend(torch.tensor([t + 20]))
        streamer.settle()
        held = {u.name: sum(streamer.resident(*s) for s in u.spans) for u in streamer.streamed}
        ahead = sum(held[u.name] for u in layers[:fitting])
        assert ahead >= sum(u.nbytes for u in layers[:fitting]) - slack, (t, held)
        assert sum(held.values()) <= streamer.plan.window_bytes + slack, (t, held)


class OneUnitReads:
    """Reads (`reader.Reads`) into room for one unit, as a full ring: the next unit waits until compute
    lets go of the last. A read takes 0.1 s; letting go takes 0.05 s, time for the reader to look."""

    kind = "one unit"
    failed = None

    def __init__(self, cond: threading.Condition) -> None:
        self._cond = cond
        self.holding: int | None = None
        self.read_in: list[int] = []

    def blocked(self, g: int) -> bool:
        return self.holding is not None

    def claim(self, g: int, last: int) -> None:
        self.holding = g

    def read(self, g: int, claim: None) -> None:
        time.sleep(0.1)

    def record(self, g: int, outcome: None, late: bool) -> None:
        self.read_in.append(g)

    def ready(self, g: int) -> bool:
        return g in self.read_in

    def let_go(self, g: int) -> bool:
        time.sleep(0.05)
        with self._cond:
            self.holding = None
            self._cond.notify_all()
        return True

    def held(self) -> list[int]:
        return []

    def restart(self, done: int) -> None: ...

    def wait_queued(self) -> None: ...

    def empty(self) -> None: ...

    def in_ram(self, in_page_cache) -> int:
        return 0

    def close(self) -> None: ...


def test_settling_waits_for_reads_that_room_given_back_by_compute_allows(monkeypatch) -> None:
    """`settle` returns once the reader has read what it may: after compute lets go of a unit, that
    includes the unit its room lets in, though the reader last looked while the room was still taken."""
    made: list[OneUnitReads] = []
    monkeypatch.setattr(reader, "open_reads", lambda *args: made.append(OneUnitReads(args[-1])) or made[-1])
    units = [stream.Unit(f"blk.{i}", ((i * PAGE, (i + 1) * PAGE),), i) for i in range(3)]
    files = types.SimpleNamespace(drop=lambda start, end: None)
    ahead = reader.Reader(files, units)
    try:
        ahead.resume()
        ahead.settle()
        assert made[0].read_in == [0]
        ahead.advance(1)  # compute is done with unit 0: its room takes unit 1
        ahead.settle()
        assert made[0].read_in == [0, 1]
    finally:
        ahead.close()


@pytest.mark.parametrize("files", ["one file", "split"])
def test_plain_llamacpp_short_of_memory_reads_the_whole_file_every_pass(
    gguf: Path, split_gguf: Path, files: str
) -> None:
    """The bench's plain `llamacpp` peer with --ram evicts the whole file (every file of a split GGUF)
    before each pass, the pages a streamed model of the same file keeps resident included (else they
    stay cached for the peer too); that model's resident part is read back after the peer's run."""
    if read_bytes() == 0:
        pytest.skip("this kernel does not count the bytes a process reads (/proc/self/io)")
    from specexec.bench.llamacpp import LlamaCpp

    gguf = split_gguf if files == "split" else gguf
    model = LlamaCppModel(gguf, threads=2, ram=half(gguf))
    streamer, plan = model.stream, model.stream.plan
    assert plan.resident_bytes > 0
    peer = LlamaCpp(gguf, context=64, threads=2, ram=half(gguf))
    before = read_bytes()
    record = peer.run(PROMPT, 6, seed=0, eos=[], temperature=0.0, top_p=1.0, top_k=0)
    passes = 1 + record["new_tokens"]  # the prompt's and one per new token
    read = read_bytes() - before - plan.resident_bytes  # less the resident part read back after the run
    assert read / passes == pytest.approx(plan.resident_bytes + plan.streamed_bytes, rel=0.1)
    assert record["hf_settings"]["evicted_before_every_pass"]
    slack = 2 * PAGE * len(plan.units)
    assert streamer.residency()[0] >= plan.resident_bytes - slack


# -- bad input, and the model file ------------------------------------------------------------------------


def test_a_gguf_changed_on_disk_is_an_error_and_streaming_never_writes_it(tmp_path: Path) -> None:
    if not on_storage(tmp_path):
        pytest.skip("the temporary folder is in memory (tmpfs)")
    path = write_streamable(tmp_path / "m.gguf")
    digest, mtime = hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns
    model = LlamaCppModel(path, threads=1, ram=0)
    specexec.generate(model, model, PROMPT, method="specexec", budget=8, max_new_tokens=8)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest and path.stat().st_mtime_ns == mtime
    runner = model.make_runner(64)
    runner.extend(torch.tensor(PROMPT))
    with open(path, "r+b") as f:  # another program rewrites a weight in place
        f.seek(-4096, os.SEEK_END)
        f.write(bytes(16))
    with pytest.raises(LlamaCppError, match="changed on disk during the run"):
        runner.extend(torch.tensor([5]))


def test_a_unit_being_mapped_in_counts_once_in_ram(gguf: Path, monkeypatch) -> None:
    """Right after a unit's ring memory is mapped over its pages, and before the reader records it as
    mapped in, its pages are in both places: counting then would add it twice (it did, 423 MiB against
    a 240 MiB window for the 1.5B target). A count asked for meanwhile waits until the mapping is
    recorded."""
    if not direct_reads(gguf):
        pytest.skip("this file system refuses O_DIRECT reads")
    model = LlamaCppModel(gguf, threads=2, ram=0)
    streamer = model.stream
    counts: list[tuple[int, int]] = []
    waited: list[bool] = []
    map_in = Ring.map_in

    def mapping_in(ring, base, pieces) -> None:
        map_in(ring, base, pieces)
        if not waited:  # once: a count from another thread while this unit is half recorded
            counter = threading.Thread(target=lambda: counts.append(streamer.residency()))
            counter.start()
            counter.join(0.2)
            waited.append(counter.is_alive())  # it waits for the mapping to be recorded

    monkeypatch.setattr(Ring, "map_in", mapping_in)
    model.make_runner(64).extend(torch.tensor(PROMPT))
    streamer.settle()
    slack = 2 * PAGE * len(streamer.plan.units)
    assert waited == [True]
    assert counts and counts[0][1] <= streamer.plan.window_bytes + slack


def test_a_failed_read_stops_the_run_with_a_one_line_error(gguf: Path, monkeypatch) -> None:
    """A read of the ring that fails (a disk error) never hands the kernels other bytes: the pass in
    flight computes from the file, and the next one stops with a one-line error."""
    if not direct_reads(gguf):
        pytest.skip("this file system refuses O_DIRECT reads")
    tokens = [torch.tensor(PROMPT)] + [torch.tensor([t]) for t in range(20, 25)]
    resident = LlamaCppModel(gguf, threads=2).make_runner(64)
    expected = [resident.extend(t) for t in tokens]
    del resident
    runner = LlamaCppModel(gguf, threads=2, ram=0).make_runner(64)
    assert torch.equal(runner.extend(tokens[0]), expected[0])

    def broken(*args) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(Ring, "read", broken)
    with pytest.raises(LlamaCppError) as error:
        for i in range(1, len(tokens)):
            assert torch.equal(runner.extend(tokens[i]), expected[i]), i
    assert "\n" not in str(error.value) and os.strerror(errno.EIO) in str(error.value)


EXIT_MID_READ = """
import atexit, sys, threading, time


@atexit.register  # before the streamers' own hook, so it runs after it: a runner released late in the exit
def release_runner():
    global runner
    del runner
    print("released", flush=True)


import torch
from specexec.backends.llamacpp.model import LlamaCppModel
from specexec.backends.llamacpp.stream import reader

model = LlamaCppModel(sys.argv[1], threads=2, ram=0)
stalled = 2 * len(model.stream.streamed)  # the third pass's first unit: read ahead after the second pass
reading, read = threading.Event(), threading.Event()


def stalling(read_unit):
    def slow_read(self, g, claim):  # a slow disk: the read of unit `stalled` takes 2 s
        outcome = read_unit(self, g, claim)
        if g == stalled:
            reading.set()
            time.sleep(2)
            read.set()
        return outcome

    return slow_read


for reads in (reader.DirectReads, reader.PageCacheReads):
    reads.read = stalling(reads.read)


@atexit.register  # after the streamers' own hook, so it runs first
def program_ends():
    print("reading at exit" if reading.is_set() and not read.is_set() else "not reading at exit", flush=True)


runner = model.make_runner(64)
runner.extend(torch.tensor([3, 17, 42, 5, 9, 11, 60, 2]))
runner.extend(torch.tensor([7]))
assert reading.wait(30)
print("decoded", flush=True)
"""


def test_a_program_ending_while_the_reader_reads_exits(tmp_path: Path) -> None:
    """The reader is a daemon thread, frozen wherever it is when the interpreter finalizes; frozen inside
    a read, a runner released after that (at finalization) would wait for the read forever. Streamers
    are closed at exit, before that happens: the child ends while the reader is inside a 2 s read (the
    child says so), and its runner, released after the streamers' exit hook, lets go at once."""
    if not on_storage(tmp_path):
        pytest.skip("the temporary folder is in memory (tmpfs)")
    path = write_streamable(tmp_path / "m.gguf")
    done = subprocess.run(
        [sys.executable, "-c", EXIT_MID_READ, str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and done.stdout == "decoded\nreading at exit\nreleased\n", done.stderr


def test_a_generation_parked_in_the_prefix_cache_gives_its_read_ahead_window_back(
    gguf: Path, reads: str
) -> None:
    """`Generation.release` idles its runners (`Runner.idle`) before the prefix cache keeps them: the
    streamer then holds the resident part only, and the parked runner still serves the next prompt."""
    model = streamed_model(gguf, reads, threads=2, ram=half(gguf))
    streamer, plan = model.stream, model.stream.plan
    slack = 2 * PAGE * len(plan.units)  # pages shared with a resident neighbour
    runner = model.make_runner(64)  # the control: a runner between passes holds the window
    runner.extend(torch.tensor(PROMPT))
    streamer.settle()
    assert streamer.residency()[1] > slack
    runner.idle()
    assert streamer.residency()[1] <= slack
    del runner

    cache = PrefixCache(2**30)
    first = specexec.generate(model, None, PROMPT, method="ar", max_new_tokens=8, prefix_cache=cache)
    assert len(cache) == 1  # parked, not freed
    kept, streamed = streamer.residency()
    assert kept >= plan.resident_bytes - slack and streamed <= slack, (kept, streamed)
    again = specexec.generate(model, None, PROMPT, method="ar", max_new_tokens=8, prefix_cache=cache)
    assert again.tokens == first.tokens and again.stats.cached_tokens == len(PROMPT) - 1


@pytest.mark.parametrize("reads", ["cached"], indirect=True)
def test_reads_still_queued_when_a_runner_idles_are_dropped_once_they_land(
    gguf: Path, reads: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel reads what `posix_fadvise(WILLNEED)` queued after the call returns, and keeps a page
    still being read when told to drop it. Here queued reads land 0.2 s late (waiting for a mapping waits
    for them, as the kernel's does): idling must wait for them, or their pages stay after it."""
    queued: list[threading.Timer] = []

    def late(fd: int, start: int, end: int) -> None:
        advice = (fd, start, end - start, os.POSIX_FADV_WILLNEED)
        queued.append(threading.Timer(0.2, os.posix_fadvise, advice))
        queued[-1].start()

    def waited(base: int, start: int, end: int) -> None:
        for timer in list(queued):
            timer.join()
        map_read(base, start, end)

    map_read = reader.map_read
    monkeypatch.setattr(reader, "request_reads", late)
    monkeypatch.setattr(reader, "map_read", waited)
    model = streamed_model(gguf, reads, threads=2, ram=half(gguf))
    slack = 2 * PAGE * len(model.stream.plan.units)  # pages shared with a resident neighbour
    runner = model.make_runner(64)
    runner.extend(torch.tensor(PROMPT))
    runner.idle()
    for timer in list(queued):
        timer.join()
    time.sleep(0.2)  # the last queued read, now in the real kernel's hands
    assert len(queued) > 1 and model.stream.residency()[1] <= slack


def test_ram_errors_are_one_line(tokenized_gguf: Path, capsys) -> None:
    from specexec.cli import main

    target = ["--target", str(tokenized_gguf), "--draft", str(tokenized_gguf), "--threads", "1"]
    assert main(["generate", *target, "--ram", "1", "--method", "ar", "ab a"]) == 1
    with pytest.raises(SystemExit) as usage:
        main(["generate", *target, "--ram", "lots", "ab a"])
    assert usage.value.code == 2
    assert main(["generate", *target, "--ram", "0", "--backend", "torch", "ab a"]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    minimum = stream.plan(tokenized_gguf, 0).window_bytes
    assert lines[0] == (
        f"specexec: error: --ram 1 B is below what tiny.gguf needs to run streamed: at least "
        f"{format_bytes(minimum)} (its read-ahead window), or 0 for the least"
    )
    assert lines[1].endswith("cannot read 'lots' as a memory size; write it like 20GiB, 20GB or 512MiB")
    assert (
        lines[2] == "specexec: error: --ram is for the llama.cpp backend (a GGUF target streamed from disk)"
    )
    assert len(lines) == 3


def test_the_stats_line_says_what_streams(tokenized_gguf: Path, capsys) -> None:
    from specexec.cli import main

    draft = str(shutil.copy(tokenized_gguf, tokenized_gguf.with_name("draft.gguf")))  # mapped apart
    synced(tokenized_gguf)
    args = ["generate", "--target", str(tokenized_gguf), "--draft", draft, "--threads", "1"]
    assert (
        main([*args, "--ram", "0", "--method", "specexec", "--budget", "4", "--max-new-tokens", "4", "ab"])
        == 0
    )
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "weights 0 MiB resident" in line and "MiB streamed per pass" in line and "GB/s" in line, line
    assert re.search(r"plus \d+ MiB of KV caches and buffers", line), line  # apart from --ram


@pytest.mark.parametrize("room", ["plenty", "none", "plenty without --ram", "none without --ram"])
def test_ram_auto_sizes_the_target_from_the_memory_available(
    tokenized_gguf: Path,
    room: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys,
) -> None:
    """`--ram auto` gives the target what the memory available leaves after the draft and the reserve:
    all of it where it fits, or nothing (--ram 0) where that is below the least it streams in; without
    --ram, a target that does not fit gets a line that says so."""
    from specexec import host_memory
    from specexec.cli import main

    draft = str(shutil.copy(tokenized_gguf, tokenized_gguf.with_name("draft.gguf")))  # mapped apart
    synced(tokenized_gguf)
    target_bytes = tokenized_gguf.stat().st_size
    left = 2 * target_bytes if room.startswith("plenty") else 0
    available = Path(draft).stat().st_size + host_memory.RUNTIME_RESERVE + left
    monkeypatch.setattr(host_memory, "available_memory", lambda: available)
    ram = [] if room.endswith("without --ram") else ["--ram", "auto"]
    args = ["generate", "--target", str(tokenized_gguf), "--draft", draft, "--threads", "1", *ram]
    assert main([*args, "--method", "specexec", "--budget", "4", "--max-new-tokens", "4", "ab"]) == 0
    lines = capsys.readouterr().err.strip().splitlines()
    stats = lines[-1]
    if room == "plenty":
        assert lines[0] == (
            f"[--ram auto: the target's {format_bytes(target_bytes)} fit in the {format_bytes(available)} "
            "available: nothing streams]"
        )
        assert "streamed" not in stats, stats
    elif room == "none":
        assert lines[0] == (
            f"[--ram auto: {format_bytes(available)} available is too little to keep any of the target "
            "resident: --ram 0]"
        )
        assert "weights 0 MiB resident" in stats, stats
    elif room == "plenty without --ram":
        assert not any("memory" in line or "--ram" in line for line in lines), lines
    else:
        assert lines[0].startswith(f"[the target's {format_bytes(target_bytes)} of weights do not fit in")
        assert lines[0].endswith("--ram auto keeps what fits resident and streams the rest]")
        assert "streamed" not in stats, stats  # said, not done: --ram is the user's choice


def test_ram_auto_keeps_resident_what_the_memory_left_holds(
    gguf: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """Between the two: the memory left after the reserve is the SIZE, and the plan keeps layers of it."""
    from specexec import host_memory
    from specexec.backends.options import LoadOptions
    from specexec.loading import PairSpec, resolve_ram

    left = half(gguf)
    monkeypatch.setattr(host_memory, "available_memory", lambda: host_memory.RUNTIME_RESERVE + left)
    spec = resolve_ram(PairSpec(str(gguf), None, LoadOptions(ram="auto"), backend="llamacpp"))
    assert spec.load.ram == left and stream.plan(gguf, left).resident_bytes > 0
    assert capsys.readouterr().err == (
        f"[--ram auto: {format_bytes(left)} for the target's weights "
        f"({format_bytes(host_memory.RUNTIME_RESERVE + left)} available, less 1.0 GiB for caches and "
        "buffers)]\n"
    )


def test_bench_streams_every_llamacpp_method_and_records_what_it_read(tokenized_gguf: Path) -> None:
    import json

    from specexec.cli import main

    prompts = tokenized_gguf.parent / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "ab a"}) + "\n")
    out = tokenized_gguf.parent / "bench"
    draft = str(shutil.copy(tokenized_gguf, tokenized_gguf.with_name("draft.gguf")))  # mapped apart
    synced(tokenized_gguf)
    models = ["--target", str(tokenized_gguf), "--draft", draft, "--ram", "0"]
    run = ["--prompts", str(prompts), "--max-new-tokens", "6", "--warmup-tokens", "2", "--threads", "1"]
    methods = ["--methods", "ar,specexec,llamacpp,llamacpp-spec", "--budgets", "4"]
    assert main(["bench", *models, *run, *methods, "--llamacpp-spec-budgets", "3", "--no-progress",
                 "--out", str(out)]) == 0  # fmt: skip
    rows = json.loads((out / "results.json").read_text())
    assert [row["label"] for row in rows] == ["ar", "specexec@4", "llamacpp", "llamacpp-spec@3"]
    assert all(row["identical_to_ar"] for row in rows)
    memory = rows[0]["machine"]["weights_memory"]
    assert memory["resident"] == 0 and memory["streamed"] > 0 and memory["disk_bytes_per_second"] > 0
    assert all(row["read_mib_per_target_pass"] is not None for row in rows)
    assert rows[2]["hf_settings"]["evicted_before_every_pass"]
    assert "Target streamed from disk (--ram)" in (out / "results.md").read_text()
    # Beside a streamed target the draft runs a Q4_0 copy, and llama.cpp's speculation drafts with it too.
    assert rows[0]["machine"]["draft_quant"] == "q4_0"
    assert re.fullmatch(r"draft-0-q4_0-\w+/model\.gguf", rows[3]["hf_settings"]["draft_gguf"])
