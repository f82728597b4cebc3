"""Histograms of the sizes `--budget auto` chose per step (specexec trees, dsl chains), from `specexec
bench` records.

python benchmarks/plot_tree_sizes.py OUT.png DIR [DIR ...]     # DIR: a bench --out folder
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from matplotlib.figure import Figure

PANELS = (("specexec@auto", "tree size"), ("dsl@auto", "chain length"))


def main() -> None:
    out, folders = sys.argv[1], sys.argv[2:]
    fig = Figure(figsize=(6.4, 6.4), layout="constrained")
    axes = fig.subplots(len(PANELS), 1)
    for ax, (label, what) in zip(axes, PANELS, strict=True):
        for folder in folders:
            records = [json.loads(line) for line in Path(folder, "records.jsonl").read_text().splitlines()]
            sizes = [s for r in records if r["label"] == label for s in r["tree_sizes"]]
            if sizes:
                ax.hist(
                    sizes,
                    bins=range(0, max(sizes) + 2),
                    alpha=0.5,
                    label=f"{Path(folder).name} ({len(sizes)} steps)",
                )
        ax.set_xlabel(f"draft tokens verified in the step ({what} chosen by {label})")
        ax.set_ylabel("steps")
        ax.legend(fontsize="small")
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    main()
