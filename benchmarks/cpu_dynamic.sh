#!/usr/bin/env bash
# Issue 4's CPU benchmark (docs/benchmarks.md, "In RAM: the torch backend and quantized weights"): the real
# pair in bfloat16, every method at its defaults next to the sweeps it must beat, MT-Bench and HumanEval,
# greedy and T=0.6, one run per prompt set and temperature, on an otherwise idle machine. Each run starts from
# a fresh calibration (this machine's speed and the shape of its cost curves drift over minutes) and times
# every run twice, the order reversed the second time (--repeats 2).
set -euo pipefail
out=${1:-bench-out}
common=(--methods ar,sd,dsl,specexec,hf-assisted --sd-budgets 2,3,4,6,8 --dsl-budgets auto
  --budgets 8,16,32,auto --warmup-tokens 8 --repeats 2 --no-progress)
for temp in 0 0.6; do
  sampling=(--temperature "$temp")
  [ "$temp" = 0 ] || sampling+=(--top-p 0.9)
  name=$([ "$temp" = 0 ] && echo greedy || echo "t$temp")
  specexec calibrate
  specexec bench --prompts mtbench --n-prompts 3 --max-new-tokens 48 "${common[@]}" "${sampling[@]}" \
    --out "$out/dynamic-mtbench-$name"
  specexec calibrate
  specexec bench --prompts humaneval --n-prompts 4 --max-new-tokens 64 "${common[@]}" "${sampling[@]}" \
    --out "$out/dynamic-humaneval-$name"
done
