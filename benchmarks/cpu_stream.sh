#!/usr/bin/env bash
# Issue 31's benchmark (docs/benchmarks.md, "Bigger than RAM"): the real pair's Q4_K_M GGUFs on llama.cpp,
# the target streamed from disk with --ram 0 (all of it) and --ram 512MiB (about half), 2 threads. Every
# llama.cpp method in the same mode: our ar, dsl and specexec (auto and fixed budgets, drafting ahead off
# and on), plain llama.cpp short of memory (`llamacpp`: its mapping evicted before every pass) and
# llama.cpp's own speculative decoding with its target streamed as ours (`llamacpp-spec`). HumanEval and
# MT-Bench, greedy and T=0.6. Each mode starts from a fresh calibration in that mode.
set -euo pipefail
out=${1:-bench-out}
common=(--backend llamacpp --threads 2 --n-prompts 3 --max-new-tokens 64 --warmup-tokens 4 --no-progress)
for ram in 0 512MiB; do
  specexec calibrate --backend llamacpp --threads 2 --ram "$ram"
  specexec bench --prompts humaneval --ram "$ram" "${common[@]}" \
    --methods ar,llamacpp,llamacpp-spec,dsl,specexec --budgets auto,32,64 --draft-ahead off,on \
    --llamacpp-spec-budgets 3,8,16 --dsl-budgets auto --out "$out/stream-$ram-humaneval-greedy"
  specexec bench --prompts mtbench --ram "$ram" "${common[@]}" \
    --methods ar,llamacpp-spec,dsl,specexec --budgets auto --draft-ahead off,on \
    --llamacpp-spec-budgets 8,16 --dsl-budgets auto --out "$out/stream-$ram-mtbench-greedy"
done
for ram in 0 512MiB; do
  for prompts in humaneval mtbench; do
    specexec bench --prompts "$prompts" --ram "$ram" "${common[@]}" --temperature 0.6 --top-p 0.9 \
      --methods ar,llamacpp-spec,specexec --budgets auto --draft-ahead off,on --llamacpp-spec-budgets 8,16 \
      --out "$out/stream-$ram-$prompts-t0.6"
  done
done
