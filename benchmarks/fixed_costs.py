"""What a generation costs beyond the models' forwards, on the llama.cpp backend with the default pair
(docs/benchmarks-history.md, 2026-12-02, "What a generation costs beyond its forwards").

Several generations in one process, as in the benchmark, the server and a loop over the Python API. Per
generation: the wall time outside prefill and decode (making the runners: llama.cpp contexts), and per
decoding step our own work (decode time minus the forwards' time, `Stats.overhead_seconds`).

    python benchmarks/fixed_costs.py --threads 2
"""

from __future__ import annotations

import argparse
import time

import specexec
from specexec.bench.report import describe_cpu
from specexec.models import DEFAULT_DRAFT, DEFAULT_TARGET, load_model, load_tokenizer
from specexec.prompts import load_prompts

CONFIGS = (("ar", None, 0.0), ("ar", None, 0.6), ("specexec", 16, 0.0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--generations", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()
    tokenizer = load_tokenizer(DEFAULT_TARGET)
    target = load_model(DEFAULT_TARGET, backend="llamacpp", threads=args.threads)
    draft = load_model(DEFAULT_DRAFT, backend="llamacpp", threads=args.threads)
    prompts = load_prompts("humaneval", tokenizer, n=2)
    print(f"{describe_cpu()}, {args.threads} threads, {specexec.__file__}")
    for method, budget, temperature in CONFIGS:
        outside, per_step, share = [], [], []
        for i in range(args.generations):
            prompt = prompts[i % len(prompts)].input_ids
            start = time.perf_counter()
            out = specexec.generate(
                target, draft, prompt, method=method, budget=budget, max_new_tokens=args.max_new_tokens,
                temperature=temperature, top_p=0.9 if temperature else 1.0, seed=i,
            )  # fmt: skip
            wall = time.perf_counter() - start
            stats = out.stats
            outside.append(wall - stats.prefill_seconds - stats.decode_seconds)
            per_step.append(stats.overhead_seconds / stats.target_calls)
            share.append(stats.overhead_seconds / stats.decode_seconds)
        label = f"{method}{f'@{budget}' if budget else ''} T={temperature}"
        print(
            f"{label}: outside prefill and decode (ms) {[round(x * 1e3) for x in outside]}; our work per "
            f"step (ms) {[round(x * 1e3, 2) for x in per_step]}, "
            f"{min(share):.1%}-{max(share):.1%} of decode time"
        )


if __name__ == "__main__":
    main()
