"""From raw per-prompt records to the per-configuration table, results.json, results.md and the plots.

Metric definitions (per configuration, summed over prompts and repeats, warm-up excluded):

- tokens_per_step: new tokens / target verification forwards, the bonus token included, prefill
  excluded (total over total); tokens_per_step_mean is the mean of the per-prompt ratios.
- tok_per_s: new tokens / decode seconds (decoding only, prefill excluded).
- tok_per_s_with_prefill: new tokens / wall seconds of the whole calls (request to last token).
- speedup_vs_ar: tok_per_s / tok_per_s of `ar` in the same run (speedup_vs_ar_with_prefill likewise):
  the unquantized ar when it ran, else the first ar row. speedup_vs_ar_paired: the median over passes
  (prompt, repeat) of the same ratio within the pass, which the machine's drift between passes moves less.
- draft/target/overhead seconds: inside the draft's forwards, inside the target's forwards, and the rest
  of the decode time; *_share are fractions of decode_seconds.
- tok_per_s_target_bound: new tokens / target seconds: the speed these trees would give were drafting
  and overhead free, so a ceiling for any faster drafter of the same trees (a streamed target's pass
  after drafting is shorter than after none, which only raises the ceiling).
- mean_tree_size / mean_tree_depth: draft tokens verified per target forward and the depth of that
  tree, averaged over all steps of all prompts (chains for sd and the HF methods: depth = size).
- identical_to_ar (greedy only, else null): every prompt's output equals ar's, token for token; ar of
  the same quantization level (llamacpp: the unquantized ar).
  identical_prompts_fraction: the fraction of prompts whose output equals ar's.
  matching_prefix_fraction: per prompt, the length of the common prefix of the two outputs divided by
  the longer output's length (1 only when identical), averaged over prompts. In float32 greedy all three
  must be true / 1.0; in bfloat16 near-ties can flip a token, after which the outputs diverge, which is why
  the prefix up to the first difference is the measure rather than a per-position match.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
from collections.abc import Sequence
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from specexec.bench.methods import BUDGET_METHODS

if TYPE_CHECKING:
    from specexec.backends.base import WeightsMemory

_SUMS = (
    "prompt_tokens",
    "new_tokens",
    "target_calls",
    "draft_calls",
    "prefill_seconds",
    "decode_seconds",
    "wall_seconds",
    "draft_seconds",
    "target_seconds",
)
_CONFIG_KEYS = (
    "label", "method", "budget", "expand", "width", "branches", "quant", "ngram", "draft_vocab",
    "draft_ahead",
)  # fmt: skip
_SETTING_KEYS = ("temperature", "top_p", "top_k", "max_new_tokens")


def summarize(records: Sequence[dict]) -> list[dict]:
    """One row per configuration (in order of first appearance), recomputable from records.jsonl alone."""
    groups: dict[str, list[dict]] = {}
    for record in records:
        groups.setdefault(record["label"], []).append(record)
    references: dict[str, dict[int, list[int]]] = {}  # per quantization level: ar's tokens per prompt
    for record in records:
        if record["method"] == "ar":
            references.setdefault(record.get("quant", "none"), {})[record["prompt_index"]] = record["tokens"]
    rows = [_row(group, references.get(group[0].get("quant", "none"), {})) for group in groups.values()]
    ars = [row for row in rows if row["method"] == "ar"]
    ar = next((row for row in ars if row["quant"] == "none"), ars[0] if ars else None)
    for row in rows:
        for key, base in (
            ("speedup_vs_ar", "tok_per_s"),
            ("speedup_vs_ar_faster_repeat", "tok_per_s_faster_repeat"),
            ("speedup_vs_ar_with_prefill", "tok_per_s_with_prefill"),
        ):
            row[key] = _ratio(row[base], ar[base]) if ar is not None else None
        row["speedup_vs_ar_paired"] = (
            _paired_speedup(groups[row["label"]], groups[ar["label"]]) if ar else None
        )
    return rows


def _paired_speedup(group: list[dict], reference: list[dict]) -> float | None:
    """The median over passes (prompt, repeat) of this configuration's decode tok/s over the reference's
    in the same pass. The configurations of a pass run back to back, seconds apart, so this machine's
    drift between passes, which moves ratios of totals by several percent, cancels out of each ratio."""
    ours, base = _pass_speeds(group), _pass_speeds(reference)
    ratios = [ours[key] / base[key] for key in ours.keys() & base.keys() if ours[key] and base[key]]
    return statistics.median(ratios) if ratios else None


def _pass_speeds(group: list[dict]) -> dict[tuple[int, int], float | None]:
    """Decode tok/s of each pass (prompt, repeat)."""
    return {
        (r["prompt_index"], r.get("repeat", 0)): _ratio(r["new_tokens"], r["decode_seconds"]) for r in group
    }


def _row(group: list[dict], reference: dict[int, list[int]]) -> dict:
    first = group[0]
    row: dict = {k: first.get(k) for k in _CONFIG_KEYS + _SETTING_KEYS}
    row["quant"] = row["quant"] or "none"
    row["draft_vocab"] = row["draft_vocab"] or 0  # records written before the field existed
    row["prompts"] = len({r["prompt_index"] for r in group})
    row["repeats"] = 1 + max(r.get("repeat", 0) for r in group)
    for key in _SUMS:
        row[key] = sum(r[key] for r in group)
    decode = row["decode_seconds"]
    row["overhead_seconds"] = max(0.0, decode - row["draft_seconds"] - row["target_seconds"])
    row["tokens_per_step"] = _ratio(row["new_tokens"], row["target_calls"])
    per_prompt = [_ratio(r["new_tokens"], r["target_calls"]) for r in group]
    row["tokens_per_step_mean"] = _mean([x for x in per_prompt if x is not None])
    row["tok_per_s"] = _ratio(row["new_tokens"], decode)
    # Per prompt, the repeat that decoded fastest (the same tokens each time): a pass that one of this
    # machine's stalls hit (a 64-token run taking 1.8x its repeat) weighs on this figure less.
    faster: dict[int, dict] = {}
    for r in group:
        index = r["prompt_index"]
        if index not in faster or r["decode_seconds"] < faster[index]["decode_seconds"]:
            faster[index] = r
    row["tok_per_s_faster_repeat"] = _ratio(
        sum(r["new_tokens"] for r in faster.values()), sum(r["decode_seconds"] for r in faster.values())
    )
    row["tok_per_s_with_prefill"] = _ratio(row["new_tokens"], row["wall_seconds"])
    row["tok_per_s_target_bound"] = _ratio(row["new_tokens"], row["target_seconds"])
    for part in ("draft", "target", "overhead"):
        row[f"{part}_share"] = _ratio(row[f"{part}_seconds"], decode)
    row["mean_tree_size"] = _mean([x for r in group for x in r["tree_sizes"] or []])
    row["mean_tree_depth"] = _mean([x for r in group for x in r["tree_depths"] or []])
    accepted = [x for r in group for x in r["accepted"] or []]
    row["mean_accepted"] = _mean(accepted) if all(r["accepted"] is not None for r in group) else None
    row["stopped_at_eos"] = sum(r["finish_reason"] == "stop" for r in group)
    # An auto budget's pace of the target against its calibration at each generation's end (records
    # from before it have none).
    paces = [r["target_pace"] for r in group if r.get("target_pace") is not None]
    row["target_pace"] = [min(paces), max(paces)] if paces else None
    # Storage read per target pass, the prefill's pass counted (records older than --ram have no count).
    read = [r.get("storage_read_bytes") for r in group]
    passes = row["target_calls"] + len(group)
    row["read_mib_per_target_pass"] = sum(read) / passes / 2**20 if None not in read else None
    # Bytes to and from RPC workers per target pass, the prefill's counted (only runs over RPC count them).
    for way in ("sent", "received"):
        counts = [r.get(f"network_{way}_bytes") for r in group]
        row[f"network_{way}_kib_per_target_pass"] = (
            sum(counts) / passes / 2**10 if None not in counts else None
        )
    row["prefill_timing"] = first["prefill_timing"]
    row["hf_settings"] = first.get("hf_settings")
    row.update(_identity(group, reference))
    return row


def _identity(group: list[dict], reference: dict[int, list[int]]) -> dict:
    comparable = group[0]["temperature"] == 0 and all(r["prompt_index"] in reference for r in group)
    if not comparable:
        return {"identical_to_ar": None, "identical_prompts_fraction": None, "matching_prefix_fraction": None}
    same: dict[int, bool] = {}  # per prompt: every repeat's output equals ar's
    prefixes: dict[int, float] = {}  # per prompt: the shortest common prefix over its repeats
    for r in group:
        index, ours = r["prompt_index"], r["tokens"]
        ref = reference[index]
        common = next(
            (i for i, (a, b) in enumerate(zip(ours, ref, strict=False)) if a != b), min(len(ours), len(ref))
        )
        prefix = common / max(len(ours), len(ref)) if max(len(ours), len(ref)) else 1.0
        same[index] = same.get(index, True) and ours == ref
        prefixes[index] = min(prefixes.get(index, 1.0), prefix)
    same, prefixes = list(same.values()), list(prefixes.values())
    return {
        "identical_to_ar": all(same),
        "identical_prompts_fraction": sum(same) / len(same),
        "matching_prefix_fraction": _mean(prefixes),
    }


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


SIMD_FLAGS = (
    "avx2",
    "avx512f",
    "avx512_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
    "asimd",
    "sve",
)


def cpu_instruction_sets() -> str:
    """The CPU's vector instruction sets that kernels choose between (from /proc/cpuinfo)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown"
    flags = set()
    for line in lines:
        if line.startswith(("flags", "Features")):  # x86 / ARM
            flags = set(line.split(":", 1)[1].split())
            break
    return " ".join(f for f in SIMD_FLAGS if f in flags) or "none of " + ", ".join(SIMD_FLAGS)


def _allowed(machine: dict) -> str:
    """', this run on CPUs ...' where the bench ran on fewer CPUs than the machine has."""
    allowed = machine.get("cpus_allowed")
    if not allowed or len(allowed) == machine.get("cpu_count"):
        return ""
    return f", this run on CPU{'s' if len(allowed) > 1 else ''} {','.join(map(str, allowed))}"


def machine_info(
    *,
    dtype: str,
    command: str,
    target: str | None = None,
    draft: str | None = None,
    prompt_set: str | None = None,
    seed: int | None = None,
    simulated_offload: str | None = None,
    draft_quant: str | None = None,
    draft_weights: str | None = None,
    backend: str | None = None,
    memory: WeightsMemory | None = None,
    llama_cpp: dict | None = None,
    rpc: dict | None = None,
) -> dict:
    """Where and how the numbers were measured (`simulated_offload` labels simulated target timings)."""
    import torch
    import transformers

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    try:
        version = metadata.version("specexec")
    except metadata.PackageNotFoundError:
        version = None
    return {
        "cpu_model": _cpu_model(),
        "cpu_instruction_sets": cpu_instruction_sets(),
        "cpu_count": os.cpu_count(),
        # The CPUs this run could use: fewer than cpu_count when pinned (rpc_cluster --pin).
        "cpus_allowed": sorted(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
        "gpu": gpu,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "specexec": version,
        "dtype": dtype,
        "backend": backend,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": command,
        "target": target,
        "draft": draft,
        "prompt_set": prompt_set,
        "simulated_offload": simulated_offload,
        "draft_quant": draft_quant,
        "draft_weights": draft_weights,
        "seed": seed,
        # --ram: the target's weights in RAM and streamed per pass, the disk's speed (measured at load)
        "weights_memory": dataclasses.asdict(memory) if memory is not None else None,
        "rpc": rpc,
        # llama.cpp's version and kernels (`specexec.backends.llamacpp.extra_buffers.kernels`), if it ran
        "llama_cpp": llama_cpp,
    }


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def describe_cpu() -> str:
    """The CPU's model and vector instruction sets, for the line that goes with every figure."""
    return f"{_cpu_model() or platform.machine()} ({cpu_instruction_sets()})"


def read_records(path: str | os.PathLike) -> list[dict]:
    """records.jsonl back into a list (feed it to `summarize` to recompute the table)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_outputs(
    out_dir: str | os.PathLike,
    records: Sequence[dict],
    rows: Sequence[dict],
    machine: dict,
    *,
    plots: bool = True,
) -> dict[str, Path]:
    """Write results.json (`rows`, each with the `machine`), results.md, records.jsonl and (with `plots`)
    the two PNGs; return their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "results.json": out / "results.json",
        "results.md": out / "results.md",
        "records.jsonl": out / "records.jsonl",
    }
    described = [{**row, "machine": machine} for row in rows]
    paths["results.json"].write_text(json.dumps(described, indent=2) + "\n", encoding="utf-8")
    with paths["records.jsonl"].open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    if plots:
        paths.update(write_plots(out, rows))
    paths["results.md"].write_text(markdown(rows, machine, plots=plots), encoding="utf-8")
    return paths


def _draft_weights(machine: dict) -> str:
    weights = machine.get("draft_weights")
    return f" (draft {weights})" if weights else ""


# The report's definitions of its columns and protocol, below every table.
DEFINITIONS = (
    "- tok/call: new tokens / target verification forwards (bonus token included, prefill excluded), "
    "total over total; the next column is the mean of the per-prompt ratios.",
    "- decode tok/s: new tokens / decode seconds summed over prompts; tok/s incl. prefill: new tokens / "
    "wall seconds of the whole calls. Speedup: decode tok/s over ar's, same run. Paired: the median, "
    "over passes (prompt, repeat), of that ratio within the pass, where the two ran seconds apart: "
    "the machine's drift between passes moves it less. Faster repeat: the same as speedup, counting "
    "for each prompt only its fastest repeat (with --repeats R > 1), which a one-off stall of the "
    "machine moves less.",
    "- target-bound tok/s: new tokens / seconds inside the target's forwards: the speed were drafting "
    "and overhead free, a ceiling for any faster drafter of the same trees.",
    "- Every configuration ran on the same prompts with the same seed per prompt, interleaved (the order "
    "rotated per prompt), after a warm-up generation per configuration that is not counted. With "
    "`--repeats R` every prompt ran R times per configuration (same seed, same tokens; the order "
    "reversed on every other pass) and each row sums all R. A budget `auto` keeps what it learnt "
    "(acceptance rates, the speculation gate) from one generation to the next, warm-up included, as in "
    "the server.",
    "- hf-assisted / hf-lookup are Hugging Face `generate` (assistant_model at its default dynamic "
    "settings; prompt_lookup_num_tokens=10), timed by the same clock; target/draft forwards are counted "
    "and timed by forward hooks. generate folds the prompt into its first target forward, so the "
    "target's prefill is estimated by a separate forward over the prompt just before the call (capped "
    "at that first forward's time) and subtracted; the draft's prefill is the assistant's first forward "
    "(prompt only). Tree size = candidates per verification.",
    "- identical to ar (greedy only): yes when every prompt's output equals ar's; otherwise the number "
    "of identical prompts and the mean common-prefix fraction (common prefix / longer output).",
    "- A label ending in /dvN: the draft scores only its first N token ids and its special tokens "
    "(`--draft-vocab N`).",
)


def markdown(rows: Sequence[dict], machine: dict, *, plots: bool = True) -> str:
    first = rows[0] if rows else {}
    m = machine.get
    sampling = "greedy"
    if first.get("temperature") != 0:
        sampling = (
            f"temperature {first.get('temperature')}, top_p {first.get('top_p')}, top_k {first.get('top_k')}"
        )
    lines = [
        "# specexec bench",
        "",
        f"Target `{m('target')}`, draft `{m('draft')}`, prompts `{m('prompt_set')}` "
        f"({_plural(first.get('prompts', 0), 'prompt')}), max_new_tokens {first.get('max_new_tokens')}, "
        f"{sampling}, seed {m('seed')}, weights {m('dtype')}{_draft_weights(machine)}, "
        f"{_plural(first.get('repeats', 1), 'repeat')}.",
        "",
        "| config | tok/call | tok/call (mean per prompt) | decode tok/s | tok/s incl. prefill "
        "| speedup vs ar | paired vs ar | faster repeat: tok/s (vs ar) | draft / target / overhead "
        "| target-bound tok/s | tree size | tree depth | target calls | new tokens | identical to ar |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    lines += [_table_row(row) for row in rows]
    gpu = f", GPU {machine['gpu']}" if machine.get("gpu") else ""
    lines += _notes(rows, machine)
    lines += [
        "",
        f"Machine: {m('cpu_model')} ({m('cpu_count')} CPUs{_allowed(machine)}, {m('cpu_instruction_sets')}, "
        f"{m('torch_threads')} threads){gpu}; backend {m('backend')}{_kernels(machine)}; "
        f"{m('platform')}; Python {m('python')}, torch {m('torch')}, transformers {m('transformers')}, "
        f"specexec {m('specexec')}; {m('date')}.",
        "",
        "Command:",
        "",
        "```",
        str(machine.get("command")),
        "```",
        "",
        "Definitions:",
        "",
        *DEFINITIONS,
    ]
    if plots:
        lines += ["", "![tokens per step](tokens_per_step.png)", "", "![tok/s](tok_per_s.png)"]
    return "\n".join(lines) + "\n"


def _table_row(row: dict) -> str:
    """One configuration's line of the results table."""
    shares = " / ".join(_pct(row[f"{p}_share"]) for p in ("draft", "target", "overhead"))
    return (
        f"| {row['label']} | {_num(row['tokens_per_step'])} | {_num(row['tokens_per_step_mean'])} "
        f"| {_num(row['tok_per_s'])} | {_num(row['tok_per_s_with_prefill'])} "
        f"| {_num(row['speedup_vs_ar'], 'x')} | {_num(row['speedup_vs_ar_paired'], 'x')} "
        f"| {_num(row['tok_per_s_faster_repeat'])} "
        f"({_num(row['speedup_vs_ar_faster_repeat'], 'x')}) | {shares} "
        f"| {_num(row['tok_per_s_target_bound'])} "
        f"| {_num(row['mean_tree_size'], digits=1)} | {_num(row['mean_tree_depth'], digits=1)} "
        f"| {row['target_calls']} | {row['new_tokens']} "
        f"| {_identical(row)} |"
    )


def _notes(rows: Sequence[dict], machine: dict) -> list[str]:
    """The lines under the table: the auto budgets' pace, simulated timings, what streamed from disk."""
    lines: list[str] = []
    paces = ", ".join(
        f"{row['label']} {row['target_pace'][0]:.2f}-{row['target_pace'][1]:.2f}"
        for row in rows
        if row.get("target_pace")
    )
    if paces:
        lines += ["", f"Target passes against the calibration (auto budgets' pace, per generation): {paces}."]
    if machine.get("simulated_offload"):
        lines += ["", f"**SIMULATED target timings** ({machine['simulated_offload']})."]
    if machine.get("weights_memory"):
        memory = machine["weights_memory"]
        reads = ", ".join(
            f"{row['label']} {row['read_mib_per_target_pass']:.0f}"
            for row in rows
            if row.get("read_mib_per_target_pass") is not None
        )
        lines += [
            "",
            f"Target streamed from disk (--ram): {memory['resident'] / 2**20:.0f} MiB resident, "
            f"{memory['streamed'] / 2**20:.0f} MiB streamed per pass, read-ahead window "
            f"{memory['window'] / 2**20:.0f} MiB, {memory['in_ram'] / 2**20:.0f} MiB in RAM at the end; disk "
            f"{memory['disk_bytes_per_second'] / 1e9:.2f} GB/s (sequential, measured at load). MiB read from "
            f"storage per target pass: {reads}.",
        ]
    if machine.get("rpc"):
        exchanged = ", ".join(
            f"{row['label']} {row['network_sent_kib_per_target_pass']:.0f}/"
            f"{row['network_received_kib_per_target_pass']:.0f}"
            for row in rows
            if row.get("network_sent_kib_per_target_pass") is not None
        )
        trips = ", ".join(f"{w['endpoint']} {w['round_trip_ms']:.2f} ms" for w in machine["rpc"]["workers"])
        lines += [
            "",
            f"{machine['rpc']['placement']}. Round trip (measured at load): {trips}. KiB sent/received per "
            f"target pass: {exchanged}.",
        ]
    return lines


def _kernels(machine: dict) -> str:
    """llama.cpp's version and kernels, for the machine line (empty where llama.cpp did not run)."""
    if not machine.get("llama_cpp"):
        return ""
    info = machine["llama_cpp"]
    state = "on" if info["extra_buffers"] else "off"
    amx = ", AMX" if info["amx"] else ", no AMX"
    invariant = ", batch-invariant verification" if info.get("batch_invariant") else ""
    return f"; llama-cpp-python {info['llama_cpp_python']}, repacked kernels {state}{amx}{invariant}"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _num(value: float | None, suffix: str = "", digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}{suffix}"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.0f}%"


def _identical(row: dict) -> str:
    if row["identical_to_ar"] is None:
        return "n/a"
    if row["identical_to_ar"]:
        return "yes"
    same = round(row["identical_prompts_fraction"] * row["prompts"])
    return f"no ({same}/{row['prompts']} prompts; prefix {row['matching_prefix_fraction']:.2f})"


def write_plots(out_dir: Path, rows: Sequence[dict]) -> dict[str, Path]:
    """tokens_per_step.png and tok_per_s.png: budget methods as lines over budget, the others as levels."""
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure state

    paths = {
        "tokens_per_step.png": out_dir / "tokens_per_step.png",
        "tok_per_s.png": out_dir / "tok_per_s.png",
    }
    panels = {
        "tokens_per_step.png": [("tokens_per_step", "tokens per target call")],
        "tok_per_s.png": [("tok_per_s", "decode tok/s"), ("tok_per_s_with_prefill", "tok/s incl. prefill")],
    }
    for name, metrics in panels.items():
        fig = Figure(figsize=(6.4 * len(metrics), 4.4), layout="constrained")
        for i, (key, title) in enumerate(metrics):
            _panel(fig.add_subplot(1, len(metrics), i + 1), rows, key, title)
        fig.savefig(paths[name], dpi=120)
    return paths


def _panel(ax, rows: Sequence[dict], key: str, title: str) -> None:
    colors = iter(f"C{i}" for i in range(100))
    budgeted = [r for r in rows if r["method"] in BUDGET_METHODS and isinstance(r["budget"], int)]
    for method in dict.fromkeys(r["method"] for r in budgeted):
        points = sorted(
            (r["budget"], r[key]) for r in budgeted if r["method"] == method and r[key] is not None
        )
        if points:
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, marker="o", color=next(colors), label=method)
    styles = iter(["--", ":", "-."] * 100)  # distinct even where two levels coincide
    for row in rows:
        if row not in budgeted and row[key] is not None:  # ar, HF methods, dsl, specexec@auto: levels
            ax.axhline(row[key], color=next(colors), linestyle=next(styles), label=row["label"])
    if budgeted:
        ax.set_xscale("log", base=2)
        budgets = sorted({r["budget"] for r in budgeted})
        ax.set_xticks(budgets, [str(b) for b in budgets])
    ax.set_xlabel("budget (draft tokens per target call; sd: draft length)")
    ax.set_ylabel(title)
    ax.set_title(f"{title} vs budget")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
