#!/usr/bin/env bash
# Issue 31's steadier comparisons (docs/benchmarks.md, "Bigger than RAM"): 8 prompts instead of
# cpu_stream.sh's 3, `ar`, llama.cpp's own speculation at its best length and `specexec --budget auto`,
# the 1.5B target streamed from disk. Sampled outputs differ from method to method, so over 3 prompts the
# texts themselves move the ratios; 8 prompts move them less. Uses the calibration cached per mode
# (`specexec calibrate --backend llamacpp --threads 2 --ram RAM` first on a new machine). At 512MiB every run
# also has plain `llamacpp` short of memory (the whole file evicted before each of its passes).
set -euo pipefail
out=${1:-bench-out}
common=(--backend llamacpp --threads 2 --n-prompts 8 --max-new-tokens 64 --warmup-tokens 4 --no-progress
  --methods ar,llamacpp-spec,specexec --budgets auto --draft-ahead off)
specexec bench --prompts humaneval --ram 0 "${common[@]}" --llamacpp-spec-budgets 16 \
  --out "$out/stream-0-humaneval-greedy-8"
specexec bench --prompts mtbench --ram 0 "${common[@]}" --llamacpp-spec-budgets 8 \
  --out "$out/stream-0-mtbench-greedy-8"
specexec bench --prompts humaneval --ram 512MiB "${common[@]}" --methods ar,llamacpp,llamacpp-spec,specexec \
  --llamacpp-spec-budgets 8 --out "$out/stream-512MiB-humaneval-greedy-8"
specexec bench --prompts mtbench --ram 512MiB "${common[@]}" --methods ar,llamacpp,llamacpp-spec,specexec \
  --llamacpp-spec-budgets 8 --out "$out/stream-512MiB-mtbench-greedy-8"
sampled=(--temperature 0.6 --top-p 0.9)
specexec bench --prompts humaneval --ram 0 "${common[@]}" "${sampled[@]}" --llamacpp-spec-budgets 16 \
  --out "$out/stream-0-humaneval-t0.6-8"
specexec bench --prompts mtbench --ram 0 "${common[@]}" "${sampled[@]}" --llamacpp-spec-budgets 8 \
  --out "$out/stream-0-mtbench-t0.6-8"
specexec bench --prompts humaneval --ram 512MiB "${common[@]}" "${sampled[@]}" \
  --methods ar,llamacpp,llamacpp-spec,specexec --llamacpp-spec-budgets 8 --out "$out/stream-512MiB-humaneval-t0.6-8"
specexec bench --prompts mtbench --ram 512MiB "${common[@]}" "${sampled[@]}" \
  --methods ar,llamacpp,llamacpp-spec,specexec --llamacpp-spec-budgets 8 --out "$out/stream-512MiB-mtbench-t0.6-8"
# The auto budget against fixed ones, in two modes.
specexec bench --prompts humaneval --ram 0 "${common[@]}" "${sampled[@]}" --methods specexec \
  --budgets auto,8,16,32 --out "$out/budgets-0-humaneval-t0.6-8"
specexec bench --prompts mtbench --ram 512MiB "${common[@]}" --methods specexec --budgets auto,8,16,32 \
  --out "$out/budgets-512MiB-mtbench-greedy-8"
