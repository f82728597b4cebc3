"""`specexec --budget auto` with the packaged draft against a requantized copy of it, paired: the two
drafts take turns on every prompt in one process beside the same streamed target, so the disk's and the
machine's drift between runs moves both alike (separate runs on 2026-12-05 found the Q4_0 copy 8% behind
on MT-Bench at T=0.6 at --ram 0; paired the same day, level; docs/benchmarks.md, "Bigger than RAM").

    python benchmarks/draft_quant_ab.py --ram 512MiB --runs humaneval:0,humaneval:0.6,mtbench:0,mtbench:0.6
        [--quant q4_0] [--recalibrate]

Each draft is priced by its own calibration (`specexec calibrate`'s cache; `--recalibrate` measures both
first) and keeps its own learnt policies across a run's prompts, as a `specexec bench` run does. Prints
each draft's pass times, then per run and draft: decode tok/s, tokens a target call, target and drafting
seconds a call.
"""

from __future__ import annotations

import argparse

import torch

import specexec
from specexec.calibration import cached_cost_model
from specexec.loading import PairSpec, load_pair
from specexec.models import DEFAULT_DRAFT, DEFAULT_TARGET, load_model
from specexec.prompts import load_prompts
from specexec.sizes import parse_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ram", default="512MiB")
    parser.add_argument("--runs", default="humaneval:0,mtbench:0", help="PROMPTS:TEMPERATURE, ...")
    parser.add_argument("--quant", default="q4_0", choices=("q8_0", "q4_0"))
    parser.add_argument("--n-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--recalibrate", action="store_true")
    args = parser.parse_args()
    ram = parse_size(args.ram, zero=True)
    spec = PairSpec(DEFAULT_TARGET, DEFAULT_DRAFT, backend="llamacpp", threads=args.threads, ram=ram,
                    draft_quant="none")  # fmt: skip
    pair = load_pair(spec)
    copy = load_model(DEFAULT_DRAFT, backend="llamacpp", threads=args.threads, quant=args.quant,
                      vocab=pair.draft_vocab)  # fmt: skip
    drafts = {"packaged": pair.draft, args.quant: copy}
    costs = {arm: cached_cost_model(pair.target, draft, args.recalibrate) for arm, draft in drafts.items()}
    for arm, cost in costs.items():
        passes = ", ".join(f"{n}: {cost.draft[n] * 1000:.1f} ms" for n in (1, 4, 16))
        print(f"{arm} draft passes {passes}", flush=True)
    for run in args.runs.split(","):
        prompt_set, temperature = run.split(":")[0], float(run.split(":")[1])
        prompts = load_prompts(prompt_set, pair.tokenizer, args.n_prompts)
        stats = paired(pair.target, drafts, costs, prompts, temperature, args.max_new_tokens)
        for arm, runs in stats.items():
            new, calls = sum(s.new_tokens for s in runs), sum(s.target_calls for s in runs)
            target, drafting = (
                sum(getattr(s, f) for s in runs) / calls for f in ("target_seconds", "draft_seconds")
            )
            print(
                f"{prompt_set} T={temperature} {arm}: {new / sum(s.decode_seconds for s in runs):.2f} tok/s, "
                f"{new / calls:.2f} tokens a call, target {target:.3f} s a call, "
                f"drafting {drafting:.3f} s a call",
                flush=True,
            )


def paired(target, drafts: dict, costs: dict, prompts: list, temperature: float, max_new_tokens: int) -> dict:
    """Each draft's generation stats over `prompts`, the drafts taking turns (one way, then the other)."""
    learnt = {arm: specexec.LearntPolicies() for arm in drafts}
    stats: dict[str, list] = {arm: [] for arm in drafts}

    def generate(arm: str, ids: list[int], n: int):
        return specexec.generate(
            target, drafts[arm], torch.tensor(ids), method="specexec", budget="auto", max_new_tokens=n,
            learnt=learnt[arm], cost_model=costs[arm], temperature=temperature,
            top_p=0.9 if temperature else 1.0, seed=0,
        ).stats  # fmt: skip

    for arm in drafts:  # warm-up
        generate(arm, prompts[0].input_ids, 4)
    for i, prompt in enumerate(prompts):
        for arm in list(drafts) if i % 2 == 0 else list(drafts)[::-1]:
            stats[arm].append(generate(arm, prompt.input_ids, max_new_tokens))
    return stats


if __name__ == "__main__":
    main()
