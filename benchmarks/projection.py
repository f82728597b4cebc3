"""A PROJECTION, not a measurement: specexec with --ram for bigger Q4 targets on machines of 16 and 32 GB
with 3 and 7 GB/s NVMe, built from what this machine measured.

    python benchmarks/projection.py --passes passes.json --bench DIR [--draft-params 0.5]

Inputs (measured): the in-RAM compute of one pass over k tokens of the 1.5B target, repacking off
(`stream_passes.py --json`), and from a `specexec bench --ram ...` run the tokens per target call and the
draft's seconds per call of each `specexec@BUDGET` configuration. Assumptions (stated in the output):
- a pass's compute scales with the target's parameters (same CPU and threads as measured);
- a pass costs max(streamed bytes / disk speed, compute) (reads overlap compute, as measured here);
- the same draft and the same acceptance as measured (a bigger target would warrant a bigger draft);
- the target may use the machine's RAM less RESERVE for the system, the draft and the caches.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

MEASURED_PARAMS = 1.54e9  # Qwen2.5-Coder-1.5B
TARGETS = {"8B": (8.0e9, 4.92e9), "32B": (32.8e9, 19.9e9), "70B": (70.6e9, 42.5e9)}  # params, Q4_K_M bytes
MACHINES = [(16e9, 3e9), (16e9, 7e9), (32e9, 3e9), (32e9, 7e9)]  # RAM, disk bytes/s
RESERVE = 4e9


def interpolate(curve: dict[int, float], k: int) -> float:
    sizes = sorted(curve)
    if k in curve:
        return curve[k]
    lower = max(n for n in sizes if n < k)
    upper = min(n for n in sizes if n > k)
    return curve[lower] + (curve[upper] - curve[lower]) * (k - lower) / (upper - lower)


def fixed_trees(bench: Path) -> dict[int, tuple[float, float]]:
    """A bench run's `specexec@BUDGET` rows at fixed budgets: budget -> (tokens per target call, draft
    seconds per target call)."""
    rows = json.loads((bench / "results.json").read_text())
    return {
        row["budget"]: (row["tokens_per_step"], row["draft_seconds"] / row["target_calls"])
        for row in rows
        if row["method"] == "specexec" and isinstance(row["budget"], int)
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passes", required=True)
    parser.add_argument("--bench", required=True)
    args = parser.parse_args()
    compute = {int(k): v for k, v in json.loads(Path(args.passes).read_text())["in_ram_unrepacked"].items()}
    trees = fixed_trees(Path(args.bench))
    print("PROJECTION (not measured): tok/s of plain decoding and of specexec, target streamed with --ram")
    print(f"inputs: {args.passes}, {args.bench}; budgets {sorted(trees)}")
    print("| target | RAM | disk | streamed per pass | plain tok/s | specexec tok/s (budget) | speedup |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, (params, size) in TARGETS.items():
        scale = params / MEASURED_PARAMS
        for ram, disk in MACHINES:
            streamed = max(0.0, size - (ram - RESERVE))

            def seconds(k: int, streamed=streamed, disk=disk, scale=scale) -> float:
                return max(streamed / disk, interpolate(compute, k) * scale)

            plain = 1 / seconds(1)
            best = max((tokens / (seconds(k) + draft), k) for k, (tokens, draft) in trees.items())
            speed, budget = best
            print(
                f"| {name} Q4_K_M ({size / 1e9:.1f} GB) | {ram / 1e9:.0f} GB | {disk / 1e9:.0f} GB/s "
                f"| {streamed / 1e9:.1f} GB | {plain:.2f} | {speed:.2f} (@{budget}) | {speed / plain:.1f}x |"
            )


if __name__ == "__main__":
    main()
