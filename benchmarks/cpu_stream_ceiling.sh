#!/usr/bin/env bash
# Issue 31's unmet goals against the pair's ceiling (docs/benchmarks.md, "Bigger than RAM"):
# the configurations where specexec stayed under 3x `ar` or 1.3x llama.cpp's speculation, with fixed
# budgets up to 64 beside `--budget auto`. Each row's target-bound tok/s (new tokens / seconds in the
# target's forwards) is what its trees would give were drafting free. Same 8 prompts and settings as
# cpu_stream_8prompts.sh; uses the calibration cached per mode.
set -euo pipefail
out=${1:-bench-out}
common=(--backend llamacpp --threads 2 --n-prompts 8 --max-new-tokens 64 --warmup-tokens 4 --no-progress
  --methods ar,llamacpp-spec,specexec --draft-ahead off)
sampled=(--temperature 0.6 --top-p 0.9)
specexec bench --prompts mtbench --ram 512MiB "${common[@]}" --budgets auto,8,16,32,64 \
  --llamacpp-spec-budgets 8 --out "$out/ceiling-512MiB-mtbench-greedy-8"
specexec bench --prompts mtbench --ram 512MiB "${common[@]}" "${sampled[@]}" --budgets auto,8,16,32,64 \
  --llamacpp-spec-budgets 8 --out "$out/ceiling-512MiB-mtbench-t0.6-8"
specexec bench --prompts mtbench --ram 0 "${common[@]}" "${sampled[@]}" --budgets auto,8,16,32,64 \
  --llamacpp-spec-budgets 8 --out "$out/ceiling-0-mtbench-t0.6-8"
specexec bench --prompts humaneval --ram 0 "${common[@]}" "${sampled[@]}" --budgets auto,16,32,64 \
  --llamacpp-spec-budgets 16 --out "$out/ceiling-0-humaneval-t0.6-8"
