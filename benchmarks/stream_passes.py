"""One target pass over k new tokens after a 200-token context, in RAM and streamed from disk (--ram).

    python benchmarks/stream_passes.py --threads 2 [--target qwen2.5-coder-1.5b] [--rams 0,512MiB]

Modes, one after the other in one process (seconds per pass, the fastest of --repeats):
- `in RAM`: llama.cpp's default load (repacked weights);
- `in RAM, repacking off`: the kernels a streamed run uses; then with llama.cpp's eval callback asking
  for each layer's output (a graph cut per layer, as streaming needs) and doing nothing;
- `--ram SIZE`: the target streamed by specexec (`specexec.backends.llamacpp.stream`), read past the
  page cache into a ring of its own (O_DIRECT), then again read through the page cache, as where the
  file system refuses O_DIRECT;
- `evicted`: plain llama.cpp short of memory at its best: repacking off, the whole mapping evicted
  before every pass (the eviction not timed), the kernel's own readahead only.
Each streamed mode also gives its MiB read from storage per pass, the time to read its streamed bytes
sequentially at the disk speed measured at load (the streaming-speed goal of issue 31), and the most
bytes of the weights in RAM at once during passes (mincore over the mapping every 2 ms, in passes of
their own, untimed: the memory goal).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import threading
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from specexec.backends.llamacpp import stream
from specexec.backends.llamacpp.library import llama_cpp_library
from specexec.backends.llamacpp.model import LlamaCppModel
from specexec.backends.llamacpp.stream import reader
from specexec.models import DEFAULT_TARGET, gguf_file
from specexec.sizes import parse_size
from specexec.storage import read_bytes

SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
CONTEXT = 200


class Listener:
    """Hears each layer's end through llama.cpp's eval callback, as a `Streamer` does, and does nothing."""

    def __init__(self) -> None:
        self.eval_callback = stream.LayerEvents(self).callback

    def layer_done(self, layer: int) -> None:
        pass

    def begin(self) -> None:
        pass

    def end(self) -> None:
        pass

    def release(self) -> None:
        pass

    def close(self) -> None:
        pass


@contextmanager
def page_cache_reads():
    """Streamers made meanwhile read through the page cache, as where O_DIRECT is refused."""
    ring = reader.Ring

    def refused(*args) -> None:
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))

    reader.Ring = refused
    try:
        yield
    finally:
        reader.Ring = ring


@contextmanager
def unrepacked():
    llama_cpp = llama_cpp_library()
    defaults = llama_cpp.llama_model_default_params

    def params():
        p = defaults()
        p.use_extra_bufts = False
        return p

    llama_cpp.llama_model_default_params = params
    try:
        yield
    finally:
        llama_cpp.llama_model_default_params = defaults


def passes(model: LlamaCppModel, repeats: int, before_pass=lambda: None) -> tuple[dict, dict]:
    """Seconds per pass and MiB read per pass, by size."""
    runner = model.make_runner(CONTEXT + max(SIZES) + 8)
    generator = torch.Generator().manual_seed(0)
    runner.extend(torch.randint(0, 1000, (CONTEXT,), generator=generator))
    seconds, mib = {}, {}
    for k in SIZES:
        best, reads = float("inf"), []
        for _ in range(repeats):
            runner.keep(torch.arange(CONTEXT))
            tokens = torch.randint(0, 1000, (k,), generator=generator)
            before_pass()
            time.sleep(0.2)  # stands for the draft's turn: the reader reads ahead meanwhile
            start, read = time.perf_counter(), read_bytes()
            runner.extend(tokens, logits_to_keep=1)
            best = min(best, time.perf_counter() - start)
            reads.append((read_bytes() - read) / 2**20)
        seconds[k], mib[k] = best, sorted(reads)[len(reads) // 2]
    return seconds, mib


def peak_in_ram(model: LlamaCppModel, passes_each: int = 3) -> int:
    """The most bytes of the weights in RAM at once (resident and streamed units, sampled every 2 ms)
    over passes of 1 and 32 tokens, the reader reading ahead between them as during a generation."""
    runner = model.make_runner(CONTEXT + 40)
    runner.extend(torch.randint(0, 1000, (CONTEXT,), generator=torch.Generator().manual_seed(0)))
    peak, running = 0, True

    def sample() -> None:
        nonlocal peak
        while running:
            peak = max(peak, sum(model.stream.residency()))
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    for k in (1, 32) * passes_each:
        runner.keep(torch.arange(CONTEXT))
        time.sleep(0.2)
        runner.extend(torch.randint(0, 1000, (k,)), logits_to_keep=1)
    running = False
    sampler.join()
    return peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rams", default="0,512MiB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--json", default=None, help="also write the seconds per pass here (for projection.py)"
    )
    args = parser.parse_args()
    gguf = gguf_file(args.target)
    rows, peaks = [], []
    rows.append(("in RAM (repacked)", *passes(LlamaCppModel(gguf, threads=args.threads), args.repeats), None))
    with unrepacked():
        resident = LlamaCppModel(gguf, threads=args.threads)
    rows.append(("in RAM, repacking off", *passes(resident, args.repeats), None))
    resident.stream = Listener()  # what llama.cpp's eval callback costs: a graph cut per layer
    rows.append(("in RAM, repacking off, eval callback", *passes(resident, args.repeats), None))
    del resident  # a model that maps the file keeps its pages in RAM
    for text, reads in ((t, r) for t in args.rams.split(",") for r in ("direct", "page cache")):
        with page_cache_reads() if reads == "page cache" else nullcontext():
            model = LlamaCppModel(gguf, threads=args.threads, ram=parse_size(text, zero=True))
        memory = model.memory()
        read_time = memory.streamed / memory.disk_bytes_per_second
        label = (
            f"--ram {text} ({reads}): {memory.resident / 2**20:.0f} MiB resident, "
            f"{memory.streamed / 2**20:.0f} MiB streamed, "
            f"disk {memory.disk_bytes_per_second / 1e9:.2f} GB/s, "
            f"read time {read_time:.3f} s"
        )
        rows.append((label, *passes(model, args.repeats), read_time))
        peaks.append((f"{text} ({reads})", peak_in_ram(model), memory))
        del model
    with unrepacked():
        plain = LlamaCppModel(gguf, threads=args.threads)
    evicted = passes(plain, args.repeats, lambda: stream.evict(gguf))
    rows.append(("evicted before every pass, repacking off", *evicted, None))
    print(f"target {gguf.name}, {args.threads} threads, one pass over k tokens after {CONTEXT} (s; MiB read)")
    print("| mode | " + " | ".join(f"t({k})" for k in SIZES) + " |")
    print("|---|" + "---:|" * len(SIZES))
    for label, seconds, mib in (row[:3] for row in rows):
        cells = " | ".join(f"{seconds[k]:.3f} ({mib[k]:.0f})" for k in SIZES)
        print(f"| {label} | {cells} |")
    in_ram = rows[1][1]
    if args.json:
        table = {label: {"seconds": seconds, "mib_read": mib} for label, seconds, mib, _ in rows}
        peak_mib = {text: peak / 2**20 for text, peak, _ in peaks}
        payload = {
            "target": gguf.name, "threads": args.threads, "modes": table, "in_ram_unrepacked": in_ram,
            "peak_mib_in_ram": peak_mib,
        }  # fmt: skip
        Path(args.json).write_text(json.dumps(payload, indent=1))
    for label, seconds, _, read_time in rows[3:-1]:
        print(
            f"{label.split(':')[0]}: t(1) / read time {seconds[1] / read_time:.2f} (goal <= 1.2); "
            f"t(32) / max(read time, in-RAM t(32)) {seconds[32] / max(read_time, in_ram[32]):.2f} "
            "(goal <= 1.15)"
        )

    for text, peak, memory in peaks:
        size = parse_size(text.split()[0], zero=True)
        print(
            f"--ram {text}: at most {peak / 2**20:.0f} MiB of weights in RAM during passes (plan: "
            f"{memory.resident / 2**20:.0f} resident + {memory.window / 2**20:.0f} window; goal <= SIZE + 5%"
            + (f" = {size * 1.05 / 2**20:.0f} MiB)" if size else ": --ram 0 holds the window only)")
        )


if __name__ == "__main__":
    main()
