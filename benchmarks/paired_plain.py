"""Our decoding loop against plain llama.cpp's, paired prompt by prompt (docs/benchmarks.md, "In RAM: the
llama.cpp backend", the Zen 2 host).

A benchmark run compares methods through totals of a few generations each, and this machine's drift moves
such a ratio by several percent. Here every round decodes the same prompt with plain llama.cpp
(`specexec.bench.llamacpp.LlamaCpp`, one `Llama.eval` per token), with `ar` on specexec's llama.cpp
backend and with the default (`specexec`, budget auto, what it learns kept across rounds as in the
benchmark), in an order that rotates every round, so each ratio is taken from runs seconds apart. Prints
the decode time per token of each round and the median of the per-round ratios.

    python benchmarks/paired_plain.py --threads 2 --rounds 16 --prompts mtbench [--temperature 0.6]
"""

from __future__ import annotations

import argparse
import statistics

import specexec
from specexec.bench.llamacpp import LlamaCpp
from specexec.bench.report import describe_cpu
from specexec.learnt import LearntPolicies
from specexec.models import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    eos_token_ids,
    gguf_file,
    load_model,
    load_tokenizer,
)
from specexec.prompts import load_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--prompts", default="humaneval")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()
    top_p = 0.9 if args.temperature else 1.0
    tokenizer = load_tokenizer(DEFAULT_TARGET)
    target = load_model(DEFAULT_TARGET, backend="llamacpp", threads=args.threads)
    draft = load_model(DEFAULT_DRAFT, backend="llamacpp", threads=args.threads)
    prompts = load_prompts(args.prompts, tokenizer, n=4)
    eos = eos_token_ids(target, tokenizer)
    longest = max(len(p.input_ids) for p in prompts)
    plain = LlamaCpp(gguf_file(DEFAULT_TARGET), longest + args.max_new_tokens + 8, threads=args.threads)
    learnt = LearntPolicies()

    def run(method: str, ids: list[int], seed: int) -> tuple[float, float]:
        """(decode seconds per token, tokens per target call)"""
        if method == "llamacpp":
            out = plain.run(
                ids, args.max_new_tokens, seed, eos, temperature=args.temperature, top_p=top_p, top_k=0
            )
            return out["decode_seconds"] / out["new_tokens"], 1.0
        stats = specexec.generate(
            target, draft, ids, method=method, max_new_tokens=args.max_new_tokens, eos_token_id=eos,
            temperature=args.temperature, top_p=top_p, seed=seed, learnt=learnt,
        ).stats  # fmt: skip
        return stats.decode_seconds / stats.new_tokens, stats.tokens_per_step

    methods = ["llamacpp", "ar", "specexec"]
    for prompt in prompts:  # warm-up: caches, contexts, and the default's first lessons
        for method in methods:
            run(method, prompt.input_ids, 0)
    per_token = {m: [] for m in methods}
    calls = {m: [] for m in methods}
    for r in range(args.rounds):
        prompt = prompts[r % len(prompts)]
        order = methods[r % 3 :] + methods[: r % 3]
        for method in order:
            seconds, per_call = run(method, prompt.input_ids, r)
            per_token[method].append(seconds)
            calls[method].append(per_call)
        print(
            f"round {r} ({prompt.id}, order {','.join(order)}): ms/token "
            + ", ".join(f"{m} {per_token[m][-1] * 1e3:.1f}" for m in methods)
        )
    print(
        f"{describe_cpu()}, {args.threads} threads, {args.prompts}, "
        f"T={args.temperature}, {args.rounds} rounds of {args.max_new_tokens} tokens"
    )
    for method in methods[1:]:
        ratios = [p / o for p, o in zip(per_token["llamacpp"], per_token[method], strict=True)]
        print(
            f"{method}: speed / plain llama.cpp's, per round: median {statistics.median(ratios):.3f}x, "
            f"range {min(ratios):.3f}-{max(ratios):.3f}x; tokens per target call "
            f"{statistics.mean(calls[method]):.2f}"
        )


if __name__ == "__main__":
    main()
