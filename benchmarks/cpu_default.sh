#!/usr/bin/env bash
# Issue 17's goals for the default on the llama.cpp backend (docs/benchmarks.md, "In RAM: the llama.cpp
# backend"): `specexec` and `dsl` with budget auto next to `ar` and plain llama.cpp, greedy and T=0.6,
# MT-Bench and HumanEval, 2 threads, each run timed twice, the draft's whole head against the default
# (`--draft-vocab auto`: 64,000 ids on llama.cpp). Then what would make verification cheap on this CPU: the
# target's forward costs in several GGUF weight types, and the w4a8 kernel of the torch backend against plain
# llama.cpp on the same prompts; last, tokens per target call of specexec@64 on both backends.
set -euo pipefail
out=${1:-bench-out}
for temp in 0 0.6; do
  sampling=(--temperature "$temp")
  [ "$temp" = 0 ] || sampling+=(--top-p 0.9)
  name=$([ "$temp" = 0 ] && echo greedy || echo "t$temp")
  for prompts in mtbench humaneval; do
    specexec bench --prompts "$prompts" --n-prompts 4 --max-new-tokens 64 --backend llamacpp --threads 2 \
      --methods ar,llamacpp,specexec,dsl --budgets auto --dsl-budgets auto "${sampling[@]}" \
      --draft-vocab 0,auto --warmup-tokens 8 --repeats 2 --no-progress --out "$out/default-$prompts-$name"
  done
done
python benchmarks/gguf_costs.py --threads 2 | tee "$out/gguf-costs.md"
specexec calibrate --backend torch --quant w4a8 --draft-vocab 32000 --threads 2
specexec bench --backend torch --quant w4a8 --draft-vocab 32000 --threads 2 --prompts humaneval \
  --n-prompts 4 --max-new-tokens 64 --methods ar,llamacpp,specexec --budgets 4,8,16,auto \
  --warmup-tokens 8 --repeats 2 --no-progress --out "$out/w4a8-humaneval"
# Tokens per target call of the same algorithm on both backends (greedy HumanEval, specexec@64).
for backend in llamacpp torch; do
  specexec bench --backend "$backend" --threads 2 --prompts humaneval --n-prompts 4 --max-new-tokens 64 \
    --methods specexec --budgets 64 --draft-vocab 0 --warmup-tokens 0 --no-progress \
    --out "$out/budget64-$backend"
done
# The pair requantized to IQ4_NL, the weight type with the flattest batched forward here (gguf-costs.md):
# speculation against plain llama.cpp on that same target GGUF.
target=$(python benchmarks/gguf_costs.py --model qwen2.5-coder-1.5b --types IQ4_NL --paths)
draft=$(python benchmarks/gguf_costs.py --model qwen2.5-coder-0.5b --types IQ4_NL --paths)
for vocab in 0 auto; do
  specexec calibrate --target "$target" --draft "$draft" --backend llamacpp --threads 2 --draft-vocab "$vocab"
done
for run in "humaneval 0" "humaneval 0.6" "mtbench 0"; do
  read -r prompts temp <<<"$run"
  sampling=(--temperature "$temp")
  [ "$temp" = 0 ] || sampling+=(--top-p 0.9)
  specexec bench --target "$target" --draft "$draft" --backend llamacpp --threads 2 --prompts "$prompts" \
    --n-prompts 4 --max-new-tokens 64 --methods llamacpp,llamacpp-spec,sd,dsl,specexec \
    --llamacpp-spec-budgets 3 --sd-budgets 3 --dsl-budgets auto --budgets auto --draft-vocab 0,auto \
    --warmup-tokens 8 --repeats 2 --no-progress "${sampling[@]}" --out "$out/iq4nl-$prompts-t$temp"
done
