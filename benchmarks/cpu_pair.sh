#!/usr/bin/env bash
# The first CPU benchmark (docs/benchmarks-history.md, 2026-11-29): the real pair (Qwen2.5-Coder 0.5B drafting
# for 1.5B), bfloat16, run one after another on an otherwise idle machine. Writes
# bench-out/<name>/{results.json,results.md,...}.
set -euo pipefail
out=${1:-bench-out}
specexec calibrate
specexec bench --prompts humaneval --n-prompts 4 --max-new-tokens 64 --warmup-tokens 8 --no-progress \
  --out "$out/humaneval-greedy" --methods ar,sd,dsl,specinfer,specexec,hf-assisted,hf-lookup \
  --sd-budgets 2,3,4,6,8 --specinfer-budgets 64,256 --budgets 16,64,256,512,auto
small=(--n-prompts 3 --max-new-tokens 48 --warmup-tokens 8 --no-progress)
specexec bench --prompts mtbench "${small[@]}" --out "$out/mtbench-greedy" \
  --methods ar,sd,dsl,specinfer,specexec,hf-assisted --sd-budgets 3,6 --specinfer-budgets 64 --budgets 16,64,auto
for set in humaneval mtbench; do
  specexec bench --prompts "$set" "${small[@]}" --out "$out/$set-t0.6" --temperature 0.6 --top-p 0.9 \
    --methods ar,sd,dsl,specinfer,specexec,hf-assisted --sd-budgets 4 --specinfer-budgets 64 --budgets 16,64,auto
done
