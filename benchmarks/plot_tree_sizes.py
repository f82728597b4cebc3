"""Histogram of the tree sizes `--budget auto` chose per step, from `specexec bench` records.

python benchmarks/plot_tree_sizes.py OUT.png DIR [DIR ...]     # DIR: a bench --out folder
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from matplotlib.figure import Figure


def main() -> None:
    out, folders = sys.argv[1], sys.argv[2:]
    fig = Figure(figsize=(6.4, 4.0), layout="constrained")
    ax = fig.add_subplot()
    for folder in folders:
        records = [json.loads(line) for line in Path(folder, "records.jsonl").read_text().splitlines()]
        sizes = [s for r in records if r["label"] == "specexec@auto" for s in r["tree_sizes"]]
        if sizes:
            ax.hist(
                sizes,
                bins=range(0, max(sizes) + 2),
                alpha=0.6,
                label=f"{Path(folder).name} ({len(sizes)} steps)",
            )
    ax.set_xlabel("draft tokens verified in the step (tree size chosen by --budget auto)")
    ax.set_ylabel("steps")
    ax.legend()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    main()
