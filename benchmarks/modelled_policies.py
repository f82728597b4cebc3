"""The auto policies' speed in cost-model time: a comparison that this machine's noise cannot move.

Each drafted step is charged the time the speculation gate records for it (the cost model's estimate of its
draft passes, the draft's catch-up included, and its verification), each plain step one one-token target pass;
the figure is that against plain decoding's t(1) per token. Outputs and policy decisions are the real ones
(llama.cpp backend, the pair's cached calibration); only the clock is the model's, which tracked wall time
within about 10% per step in the traces of 2026-12-02 (docs/benchmarks-history.md). Use it to compare policy
rules: a bench run of the same prompts moves by ±10% from run to run on a shared 2-core machine.

    python benchmarks/modelled_policies.py --prompts mtbench --temperature 0.6 --draft-vocab 64000
"""

from __future__ import annotations

import argparse

from specexec import calibration, engine
from specexec.budget import gate, policy
from specexec.learnt import LearntPolicies
from specexec.models import DEFAULT_DRAFT, DEFAULT_TARGET, load_model, load_tokenizer
from specexec.prompts import load_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--draft", default=DEFAULT_DRAFT)
    parser.add_argument("--draft-vocab", type=int, default=0)
    parser.add_argument("--prompts", default="mtbench")
    parser.add_argument("--n-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--methods", default="specexec,dsl")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--catch-up-passes", type=float, default=policy.CATCH_UP_PASSES,
        help="what a draft's catch-up after plain steps may cost, in target passes (a large value: it reads "
        "every token it missed)",
    )  # fmt: skip
    args = parser.parse_args()
    policy.CATCH_UP_PASSES = args.catch_up_passes

    tokenizer = load_tokenizer(args.target)
    target = load_model(args.target, backend="llamacpp", threads=args.threads)
    draft = load_model(args.draft, backend="llamacpp", threads=args.threads, vocab=args.draft_vocab)
    cost = calibration.cached_cost_model(target, draft)
    one = cost.target_seconds(1)

    drafted: list[float] = []  # the cost-model seconds of each drafted step, as the gate records them
    record = gate.SpeculationGate.record

    def recording(gate, tokens: int, seconds: float) -> None:
        drafted.append(seconds)
        record(gate, tokens, seconds)

    gate.SpeculationGate.record = recording
    prompts = load_prompts(args.prompts, tokenizer, args.n_prompts)
    for method in args.methods.split(","):
        learnt = LearntPolicies()  # shared by the method's generations, as in the bench
        tokens = calls = steps = 0
        seconds = 0.0
        for prompt in prompts:
            drafted.clear()
            stats = engine.generate(
                target, draft, prompt.input_ids, method=method, budget="auto", cost_model=cost,
                max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                top_p=0.9 if args.temperature else 1.0, learnt=learnt,
            ).stats  # fmt: skip
            seconds += sum(drafted) + (stats.target_calls - len(drafted)) * one
            tokens, calls, steps = tokens + stats.new_tokens, calls + stats.target_calls, steps + len(drafted)
        print(
            f"{method} auto, draft vocab {args.draft_vocab or 'all'}, {args.prompts} x{len(prompts)}, "
            f"T={args.temperature}, catch-up {args.catch_up_passes:g} passes: "
            f"{tokens * one / seconds:.3f}x plain decoding in cost-model time, "
            f"{tokens / calls:.2f} tokens per call, {steps} of {calls} steps drafted"
        )


if __name__ == "__main__":
    main()
