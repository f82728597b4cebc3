"""Replay draft-chain stopping rules offline on the real pair, under greedy decoding, with no timing noise.

Under greedy decoding the output is the target's own greedy output whatever the chain lengths, so how
well a stopping rule does is fixed by two things per output position t: the draft's own greedy chain from
t with its probability for each token, and how many of those tokens match the target's output. `trace`
records both (the draft is run up to `--length` tokens from every position, a few past the first
mismatch); `replay` then plays each rule over the positions (a chain of k tokens from t accepts
min(k, match), emits that + 1 tokens and costs k draft passes plus a target pass over k + 1 tokens, from
a `specexec calibrate` file) and prints tokens per second of modelled time, against sd@k and against an
oracle that knows every match. The rules are the engine's own classes (`ChainCostStop`, `ConfidenceStop`).

    python benchmarks/chain_replay.py trace --prompts mtbench --n-prompts 8 --max-new-tokens 48 \
        --out bench-out/chains-mtbench.json
    python benchmarks/chain_replay.py replay bench-out/chains-mtbench.json CALIBRATION.json
    (CALIBRATION.json: a file of ~/.cache/specexec/calibration, as written by `specexec calibrate`)
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

import torch

from specexec import generate
from specexec.backends.torch.runner import ModelRunner
from specexec.budget.acceptance import ConfidenceStop
from specexec.budget.chains import ChainCostStop
from specexec.budget.costs import CostModel
from specexec.drafters import ChainDrafter, Draft
from specexec.methods import DSL_MAX_LENGTH
from specexec.models import DEFAULT_DRAFT, DEFAULT_TARGET, load_model, load_tokenizer
from specexec.prompts import load_prompts
from specexec.tree import DraftTree

PAST_MISMATCH = 4  # draft tokens traced after the first one that misses


@torch.inference_mode()
def trace(args: argparse.Namespace) -> None:
    tokenizer = load_tokenizer(DEFAULT_TARGET)
    target, draft = load_model(DEFAULT_TARGET), load_model(DEFAULT_DRAFT)
    traced = []
    for prompt in load_prompts(args.prompts, tokenizer, args.n_prompts):
        ids = torch.tensor(prompt.input_ids)
        output = generate(target, None, ids, method="ar", max_new_tokens=args.max_new_tokens).tokens
        full = torch.cat([ids, torch.tensor(output)])  # (P + N,)
        runner = ModelRunner(draft, full.numel() + args.length + 1)
        runner.extend(ids[:-1])
        positions = []
        for t in range(len(output)):
            root = ids.numel() + t - 1  # the chain from position t follows token `root`
            runner.keep(torch.arange(root))
            logits = runner.extend(full[root : root + 1])  # (1, V)
            confidences, match = [], 0
            for i in range(args.length):
                probs = torch.softmax(logits[-1].float(), -1)  # (V,)
                confidence, token = probs.max(-1)
                confidences.append(round(float(confidence), 5))
                if match == i and t + i < len(output) and int(token) == output[t + i]:
                    match += 1
                if i >= match + PAST_MISMATCH:
                    break
                logits = runner.extend(token.view(1))
            positions.append({"confidences": confidences, "match": match})
        traced.append({"id": prompt.id, "positions": positions})
        print(f"{prompt.id}: {len(output)} positions", file=sys.stderr)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(traced, f)


class Fixed:
    def __init__(self, length: int) -> None:
        self.length = length

    def __call__(self, confidences: list[float]) -> int:
        return min(self.length, len(confidences))

    def observe(self, confidences: list[float], accepted: int) -> None:
        pass


class Dsl:
    """What `--method dsl` does with budget auto: the engine's own chain drafter and its stopping rules."""

    def __init__(self, cost: CostModel, confidence_rule: bool = True) -> None:
        stop = ConfidenceStop() if confidence_rule else None
        self.cost = cost
        self.chain = ChainDrafter(DSL_MAX_LENGTH, stop=stop, cost_stop=ChainCostStop(cost, DSL_MAX_LENGTH))

    def __call__(self, confidences: list[float]) -> int:
        if not self.chain.drafts_now():
            return 0
        return next((k for k, c in enumerate(confidences, 1) if self.chain.ends_chain(c)), len(confidences))

    def observe(self, confidences: list[float], accepted: int) -> None:
        # A replayed chain: its first draft pass took in the root alone, as in steady drafting.
        draft = Draft(DraftTree(0, 1, torch.device("cpu")), confidences=confidences, first_pass_tokens=1)
        # Replayed in modelled time: the target pass took what the cost model says (`play`).
        self.chain.observe(
            draft, list(range(1, accepted + 1)), self.cost.target_seconds(len(confidences) + 1)
        )


class Threshold:
    """Stop after the first token whose confidence is below a fixed threshold (the token stays)."""

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold

    def __call__(self, confidences: list[float]) -> int:
        return next((k for k, c in enumerate(confidences, 1) if c < self.threshold), len(confidences))

    def observe(self, confidences: list[float], accepted: int) -> None:
        pass


def play(traced: list[dict], cost: CostModel, rule: Callable[[], object]) -> tuple[float, float]:
    """(tokens per modelled second, tokens per target call) of a fresh `rule()` per prompt."""
    tokens = seconds = calls = 0.0
    draft_pass = cost.draft_seconds(1)
    for prompt in traced:
        positions, policy, t = prompt["positions"], rule(), 0
        while t < len(positions):
            left = len(positions) - t - 1  # draft tokens that can still be used
            confidences, match = positions[t]["confidences"][:left], positions[t]["match"]
            length = policy(confidences)
            accepted = min(length, match)
            tokens += accepted + 1
            seconds += length * draft_pass + cost.target_seconds(length + 1)
            calls += 1
            policy.observe(confidences[:length], accepted)
            t += accepted + 1
    return tokens / seconds, tokens / calls


def oracle(traced: list[dict], cost: CostModel) -> float:
    """Each position drafts exactly the length that maximises E - λT knowing its match (λ iterated)."""
    rate, draft_pass = 1 / cost.target_seconds(1), cost.draft_seconds(1)
    step_seconds = lambda k: k * draft_pass + cost.target_seconds(k + 1)  # noqa: E731
    for _ in range(10):
        tokens = seconds = 0.0
        for prompt in traced:
            positions, t = prompt["positions"], 0
            while t < len(positions):
                most = min(positions[t]["match"], len(positions) - t - 1)
                k = max(range(most + 1), key=lambda k: k + 1 - rate * step_seconds(k))
                tokens, seconds, t = tokens + k + 1, seconds + step_seconds(k), t + k + 1
        rate = tokens / seconds
    return rate


def replay(args: argparse.Namespace) -> None:
    with open(args.trace, encoding="utf-8") as f:
        traced = json.load(f)
    with open(args.calibration, encoding="utf-8") as f:
        cost = CostModel.from_json(json.load(f))
    rules: dict[str, Callable[[], object]] = {f"sd@{k}": (lambda k=k: Fixed(k)) for k in (1, 2, 3, 4, 6, 8)}
    rules["dsl@auto"] = lambda: Dsl(cost)
    rules["dsl@auto, cost rule only"] = lambda: Dsl(cost, confidence_rule=False)
    rules.update({f"threshold {t}": (lambda t=t: Threshold(t)) for t in (0.4, 0.6, 0.7, 0.8, 0.9)})
    results = {name: play(traced, cost, rule) for name, rule in rules.items()}
    best = max((k for k in results if k.startswith("sd@") and k != "sd@1"), key=lambda k: results[k][0])
    positions = sum(len(p["positions"]) for p in traced)
    print(f"{len(traced)} prompts, {positions} positions; ratios against the best of sd@2-8 ({best})\n")
    print("| rule | tok/s (modelled) | tok/call | vs best sd |\n|---|---:|---:|---:|")
    plain = 1 / cost.target_seconds(1)
    print(f"| ar | {plain:.2f} | 1.00 | {plain / results[best][0]:.3f}x |")
    for name, (rate, per_call) in results.items():
        print(f"| {name} | {rate:.2f} | {per_call:.2f} | {rate / results[best][0]:.3f}x |")
    rate = oracle(traced, cost)
    print(f"| oracle (knows every match) | {rate:.2f} | | {rate / results[best][0]:.3f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("trace", help="run the pair and record the draft's chains at every position")
    p.add_argument("--prompts", default="mtbench")
    p.add_argument("--n-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--length", type=int, default=20, help="longest chain traced (dsl's maximum: 20)")
    p.add_argument("--out", required=True)
    p = commands.add_parser("replay", help="play the stopping rules over a trace")
    p.add_argument("trace")
    p.add_argument("calibration", help="a JSON file written by `specexec calibrate`")
    args = parser.parse_args()
    trace(args) if args.command == "trace" else replay(args)


if __name__ == "__main__":
    main()
