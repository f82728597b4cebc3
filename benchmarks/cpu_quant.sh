#!/usr/bin/env bash
# Issue 7's CPU benchmark (docs/benchmarks.md, "In RAM: the torch backend and quantized weights"): the real
# pair, bfloat16 and int4 in one run each, against llama.cpp decoding the same target GGUF, 2 threads, greedy;
# the draft scores the first 32,000 token ids only. Needs `pip install 'specexec[llamacpp]'` (see
# docs/benchmarks-history.md, 2026-11-29, for the build flags on AMX CPUs).
set -euo pipefail
out=${1:-bench-out}
common=(--quant none,int4,w4a8 --draft-vocab 32000 --methods ar,sd,dsl,specexec,llamacpp --sd-budgets 2
  --budgets auto --ngram 0,10 --warmup-tokens 8 --no-progress)
specexec bench --prompts humaneval --n-prompts 4 --max-new-tokens 64 "${common[@]}" --out "$out/quant-humaneval"
specexec bench --prompts mtbench --n-prompts 3 --max-new-tokens 48 "${common[@]}" --out "$out/quant-mtbench"
python benchmarks/quant_accuracy.py --prompts 4 --json "$out/quant-accuracy.json"
