"""What llama.cpp's kernel choices cost the packaged 1.5B target: t(k), the milliseconds of one pass over k
tokens after a 256-token context (the median of 5), and a 2,048-token prefill in the engine's chunks.

The kernel choices are the build's (llamafile's sgemm: `LLAMAFILE = 1` in the system line printed), the
extra buffer types (`--repack on|off`) and ggml's tiled K-quant matmul (the environment's
GGML_CPU_TILED_MM=0 turns it off). docs/design.md, "What is identical, per backend", says which of them
make a row's result depend on its block.

    python benchmarks/kernel_costs.py --repack on --threads 2
    GGML_CPU_TILED_MM=0 python benchmarks/kernel_costs.py --repack off --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import llama_cpp
import torch

from specexec.backends.base import PREFILL_CHUNK
from specexec.backends.llamacpp import weights
from specexec.backends.llamacpp.model import LlamaCppModel
from specexec.models import DEFAULT_TARGET, gguf_file

BLOCKS = (1, 2, 4, 8, 16, 32, 64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repack", choices=("on", "off"), default="on")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefill", type=int, default=2048, help="prompt tokens (0: no prefill timing)")
    args = parser.parse_args()
    if args.repack == "off":  # no option asks for it: the model loads as where the extra buffers fail
        weights.extra_buffers_usable = lambda: False
    model = LlamaCppModel(gguf_file(DEFAULT_TARGET), threads=args.threads)
    print(llama_cpp.llama_print_system_info().decode().strip(), f"| extra buffers {model.extra_buffers}")
    generator = torch.Generator().manual_seed(0)
    runner = model.make_runner(512, trees=False)
    runner.extend(torch.randint(0, 1000, (256,), generator=generator))
    costs = []
    for k in BLOCKS:
        seconds = []
        for _ in range(5):
            runner.keep(torch.arange(256))
            tokens = torch.randint(0, 1000, (k,), generator=generator)
            start = time.perf_counter()
            runner.extend(tokens, logits_to_keep=k)
            seconds.append(time.perf_counter() - start)
        costs.append(f"t({k}) {statistics.median(seconds) * 1000:.1f}")
    print(" | ".join(costs), "ms")
    if args.prefill:
        runner = model.make_runner(args.prefill + 64, trees=False)
        prompt = torch.randint(0, 1000, (args.prefill,), generator=generator)
        start = time.perf_counter()
        for i in range(0, args.prefill, PREFILL_CHUNK):
            runner.extend(prompt[i : i + PREFILL_CHUNK])
        print(f"prefill of {args.prefill} tokens: {time.perf_counter() - start:.2f} s")


if __name__ == "__main__":
    main()
