"""A PROJECTION, not a measurement: plain decoding and specexec for 32B and 70B Q4 targets split over 2-4
machines on gigabit Ethernet and on Wi-Fi, built from what this machine measured.

    python benchmarks/cluster_projection.py --bench DIR --passes passes.json [--cores 8,16]

Inputs (measured): from a `specexec bench --rpc` run (benchmarks/rpc_cluster.py) of the 1.5B target,
the tokens per target call and the draft's seconds per call of each `specexec@BUDGET` configuration;
`--passes`, JSON {tokens: seconds}: the 1.5B target's passes in RAM on 2 threads (the table `specexec
calibrate --backend llamacpp --threads 2` prints). Assumptions (stated in the output):
- a pass's compute scales with the target's parameters and inversely with the cores (from 2 threads);
  the machines compute their blocks one after another, so a pass's compute does not shrink with more
  machines;
- a pass costs that compute plus one round trip per machine plus its bytes over the link: each block's
  activations there and back (hidden size x tokens x 4 bytes) and its graph (GRAPH_BYTES_PER_LAYER);
- the same draft and acceptance as measured with the 1.5B target (a bigger target warrants a bigger
  draft, which would accept more and cost more).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from projection import fixed_trees  # benchmarks/, beside this script

MEASURED_PARAMS = 1.54e9  # Qwen2.5-Coder-1.5B
MEASURED_THREADS = 2
# name: parameters, hidden size, layers, Q4_K_M bytes
TARGETS = {"32B": (32.8e9, 5120, 64, 19.9e9), "70B": (70.6e9, 8192, 80, 42.5e9)}
LINKS = {"1 GbE": (0.3e-3, 117e6), "Wi-Fi": (4e-3, 25e6)}  # round trip, bytes per second each way
GRAPH_BYTES_PER_LAYER = 15_000  # a pass's graph sent whole, measured at about 200 KiB for 14 layers


def interpolate(curve: dict[int, float], k: int) -> float:
    sizes = sorted(curve)
    if k <= sizes[0]:
        return curve[sizes[0]]
    if k >= sizes[-1]:
        return curve[sizes[-1]] * k / sizes[-1]
    lower = max(n for n in sizes if n <= k)
    upper = min(n for n in sizes if n >= k)
    if lower == upper:
        return curve[lower]
    return curve[lower] + (curve[upper] - curve[lower]) * (k - lower) / (upper - lower)


def pass_seconds(
    compute: dict[int, float], k: int, target: tuple, machines: int, cores: int, link: tuple
) -> float:
    params, hidden, layers, _ = target
    round_trip, rate = link
    work = interpolate(compute, k) * params / MEASURED_PARAMS * MEASURED_THREADS / cores
    sent = machines * 2 * hidden * k * 4 + layers * GRAPH_BYTES_PER_LAYER
    return work + machines * round_trip + sent / rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bench", required=True, help="a `specexec bench --rpc` output folder")
    parser.add_argument("--passes", required=True, help="JSON {tokens: seconds} of the 1.5B target in RAM")
    parser.add_argument("--cores", default="8,16")
    args = parser.parse_args()
    compute = {int(k): v for k, v in json.loads(Path(args.passes).read_text()).items()}
    trees = fixed_trees(Path(args.bench))
    print("PROJECTION (not measured): tok/s of plain decoding and specexec, the target split over machines")
    print(f"inputs: {args.passes}, {args.bench}; budgets {sorted(trees)}; links {LINKS}")
    print("| target | machines x cores | link | plain tok/s | specexec tok/s (budget) | speedup |")
    print("|---|---|---|---:|---:|---:|")
    for name, target in TARGETS.items():
        for machines in (2, 3, 4):
            if target[3] / machines > 24e9:
                continue  # more than a 32 GB machine holds beside its OS
            for cores in (int(c) for c in args.cores.split(",")):
                for link_name, link in LINKS.items():
                    plain = 1 / pass_seconds(compute, 1, target, machines, cores, link)
                    best, budget = max(
                        (accepted / (pass_seconds(compute, b + 1, target, machines, cores, link) + draft), b)
                        for b, (accepted, draft) in trees.items()
                    )
                    cells = [name, f"{machines} x {cores}", link_name, f"{plain:.2f}"]
                    cells.append(f"{best:.2f} ({budget})")
                    print(f"| {' | '.join(cells)} | {best / plain:.1f}x |")


if __name__ == "__main__":
    main()
