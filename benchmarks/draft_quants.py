"""A draft requantized by llama.cpp (`--draft-quant`): what its passes cost and how close it stays to the
target, for each type, on the packaged pair (the draft with its default 64,000-id head).

    python benchmarks/draft_quants.py --threads 2 [--quants none,q8_0,q4_0] [--n-prompts 8]

For each type, in one process:
- seconds per draft pass over k new tokens after a 256-token context (the median of --rounds, sizes
  interleaved);
- on the target's own greedy continuations (--max-new-tokens after each of --n-prompts HumanEval and
  MT-Bench prompts, the target in RAM): how often the draft's top token is the target's, and the mean of
  sum_x min(p(x), q(x)) at temperature 0.6 (the chance that one drafted token is accepted there).
A draft that agrees less takes in fewer tokens a step, and more so on long chains: a chain's expected
length grows as a / (1 - a) in the per-token acceptance a.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specexec.backends import make_runner
from specexec.backends.llamacpp.model import LlamaCppModel
from specexec.models import DEFAULT_DRAFT, DEFAULT_TARGET, gguf_file, load_tokenizer
from specexec.prompts import load_prompts

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 32)
CONTEXT = 256
VOCAB = 64000  # --draft-vocab auto for the packaged draft
TEMPERATURE = 0.6


def pass_seconds(model: LlamaCppModel, rounds: int) -> dict[int, float]:
    runner = make_runner(model, CONTEXT + max(SIZES))
    generator = torch.Generator().manual_seed(0)
    runner.extend(torch.randint(0, VOCAB, (CONTEXT,), generator=generator))
    times: dict[int, list[float]] = {k: [] for k in SIZES}
    for _ in range(rounds + 1):  # the first round warms up
        for k in SIZES:
            runner.keep(torch.arange(CONTEXT))
            start = time.perf_counter()
            runner.extend(torch.randint(0, VOCAB, (k,), generator=generator), logits_to_keep=k)
            times[k].append(time.perf_counter() - start)
    return {k: statistics.median(v[1:]) for k, v in times.items()}


def continuation_logits(model: LlamaCppModel, texts: list[tuple[list[int], list[int]]]) -> list[torch.Tensor]:
    """Logits (len(new), V) at each new token's position, for each (prompt, new tokens)."""
    out = []
    for prompt, new in texts:
        runner = make_runner(model, len(prompt) + len(new) + 8)
        tokens = torch.tensor(prompt + new)
        out.append(runner.extend(tokens[:-1], logits_to_keep=len(new)).float())  # (len(new), V)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quants", default="none,q8_0,q4_0")
    parser.add_argument("--n-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(DEFAULT_TARGET)
    target = LlamaCppModel(gguf_file(DEFAULT_TARGET), threads=args.threads)
    sets = {name: load_prompts(name, tokenizer, args.n_prompts) for name in ("humaneval", "mtbench")}
    texts: dict[str, list[tuple[list[int], list[int]]]] = {}
    with torch.inference_mode():
        for name, prompts in sets.items():
            texts[name] = []
            for prompt in prompts:
                runner = make_runner(target, len(prompt.input_ids) + args.max_new_tokens + 8)
                logits = runner.extend(torch.tensor(prompt.input_ids))  # (1, V)
                new = []
                for _ in range(args.max_new_tokens):
                    new.append(int(logits[-1].argmax()))
                    logits = runner.extend(torch.tensor(new[-1:]))
                texts[name].append((list(prompt.input_ids), new))
        target_logits = {name: continuation_logits(target, t) for name, t in texts.items()}
        always = tuple(tokenizer.all_special_ids)
        for quant in args.quants.split(","):
            draft = LlamaCppModel(
                gguf_file(DEFAULT_DRAFT), threads=args.threads, vocab=VOCAB, always=always, quant=quant
            )
            seconds = pass_seconds(draft, args.rounds)
            rounded = {k: round(v, 4) for k, v in seconds.items()}
            print(f"{quant} ({draft.weights}): seconds per pass {rounded}")
            for name in texts:
                top = accepted = count = 0.0
                drafted = continuation_logits(draft, texts[name])
                for p_logits, q_logits in zip(target_logits[name], drafted, strict=True):
                    top += float((p_logits.argmax(-1) == q_logits.argmax(-1)).sum())
                    p = torch.softmax(p_logits / TEMPERATURE, dim=-1)  # (n, V)
                    q = torch.softmax(q_logits / TEMPERATURE, dim=-1)
                    accepted += float(torch.minimum(p, q).sum())
                    count += p.shape[0]
                share, overlap = top / count, accepted / count
                print(f"  {name}: top token equal {share:.3f}, sum min(p, q) at T=0.6 {overlap:.3f}")


if __name__ == "__main__":
    main()
