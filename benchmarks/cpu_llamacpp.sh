#!/usr/bin/env bash
# Issue 17's CPU benchmark (docs/benchmarks.md, "In RAM: the llama.cpp backend"): the real pair's Q4_K_M GGUFs
# run by llama.cpp, every method of ours on the llama.cpp backend next to plain llama.cpp (`llamacpp`) and
# llama.cpp's own speculative decoding (`llamacpp-spec`), HumanEval and MT-Bench, greedy and T=0.6, 2 threads.
# Each column starts from a fresh calibration and times every run twice, the order reversed the second time
# (--repeats 2). Then specexec@64 on the torch backend, greedy HumanEval, for tokens per target call of the
# same algorithm with the other kernels.
set -euo pipefail
out=${1:-bench-out}
common=(--backend llamacpp --threads 2 --methods ar,llamacpp,llamacpp-spec,sd,dsl,specexec
  --llamacpp-spec-budgets 3,8 --sd-budgets 2,3 --dsl-budgets auto --budgets 8,16,64,auto
  --warmup-tokens 8 --repeats 2 --no-progress)
for temp in 0 0.6; do
  sampling=(--temperature "$temp")
  [ "$temp" = 0 ] || sampling+=(--top-p 0.9)
  name=$([ "$temp" = 0 ] && echo greedy || echo "t$temp")
  for prompts in humaneval mtbench; do
    specexec calibrate --backend llamacpp --threads 2
    specexec bench --prompts "$prompts" --n-prompts 4 --max-new-tokens 64 "${common[@]}" "${sampling[@]}" \
      --out "$out/llamacpp-$prompts-$name"
  done
done
specexec bench --backend torch --threads 2 --methods ar,specexec --budgets 64 --prompts humaneval \
  --n-prompts 4 --max-new-tokens 64 --warmup-tokens 0 --no-progress --out "$out/torch-humaneval-greedy"
