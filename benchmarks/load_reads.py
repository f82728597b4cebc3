"""What loading a streamed target reads from storage: its file evicted first, `load_model(..., ram=...)`
timed, and the bytes this process read meanwhile (/proc/self/io), per --ram setting. With --populate, the
way llama.cpp loads on its own (MAP_POPULATE and WILLNEED: the whole file), for comparison.

    python benchmarks/load_reads.py --rams 0,512MiB [--target qwen2.5-coder-1.5b] [--populate]
"""

from __future__ import annotations

import argparse
import time

from specexec.backends.llamacpp import lazy_load, stream
from specexec.models import gguf_file, load_model
from specexec.sizes import parse_size
from specexec.storage import read_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--rams", default="0,512MiB")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--populate", action="store_true", help="load as llama.cpp would (the whole file)")
    args = parser.parse_args()
    if args.populate:
        lazy_load._slots = lambda library: []
    gguf = gguf_file(args.target)
    for text in args.rams.split(","):
        ram = parse_size(text, zero=True)
        stream.evict(gguf)
        before, start = read_bytes(), time.perf_counter()
        model = load_model(args.target, backend="llamacpp", threads=args.threads, ram=ram)
        seconds, read = time.perf_counter() - start, read_bytes() - before
        plan = model.stream.plan
        print(
            f"--ram {text}: loaded in {seconds:.2f} s, read {read / 2**20:.0f} MiB "
            f"({plan.resident_bytes / 2**20:.0f} MiB resident; the disk probe reads up to 256 MiB)"
        )
        del model


if __name__ == "__main__":
    main()
