"""Per-step engine overhead outside the two models' forwards, against one forward of a 1.5B target.

Tiny random models with the real Qwen2.5 vocabulary (151,936 tokens) make the forwards cheap while keeping
every vocabulary-sized operation (top-k over draft logits, sampling over target logits) at its real size.
Overhead = step time - time inside the draft and target forwards: tree building, masks, verification and
cache compaction. The reference is one 1-token forward of a randomly initialised model with the
Qwen2.5-Coder-1.5B shape, in bfloat16, after a 300-token prefill.

    python benchmarks/overhead.py [--budgets 16,64,256,1024] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import specexec
from specexec.backends.torch.runner import ModelRunner
from specexec.bench.report import describe_cpu

VOCAB = 151_936


def tiny(seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=4096,
        initializer_range=0.5,
        eos_token_id=None,
    )
    return Qwen2ForCausalLM(config).eval()


def target_forward_seconds(repeats: int = 5) -> float:
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(config).to(torch.bfloat16).eval()
    runner = ModelRunner(model, 512)
    with torch.inference_mode():
        runner.extend(torch.randint(0, VOCAB, (300,)))
        times = []
        for _ in range(repeats + 1):
            runner.keep(torch.arange(300))
            start = time.perf_counter()
            runner.extend(torch.randint(0, VOCAB, (1,)))
            times.append(time.perf_counter() - start)
    return sorted(times[1:])[len(times[1:]) // 2]  # median, first call excluded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default="16,64,256,1024")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())

    target, draft = tiny(0), tiny(0)  # draft == target: deep trees, every step prunes the KV cache
    prompt = torch.randint(0, VOCAB, (300,), generator=torch.Generator().manual_seed(0))
    rows = []
    for budget in [int(b) for b in args.budgets.split(",")]:
        for temperature in (0.0, 1.0):
            kwargs = dict(
                method="specexec", budget=budget, max_new_tokens=args.new_tokens, temperature=temperature
            )
            specexec.generate(target, draft, prompt, **kwargs)  # warm-up
            stats = specexec.generate(target, draft, prompt, **kwargs).stats
            steps = stats.target_calls
            rows.append(
                {
                    "budget": budget,
                    "temperature": temperature,
                    "steps": steps,
                    "mean_tree_size": sum(stats.tree_sizes) / steps,
                    "tokens_per_step": stats.tokens_per_step,
                    "overhead_ms_per_step": 1000 * stats.overhead_seconds / steps,
                    "forward_ms_per_step": 1000 * (stats.draft_seconds + stats.target_seconds) / steps,
                }
            )
            print(rows[-1], flush=True)
    reference = target_forward_seconds()
    print(f"\nmachine: {describe_cpu()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(
        f"one 1-token forward of a 1.5B-shaped Qwen2 (bf16, 300-token context): {1000 * reference:.1f} ms\n"
    )
    print("| budget | T | mean tree | tokens/step | overhead ms/step | % of 1.5B forward |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        share = 100 * row["overhead_ms_per_step"] / (1000 * reference)
        row["overhead_share_of_target_forward"] = share / 100
        print(
            f"| {row['budget']} | {row['temperature']:g} | {row['mean_tree_size']:.0f} | "
            f"{row['tokens_per_step']:.2f} | {row['overhead_ms_per_step']:.1f} | {share:.1f}% |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"target_forward_seconds": reference, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
