"""The very slow target's calibration (`calibration.VERY_SLOW_FORWARD`: once per size of SPARSE_SIZES) on a
target that is not that slow, against the full one, back to back on the same pair: how long each takes
and the curves they find. A target streamed from disk at --ram 0 stands in for a large one.

    python benchmarks/sparse_calibration.py [--ram 0] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch

from specexec import calibration
from specexec.loading import PairSpec, load_pair
from specexec.sizes import parse_size

SIZES = (1, 2, 3, 4, 8, 16, 17, 32, 33, 48, 64, 65, 128, 256, 512, 1024)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ram", default="0")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    spec = PairSpec("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", backend="llamacpp", threads=args.threads,
                    ram=parse_size(args.ram, zero=True))  # fmt: skip
    pair = load_pair(spec)
    curves = {}
    # Between the draft's one-token pass (about 0.01 s) and the streamed target's (0.4-0.6 s).
    for name, threshold in (("sparse", 0.2), ("full", float("inf"))):
        calibration.VERY_SLOW_FORWARD = threshold
        start = time.perf_counter()
        cost = calibration.calibrate(pair.target, pair.draft, progress=False)
        curves[name] = cost
        print(f"{name}: {time.perf_counter() - start:.1f} s, overlap {cost.overlap:.3f} s")
    print("tokens | sparse t(n) | full t(n)")
    for n in SIZES:
        print(f"{n} | {curves['sparse'].target_seconds(n):.3f} | {curves['full'].target_seconds(n):.3f}")


if __name__ == "__main__":
    main()
