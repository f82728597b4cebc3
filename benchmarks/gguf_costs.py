"""What one llama.cpp forward over n tokens costs for several weight types of the same model
(docs/benchmarks-history.md, 2026-12-01, "Would another GGUF type make verification cheap?").

Speculation pays when verifying a block costs little more than decoding one token: t(16)/t(1) at most
about 3 is issue 17's bar for "cheap verification". The packaged target is Q4_K_M; this script writes
other types of the same weights with llama.cpp's own quantizer (`llama_model_quantize`, requantizing from
Q4_K_M, so they are a benchmark's stand-ins, not releases of the model), then times each with specexec's
llama.cpp runner: a 256-token context, one token in steady state (the cost of plain decoding), then
blocks of n tokens (the cost of verifying n), each the fastest of three.

    python benchmarks/gguf_costs.py --types Q4_K_M,Q4_0,IQ4_NL,Q8_0 --threads 2
    python benchmarks/gguf_costs.py --model qwen2.5-coder-0.5b --types IQ4_NL --paths  # just the file
"""

from __future__ import annotations

import argparse
import ctypes
import time
from pathlib import Path

import llama_cpp
import torch

from specexec.backends.llamacpp.model import LlamaCppModel
from specexec.backends.llamacpp.runner import LlamaCppRunner
from specexec.bench.report import describe_cpu
from specexec.models import gguf_file
from specexec.paths import cache_root

CONTEXT = 256
SIZES = (2, 4, 8, 16, 32, 64)


def quantized(source: Path, kind: str, threads: int) -> Path:
    """`source` in llama.cpp's weight type `kind` (cached next to the packaged GGUFs)."""
    dest = cache_root() / "gguf-types" / f"{source.stem}-{kind.lower()}.gguf"
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = threads
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind.upper()}")
    params.allow_requantize = True
    partial = dest.with_suffix(".partial")
    if llama_cpp.llama_model_quantize(str(source).encode(), str(partial).encode(), ctypes.byref(params)):
        raise SystemExit(f"llama.cpp could not quantize {source} to {kind}")
    partial.rename(dest)
    return dest


def costs(path: Path, threads: int) -> dict[int, float]:
    """Seconds per forward: key 1 is a one-token decode in steady state, n > 1 a block of n tokens."""
    runner = LlamaCppRunner(LlamaCppModel(path, threads=threads), CONTEXT + 2 * max(SIZES))
    gen = torch.Generator().manual_seed(0)
    runner.extend(torch.randint(100, 20000, (CONTEXT,), generator=gen))

    def block(n: int) -> float:
        best = float("inf")
        for _ in range(3):
            tokens = torch.randint(100, 20000, (n,), generator=gen)
            start = time.perf_counter()
            runner.extend(tokens)
            best = min(best, time.perf_counter() - start)
            runner.keep(torch.arange(CONTEXT))
        return best

    out = {n: block(n) for n in SIZES}
    start = time.perf_counter()
    for _ in range(8):  # plain decoding: one token after another, the same shape every time
        runner.extend(torch.randint(100, 20000, (1,), generator=gen))
    out[1] = (time.perf_counter() - start) / 8
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="qwen2.5-coder-1.5b", help="a packaged name or a .gguf file")
    parser.add_argument("--types", default="Q4_K_M,Q4_0,IQ4_NL,Q8_0", help="llama.cpp weight types")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--paths", action="store_true", help="only write the files and print their paths")
    args = parser.parse_args()
    source = gguf_file(args.model)
    if args.paths:
        for kind in args.types.split(","):
            print(source if kind.upper() == "Q4_K_M" else quantized(source, kind, args.threads))
        return
    print(f"{describe_cpu()}, {args.threads} threads, context {CONTEXT}")
    print("| weights | MB | " + " | ".join(f"t({n})" for n in (1, *SIZES)) + " | t(16)/t(1) |")
    print("|---|---:|" + "---:|" * (len(SIZES) + 2))
    for kind in args.types.split(","):
        path = source if kind.upper() == "Q4_K_M" else quantized(source, kind, args.threads)
        t = costs(path, args.threads)
        cells = " | ".join(f"{t[n]:.3f}" for n in (1, *SIZES))
        print(f"| {kind} | {path.stat().st_size / 1e6:.0f} | {cells} | {t[16] / t[1]:.1f} |")


if __name__ == "__main__":
    main()
