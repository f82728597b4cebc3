"""GPU offloading check: what streaming a target from pinned host memory costs, and what SpecExec gains.

Runs on one CUDA GPU in about 2 minutes (H200, 2026-12-04: 26 GB of 13B-shaped weights in host RAM) with
randomly initialised models of real shapes (no model files, no network):

1. pinned host-to-device bandwidth;
2. offloaded target forward time for 1 .. 4096 tokens: a Llama-2-13B-shaped model (bfloat16, layers built
   straight into pinned host buffers from the meta device, so host RAM holds the weights once) and a
   Qwen2.5-1.5B-shaped one;
3. one draft pass against the number of expanded nodes, Qwen2.5-0.5B-shaped, resident on the GPU;
4. the engine end to end on the 13B-shaped target: offloaded `ar` and offloaded `specexec` (random
   weights, so the draft is almost never accepted: this shows the mechanics and the time split per step,
   not a speed-up), then accelerate's own CPU offload (`accelerate.cpu_offload` on each decoder layer,
   over the same host memory) of the same target;
5. the 13B-shaped target streamed 4-bit (bitsandbytes NF4) when bitsandbytes imports;
6. how launch-bound a step is: one tiny kernel's launch time, and `specexec`@64 on a resident
   1.5B-shaped target under torch's profiler (CPU time in operators against GPU time in kernels);
7. projected decode tok/s: the measured per-pass costs above combined with the tokens per target pass
   that `specexec bench` measured on the real Qwen2.5-Coder pair (its results.json, --tokens-per-step);
   without that file, the SpecExec reference figures of shared/notes/anchors.md. Projections are labelled
   as such everywhere.

The table comes last on stdout; progress goes to stderr; everything goes to the JSON file.

    python benchmarks/gpu_offload.py [--tokens-per-step bench-out/results.json] [--json out.json]
    python benchmarks/gpu_offload.py --dry-run    # tiny shapes on the CPU: every code path, in seconds
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import init_empty_weights
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import specexec
from specexec.backends.torch.devices import host_buffer, to_device
from specexec.backends.torch.layers import OffloadError, weight_bytes
from specexec.backends.torch.offload import offload_model
from specexec.backends.torch.runner import ModelRunner
from specexec.timing import clock


@dataclass(frozen=True)
class Shape:
    arch: str  # "llama" or "qwen2"
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool


SHAPES = {
    "llama-13b": Shape("llama", 5120, 13824, 40, 40, 40, 32000, False),  # Llama-2-13B: 13.0B parameters
    "qwen2.5-1.5b": Shape("qwen2", 1536, 8960, 28, 12, 2, 151936, True),
    "qwen2.5-0.5b": Shape("qwen2", 896, 4864, 24, 14, 2, 151936, True),
}
DRY_SHAPES = {
    "llama-13b": Shape("llama", 64, 160, 5, 4, 4, 256, False),
    "qwen2.5-1.5b": Shape("qwen2", 48, 96, 3, 4, 2, 256, True),
    "qwen2.5-0.5b": Shape("qwen2", 32, 64, 2, 2, 1, 256, True),
}


@dataclass(frozen=True)
class Plan:
    """How much to measure: full on a GPU, tiny with --dry-run."""

    context: int  # committed tokens before each timed forward
    tokens: tuple[int, ...]  # target forward sizes
    nodes: tuple[int, ...]  # draft pass sizes (expanded nodes)
    reps: int
    bandwidth_bytes: int
    prompt: int
    ar_tokens: int  # new tokens of the offloaded ar run
    specexec_tokens: int
    accelerate_tokens: int
    budget: int  # of the end-to-end specexec run
    quant_tokens: tuple[int, ...]


FULL = Plan(
    256, (1, 16, 64, 256, 1024, 4096), (1, 8, 32, 64, 128, 256), 3, 1 << 30, 64, 16, 16, 8, 256, (1, 64, 1024)
)
DRY = Plan(8, (1, 16), (1, 8), 1, 1 << 20, 8, 3, 3, 2, 8, (1, 16))

# Tokens per target pass of the SpecExec reference on the real pair (shared/notes/anchors.md), used when
# no results.json is given. Draft passes per step are unknown there: the projection then charges the
# reference's maximum of 32 per step.
ANCHOR_ROWS = [
    {"method": "ar", "budget": None, "tokens_per_step": 1.0},
    {"method": "specexec", "budget": 16, "tokens_per_step": 9.6},
    {"method": "specexec", "budget": 64, "tokens_per_step": 14.3},
    {"method": "specexec", "budget": 256, "tokens_per_step": 16.3},
    {"method": "specexec", "budget": 1024, "tokens_per_step": 16.6},
]
DEFAULT_DRAFT_PASSES = 32
DEFAULT_EXPAND = 32
PROJECTED_BUDGETS = (64, 2048)  # the range the goals speak of

GOALS = {
    "forward_1_vs_bandwidth": 1.15,  # 1-token forward <= 1.15 x weight bytes / bandwidth
    "forward_1024_vs_1": 1.3,  # 1024-token forward <= 1.3 x 1-token forward (13B-shaped)
    "specexec_vs_ar": 8.0,  # projected, at least
    "specexec_vs_accelerate": 15.0,
}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------
# Models with real shapes and random weights.


def config_of(shape: Shape, vocab: int | None = None):
    kwargs = dict(
        vocab_size=vocab or shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=8192,
        tie_word_embeddings=shape.tied,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    return (LlamaConfig if shape.arch == "llama" else Qwen2Config)(**kwargs)


def skeleton(shape: Shape, dtype: torch.dtype, vocab: int | None = None):
    """The model with every weight on the meta device (no memory); buffers such as rotary tables are real."""
    cls = LlamaForCausalLM if shape.arch == "llama" else Qwen2ForCausalLM
    with init_empty_weights(include_buffers=False):
        model = cls._from_config(config_of(shape, vocab), dtype=dtype)
    model.tie_weights()  # the meta build does not tie the LM head to the embeddings by itself
    return model.eval()


def random_init(device: torch.device, seed: int):
    """A meta_init: N(0, 0.02) weights drawn on `device` (fast on a GPU) and copied where they belong."""
    generator = torch.Generator(device=device).manual_seed(seed)

    def init(name: str, out: torch.Tensor) -> None:
        if name.endswith("norm.weight"):
            out.fill_(1.0)
        elif name.endswith("bias"):
            out.zero_()
        else:
            values = torch.empty(out.shape, dtype=out.dtype, device=device)
            out.copy_(values.normal_(0.0, 0.02, generator=generator))

    return init


def build_offloaded(shape: Shape, device, dtype, ring_size: int, seed: int, codec=None):
    model = skeleton(shape, dtype)
    start = time.perf_counter()
    offloader = offload_model(
        model, device=device, ring_size=ring_size, codec=codec, meta_init=random_init(device, seed)
    )
    return model, offloader, time.perf_counter() - start


def build_resident(shape: Shape, device, dtype, seed: int, vocab: int | None = None):
    return to_device(skeleton(shape, dtype, vocab), device, random_init(device, seed))


# ---------------------------------------------------------------------------------------------------
# Measurements.


def bandwidth_gbps(device: torch.device, nbytes: int, reps: int = 5) -> float:
    """Host-to-device copy rate from a buffer pinned as the offloader pins its layers (GB/s, 10^9)."""
    src = host_buffer(nbytes, pin=device.type == "cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)
    start = clock(device)
    for _ in range(reps):
        dst.copy_(src, non_blocking=True)
    return nbytes * reps / (clock(device) - start) / 1e9


def forward_seconds(
    model, device, counts, context: int, reps: int, logits_to_keep: int = 0, seed: int = 0
) -> dict[int, float]:
    """Median seconds of one forward of n new tokens after `context` committed ones, for each n."""
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(seed)
    runner = ModelRunner(model, context + max(counts))
    committed = torch.arange(context, device=device)
    times = {}
    with torch.inference_mode():
        runner.extend(torch.randint(0, vocab, (context,), generator=generator).to(device))
        for n in counts:
            samples = []
            for _ in range(reps + 1):  # the first is a warm-up
                runner.keep(committed)
                tokens = torch.randint(0, vocab, (n,), generator=generator).to(device)
                start = clock(device)
                runner.extend(tokens, logits_to_keep=logits_to_keep)
                samples.append(clock(device) - start)
            times[n] = statistics.median(samples[1:])
    return times


def engine_run(target, draft, device, method: str, new_tokens: int, prompt: int, budget: int) -> dict:
    ids = torch.randint(0, target.config.vocab_size, (prompt,), generator=torch.Generator().manual_seed(1))

    def generate(tokens: int):
        return specexec.generate(
            target,
            draft if method != "ar" else None,
            ids.to(device),
            method=method,
            budget=budget,
            max_new_tokens=tokens,
            eos_token_id=[],
        )

    generate(2)  # warm-up, not timed: the first passes of each shape pick and load their kernels
    start = clock(device)
    out = generate(new_tokens)
    wall = clock(device) - start
    stats = out.stats
    steps = max(stats.target_calls, 1)
    return {
        "method": method,
        "budget": budget if method != "ar" else None,
        "new_tokens": stats.new_tokens,
        "target_calls": stats.target_calls,
        "draft_calls": stats.draft_calls,
        "tokens_per_step": stats.tokens_per_step,
        "wall_seconds": wall,
        "prefill_seconds": stats.prefill_seconds,
        "decode_tok_per_s": stats.decode_tokens_per_second,
        "per_step_seconds": {
            "target": stats.target_seconds / steps,
            "draft": stats.draft_seconds / steps,
            "overhead": stats.overhead_seconds / steps,
            "total": stats.decode_seconds / steps,
        },
    }


def launch_bound(shapes: dict[str, Shape], device: torch.device, dtype, plan: Plan) -> dict:
    """How much of a SpecExec step the GPU spends computing: one tiny kernel's launch time, then
    `specexec`@64 on a resident 1.5B-shaped target under torch's profiler, the CPU's time in operators
    against the GPU's time in kernels. Where the CPU time is several times the GPU's, the GPU waits for
    launches, and capturing the forwards in CUDA graphs is the lever."""
    from torch.profiler import ProfilerActivity, profile

    scratch = torch.zeros(16, device=device)
    reps = 2000
    start = clock(device)
    for _ in range(reps):
        scratch.add_(1)
    launch = (clock(device) - start) / reps
    target = build_resident(shapes["qwen2.5-1.5b"], device, dtype, seed=0)
    draft = build_resident(shapes["qwen2.5-0.5b"], device, dtype, seed=1)
    engine_run(target, draft, device, "specexec", 2, plan.prompt, 64)  # warm-up
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        run = engine_run(target, draft, device, "specexec", plan.specexec_tokens, plan.prompt, 64)
    events = prof.key_averages()
    cpu = sum(e.self_cpu_time_total for e in events) / 1e6
    gpu = sum(getattr(e, "self_device_time_total", 0) for e in events) / 1e6
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel"))
    del target, draft
    release(device)
    return {
        "tiny_kernel_seconds": launch,
        "run": run,
        "profiled_cpu_seconds": cpu,
        "profiled_gpu_kernel_seconds": gpu,
        "kernel_launches_per_step": launches / max(run["target_calls"], 1),
    }


def accelerate_offload(model) -> Callable[[], None]:
    """Give each decoder layer accelerate's CPU offload hooks (weights copied in on every forward, no
    prefetch); returns a function that removes them and puts the original parameters back."""
    from accelerate import cpu_offload
    from accelerate.hooks import remove_hook_from_module

    layers = model.model.layers
    saved = [
        (module, kind, attr, tensor)
        for module in layers.modules()
        for kind, store in (("_parameters", module._parameters), ("_buffers", module._buffers))
        for attr, tensor in store.items()
    ]
    device = model.model.embed_tokens.weight.device
    for layer in layers:
        cpu_offload(layer, execution_device=device)

    def undo() -> None:
        for layer in layers:
            remove_hook_from_module(layer, recurse=True)
        for module, kind, attr, tensor in saved:
            getattr(module, kind)[attr] = tensor

    return undo


# ---------------------------------------------------------------------------------------------------
# Projection.


def interpolate(curve: dict[int, float], n: float) -> tuple[float, bool]:
    """Piecewise-linear in n through the measured points; (value, extrapolated)."""
    xs = sorted(curve)
    if n <= xs[0]:
        return curve[xs[0]], n < xs[0]
    for lo, hi in zip(xs, xs[1:], strict=False):
        if n <= hi:
            return curve[lo] + (curve[hi] - curve[lo]) * (n - lo) / (hi - lo), False
    lo, hi = xs[-2], xs[-1]
    slope = max(0.0, (curve[hi] - curve[lo]) / (hi - lo))  # never cheaper than the largest measured
    return curve[hi] + slope * (n - hi), True


def load_rows(path: str | None) -> tuple[list[dict], str]:
    if path is None:
        return ANCHOR_ROWS, "shared/notes/anchors.md (SpecExec reference, real Qwen2.5-Coder pair, CPU)"
    rows = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(rows, list) or not all(isinstance(r, dict) and "method" in r for r in rows):
        raise SystemExit(f"{path}: expected the results.json list that `specexec bench` writes")
    return rows, f"{path} (specexec bench on the real pair, CPU)"


def project(
    target_curve: dict[int, float],
    draft_curve: dict[int, float],
    overhead_per_step: float,
    ar_seconds: float,
    accelerate_seconds: float | None,
    rows: list[dict],
) -> list[dict]:
    """Projected decode tok/s: tokens per step (measured on the real pair) / projected step time.

    specexec step = target forward over budget + 1 tokens + draft passes per step x one draft pass over
    `expand` nodes + the engine's measured per-step overhead.
    """
    out = [{"label": "ar offloaded", "tok_per_s": 1 / ar_seconds, "step_seconds": ar_seconds}]
    if accelerate_seconds is not None:
        out.append(
            {
                "label": "ar, accelerate cpu_offload",
                "tok_per_s": 1 / accelerate_seconds,
                "step_seconds": accelerate_seconds,
            }
        )
    candidates = []
    for row in rows:
        if row.get("method") != "specexec" or not row.get("budget") or not row.get("tokens_per_step"):
            continue
        budget = int(row["budget"])
        target, extrapolated = interpolate(target_curve, budget + 1)
        if row.get("draft_calls") and row.get("target_calls"):
            passes, passes_source = row["draft_calls"] / row["target_calls"], "measured"
        else:
            passes, passes_source = DEFAULT_DRAFT_PASSES, "assumed maximum"
        expand = min(int(row.get("expand") or DEFAULT_EXPAND), budget)
        draft, _ = interpolate(draft_curve, expand)
        step = target + passes * draft + overhead_per_step
        candidates.append(
            {
                "label": f"specexec@{budget} offloaded",
                "budget": budget,
                "tokens_per_step": row["tokens_per_step"],
                "draft_passes_per_step": passes,
                "draft_passes_source": passes_source,
                "step_seconds": step,
                "target_seconds": target,
                "draft_seconds": passes * draft,
                "extrapolated": extrapolated,
                "tok_per_s": row["tokens_per_step"] / step,
            }
        )
    lo, hi = PROJECTED_BUDGETS
    out += [c for c in candidates if lo <= c["budget"] <= hi]
    if candidates:
        best = max(candidates, key=lambda c: c["tok_per_s"])
        out.append({**best, "label": f"specexec auto (best budget: {best['budget']}) offloaded"})
    for row in out:
        row["projected"] = True
        row["speedup_vs_ar"] = row["tok_per_s"] * ar_seconds
        row["speedup_vs_accelerate"] = row["tok_per_s"] * accelerate_seconds if accelerate_seconds else None
    return out


# ---------------------------------------------------------------------------------------------------
# Report.


def table(headers: list[str], rows: list[list]) -> str:
    cells = [[str(c) for c in r] for r in [headers, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def report(result: dict) -> str:
    parts = [
        f"# GPU offload check ({result['environment']['device']}{', DRY RUN' if result['dry_run'] else ''})"
    ]
    parts += [f"note: {n}" for n in result["notes"]]
    kind = "CPU-to-CPU copy (dry run)" if result["dry_run"] else "pinned host-to-device"
    parts.append(f"{kind} bandwidth: {result['bandwidth_gbps']:.1f} GB/s (measured)")
    for name, item in result["forward"].items():
        rows = [
            [n, ms(t), f"{t / item['seconds'][1]:.2f}", f"{t / item['bandwidth_bound_seconds']:.2f}"]
            for n, t in ((int(k), v) for k, v in item["seconds"].items())
        ]
        parts.append(
            f"\n## {name}-shaped target, offloaded ({item['describe']}), measured\n"
            + table(["tokens", "forward ms", "x 1-token", "x bytes/bandwidth"], rows)
        )
    for name, item in result.get("quantized", {}).items():
        rows = [
            [n, ms(t), ms(item["dense_seconds"].get(str(n)))]
            for n, t in ((int(k), v) for k, v in item["seconds"].items())
        ]
        parts.append(
            f"\n## {name}-shaped target, offloaded {item['codec']} ({item['describe']}), measured\n"
            + table(["tokens", "nf4 forward ms", "bf16 forward ms"], rows)
        )
    draft = result["draft"]
    parts.append(
        f"\n## draft pass, {draft['shape']}-shaped, resident, measured\n"
        + table(["expanded nodes", "pass ms"], [[n, ms(t)] for n, t in draft["seconds"].items()])
    )
    rows = []
    for run in result["engine"]:
        split = run["per_step_seconds"]
        rows.append(
            [
                run["label"],
                run["new_tokens"],
                run["target_calls"],
                f"{run['tokens_per_step']:.2f}",
                ms(split["target"]),
                ms(split["draft"]),
                ms(split["overhead"]),
                f"{run['decode_tok_per_s']:.2f}",
            ]
        )
    parts.append(
        "\n## engine end to end on the 13B-shaped target, random weights (measured; acceptance is not "
        "meaningful)\n"
        + table(
            [
                "run",
                "tokens",
                "target calls",
                "tok/step",
                "target ms/step",
                "draft ms/step",
                "overhead ms/step",
                "tok/s",
            ],
            rows,
        )
    )
    rows = [
        [
            r["label"] + (" (extrapolated)" if r.get("extrapolated") else ""),
            f"{r.get('tokens_per_step', 1.0):.2f}",
            ms(r["step_seconds"]),
            f"{r['tok_per_s']:.2f}",
            f"{r['speedup_vs_ar']:.1f}x",
            "-" if r["speedup_vs_accelerate"] is None else f"{r['speedup_vs_accelerate']:.1f}x",
        ]
        for r in result["projection"]["rows"]
    ]
    parts.append(
        "\n## PROJECTED decode on the 13B-shaped target "
        f"(tokens per step from {result['projection']['source']})\n"
        + table(
            ["projected config", "tok/step", "step ms", "projected tok/s", "vs ar", "vs accelerate"], rows
        )
    )
    if "launch_bound" in result:
        bound = result["launch_bound"]
        parts.append(
            "\n## launch-bound check: specexec@64 on a resident 1.5B-shaped target, profiled (measured)\n"
            + table(
                ["tiny kernel us", "CPU in operators s", "GPU in kernels s", "launches/step", "tok/s"],
                [
                    [
                        f"{bound['tiny_kernel_seconds'] * 1e6:.1f}",
                        f"{bound['profiled_cpu_seconds']:.3f}",
                        f"{bound['profiled_gpu_kernel_seconds']:.3f}",
                        f"{bound['kernel_launches_per_step']:.0f}",
                        f"{bound['run']['decode_tok_per_s']:.2f}",
                    ]
                ],
            )
        )
    rows = [[g["goal"], g["value"], g["target"], "PASS" if g["passed"] else "FAIL"] for g in result["goals"]]
    parts.append(
        "\n## goals"
        + (" (dry run: not meaningful)" if result["dry_run"] else "")
        + "\n"
        + table(["goal", "value", "target", ""], rows)
    )
    return "\n".join(parts)


# ---------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dry-run", action="store_true", help="tiny shapes on the CPU (tests the code paths)"
    )
    parser.add_argument(
        "--tokens-per-step", default=None, help="results.json of `specexec bench` on the real pair"
    )
    parser.add_argument("--json", default="bench-out/gpu_offload.json", help="where to write the results")
    parser.add_argument("--ring-size", type=int, default=2)
    parser.add_argument("--minutes", type=float, default=7.0, help="skip optional parts past this much time")
    args = parser.parse_args(argv)

    began = time.perf_counter()
    path = Path(args.json)
    if args.dry_run:
        device, dtype, shapes, plan = torch.device("cpu"), torch.float32, DRY_SHAPES, DRY
        torch.set_num_threads(1)  # tiny kernels: thread start-up would dominate
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA GPU visible; run with --dry-run to exercise the code paths on the CPU")
        device, dtype, shapes, plan = torch.device("cuda", 0), torch.bfloat16, SHAPES, FULL
    rows, source = load_rows(args.tokens_per_step)
    notes: list[str] = []
    result: dict = {
        "dry_run": args.dry_run,
        "environment": {
            "device": torch.cuda.get_device_name(device)
            if device.type == "cuda"
            else f"cpu ({platform.machine()})",
            "torch": torch.__version__,
            "python": platform.python_version(),
            "dtype": str(dtype),
            "ring_size": args.ring_size,
        },
        "forward": {},
        "quantized": {},
        "notes": notes,
    }

    def late(part: str) -> bool:
        if time.perf_counter() - began > args.minutes * 60:
            notes.append(f"{part} skipped: past the --minutes budget")
            return True
        return False

    log("bandwidth ...")
    bandwidth = bandwidth_gbps(device, plan.bandwidth_bytes)
    result["bandwidth_gbps"] = bandwidth

    # Qwen2.5-1.5B-shaped target, offloaded.
    log("qwen2.5-1.5b-shaped target, offloaded ...")
    target, offloader, built = build_offloaded(shapes["qwen2.5-1.5b"], device, dtype, args.ring_size, seed=0)
    seconds = forward_seconds(target, device, plan.tokens, plan.context, plan.reps)
    result["forward"]["qwen2.5-1.5b"] = forward_entry(target, offloader, seconds, bandwidth, built)
    save(path, result)  # every part as it ends: a run cut short keeps what it measured
    del target, offloader
    release(device)

    # The draft curve: Qwen2.5-0.5B-shaped, resident.
    log("qwen2.5-0.5b-shaped draft, resident ...")
    draft = build_resident(shapes["qwen2.5-0.5b"], device, dtype, seed=1)
    draft_curve = forward_seconds(draft, device, plan.nodes, plan.context, plan.reps)
    result["draft"] = {"shape": "qwen2.5-0.5b", "seconds": draft_curve}
    save(path, result)
    del draft
    release(device)

    # The 13B-shaped target: forwards, engine, accelerate, 4-bit.
    log("llama-13b-shaped target, offloaded: building ...")
    shape = shapes["llama-13b"]
    target, offloader, built = build_offloaded(shape, device, dtype, args.ring_size, seed=2)
    log(f"  {offloader.describe()} (built in {built:.1f} s)")
    seconds = forward_seconds(target, device, plan.tokens, plan.context, plan.reps)
    result["forward"]["llama-13b"] = forward_entry(target, offloader, seconds, bandwidth, built)
    dense_seconds = seconds
    save(path, result)

    log("engine end to end ...")
    draft = build_resident(shapes["qwen2.5-0.5b"], device, dtype, seed=3, vocab=shape.vocab)
    engine = [
        {"label": "ar, offloaded", **engine_run(target, None, device, "ar", plan.ar_tokens, plan.prompt, 1)},
        {
            "label": f"specexec@{plan.budget}, offloaded",
            **engine_run(target, draft, device, "specexec", plan.specexec_tokens, plan.prompt, plan.budget),
        },
    ]
    result["engine"] = engine
    save(path, result)

    accelerate_seconds = None
    offloader.remove()  # streamed layers back as plain modules over the same (pinned) host memory
    if not late("accelerate's offload"):
        log("accelerate cpu_offload ...")
        undo = accelerate_offload(target)
        try:
            accel = forward_seconds(target, device, (1,), plan.context, plan.reps)
            accelerate_seconds = accel[1]
            run = engine_run(target, None, device, "ar", plan.accelerate_tokens, plan.prompt, 1)
            engine.append({"label": "ar, accelerate cpu_offload", **run})
        finally:
            undo()
            del undo  # it holds the host tensors; the 4-bit pack below frees them layer by layer
        result["accelerate"] = {"forward_1_token_seconds": accelerate_seconds}

    if late("4-bit (nf4) offload"):
        pass
    else:
        try:
            offloader = offload_model(target, device=device, ring_size=args.ring_size, codec="nf4")
        except OffloadError as err:
            notes.append(f"4-bit (nf4) offload skipped: {err}")
        else:
            log(f"  {offloader.describe()}")
            quant = forward_seconds(target, device, plan.quant_tokens, plan.context, plan.reps)
            result["quantized"]["llama-13b"] = {
                "codec": "nf4 (bitsandbytes)",
                "describe": offloader.describe(),
                "weight_bytes": weight_bytes(target),
                "seconds": quant,
                "dense_seconds": {str(n): dense_seconds.get(n) for n in quant},
            }
            offloader.remove()
    del target, draft, offloader
    release(device)

    if not late("the launch-bound check"):
        log("launch-bound check ...")
        result["launch_bound"] = launch_bound(shapes, device, dtype, plan)
        save(path, result)

    # Projection, against the 13B-shaped target's measured costs.
    specexec_run = engine[1]
    overhead = specexec_run["per_step_seconds"]["overhead"]
    projection = project(dense_seconds, draft_curve, overhead, dense_seconds[1], accelerate_seconds, rows)
    result["projection"] = {
        "source": source,
        "method": "tokens per step (measured on the real pair) / (offloaded target forward over budget+1 "
        "tokens + draft passes per step x draft pass over `expand` nodes + engine overhead per step)",
        "overhead_per_step_seconds": overhead,
        "rows": projection,
    }
    result["goals"] = goals(result, projection)
    result["seconds"] = time.perf_counter() - began

    save(path, result)
    log(f"wrote {path} ({result['seconds']:.0f} s)")
    print(report(result))
    return result


def forward_entry(model, offloader, seconds: dict[int, float], bandwidth: float, built: float) -> dict:
    nbytes = weight_bytes(model)
    device = offloader.device
    return {
        "describe": offloader.describe(),
        "weight_bytes": nbytes,
        "build_seconds": built,
        "bandwidth_bound_seconds": nbytes / (bandwidth * 1e9),
        "device_peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "seconds": seconds,
    }


def save(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str) + "\n", encoding="utf-8")


def release(device: torch.device) -> None:
    """Free what the deleted models held: offloaded models are reference cycles (model <-> offloader)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def goals(result: dict, projection: list[dict]) -> list[dict]:
    big = result["forward"]["llama-13b"]
    one = big["seconds"][1]
    out = [
        check(
            "13B 1-token forward / (weight bytes / bandwidth)",
            one / big["bandwidth_bound_seconds"],
            "<=",
            GOALS["forward_1_vs_bandwidth"],
        ),
    ]
    if 1024 in big["seconds"]:
        out.append(
            check(
                "13B 1024-token / 1-token forward",
                big["seconds"][1024] / one,
                "<=",
                GOALS["forward_1024_vs_1"],
            )
        )
    in_range = [r for r in projection if r.get("budget") is not None]
    if in_range:
        best = max(in_range, key=lambda r: r["tok_per_s"])
        out.append(
            check(
                f"projected {best['label']} vs ar offloaded",
                best["speedup_vs_ar"],
                ">=",
                GOALS["specexec_vs_ar"],
            )
        )
        if best["speedup_vs_accelerate"] is not None:
            out.append(
                check(
                    f"projected {best['label']} vs accelerate offload",
                    best["speedup_vs_accelerate"],
                    ">=",
                    GOALS["specexec_vs_accelerate"],
                )
            )
    return out


def check(goal: str, value: float, op: str, target: float) -> dict:
    passed = value <= target if op == "<=" else value >= target
    return {
        "goal": goal,
        "value": round(value, 3),
        "target": f"{op} {target}",
        "passed": bool(passed) and math.isfinite(value),
    }


if __name__ == "__main__":
    main()
