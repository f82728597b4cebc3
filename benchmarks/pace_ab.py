"""`specexec --budget auto` with and without following the target's pace (`budget.costs.TargetPace`), paired:
the two take turns on every prompt in one process, so the disk's and the machine's drift between runs
moves both alike (separate `specexec bench` runs of the same setting differed by 5% on the Zen 4 host).

    python benchmarks/pace_ab.py --ram 0 --prompts mtbench [--temperature 0.6] [--band 0.3] [--stale 1.6]

- `--band`: how far off the calibration the pace must be before the policies price at it
  (`policy.PACE_BAND`); 0 prices at any pace.
- `--stale F`: the calibration's target times and overlap multiplied by F, as a calibration taken while
  the disk ran F times slower would have them (the cached calibration itself is left as it is).
The arm without the pace never follows it; each arm keeps its own learnt policies across prompts, as a
`specexec bench` run does. Prints each generation and the totals.
"""

from __future__ import annotations

import argparse

import torch

import specexec
from specexec.budget import policy
from specexec.budget.costs import CostModel
from specexec.calibration import cached_cost_model
from specexec.loading import PairSpec, load_pair
from specexec.models import DEFAULT_DRAFT, DEFAULT_TARGET
from specexec.prompts import load_prompts
from specexec.sizes import parse_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ram", default="0")
    parser.add_argument("--prompts", default="mtbench")
    parser.add_argument("--n-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--band", type=float, default=policy.PACE_BAND)
    parser.add_argument("--stale", type=float, default=1.0)
    args = parser.parse_args()
    policy.PACE_BAND = args.band
    ram = parse_size(args.ram, zero=True)
    spec = PairSpec(DEFAULT_TARGET, DEFAULT_DRAFT, backend="llamacpp", threads=args.threads, ram=ram)
    pair = load_pair(spec)
    calibrated = cached_cost_model(pair.target, pair.draft)
    cost = CostModel(
        {n: seconds * args.stale for n, seconds in calibrated.target.items()},
        calibrated.draft, calibrated.label, calibrated.overlap * args.stale, measured=True,
    )  # fmt: skip
    prompts = load_prompts(args.prompts, pair.tokenizer, args.n_prompts)
    follows = policy.DraftingPolicy.observe_pass
    learnt = {"pace": specexec.LearntPolicies(), "calibration": specexec.LearntPolicies()}
    stats: dict[str, list] = {arm: [] for arm in learnt}

    def run(arm: str, input_ids: list[int], tokens: int):
        policy.DraftingPolicy.observe_pass = follows if arm == "pace" else lambda *_: None
        out = specexec.generate(
            pair.target, pair.draft, torch.tensor(input_ids), method="specexec", budget="auto",
            max_new_tokens=tokens, learnt=learnt[arm], cost_model=cost, temperature=args.temperature,
            top_p=0.9 if args.temperature else 1.0, seed=0,
        )  # fmt: skip
        return out.stats

    for arm in learnt:
        run(arm, prompts[0].input_ids, 8)  # a warm-up generation, not counted
    for i, prompt in enumerate(prompts):
        for arm in list(learnt) if i % 2 == 0 else list(learnt)[::-1]:
            s = run(arm, prompt.input_ids, args.max_new_tokens)
            stats[arm].append(s)
            pace = f"{s.target_pace:.2f}" if s.target_pace is not None else "-"
            print(
                f"{prompt.id} {arm}: {s.decode_tokens_per_second:.2f} tok/s, {s.tokens_per_step:.2f} tokens "
                f"a call, target {s.target_seconds / s.target_calls:.3f} s and drafting "
                f"{s.draft_seconds / s.target_calls:.3f} s a call, pace {pace}",
                flush=True,
            )
    for arm, runs in stats.items():
        new, calls = sum(s.new_tokens for s in runs), sum(s.target_calls for s in runs)
        decode = sum(s.decode_seconds for s in runs)
        print(
            f"{arm}: {new / decode:.2f} tok/s, {new / calls:.2f} tokens a call, target "
            f"{sum(s.target_seconds for s in runs) / calls:.3f} s and drafting "
            f"{sum(s.draft_seconds for s in runs) / calls:.3f} s a call"
        )


if __name__ == "__main__":
    main()
