"""Where a token's result depends on the block it is decoded in: the first tensor whose row for that token
differs, decoded alone against inside a block of k rows, on a GGUF target (default: the packaged 1.5B).

Both runs prefill the same prompt minus its last token in one batch, then decode that last token alone, or
it and k - 1 more in one block, every row's logits kept. llama.cpp's eval callback copies every float32
tensor's first row; the rows are compared in graph order. The attention scores (`kq-N`) are left out:
their row spans every cache cell, the block's own later tokens included, which the mask removes after.

    python benchmarks/batch_invariance.py --blocks 2,4,8,16 [--repack on|off] [--flash-attn on|off]
        [--kv f16|f32|bf16|q8_0] [--prefix 600] [--threads 2] [--gguf FILE]

`--prefix N` prefills N tokens (the prompt repeated) before the decoded block: ggml's flash attention
splits one query row's cache cells across threads from 512 cells up.

The environment reaches ggml: GGML_CPU_TILED_MM=0 turns its tiled K-quant matmul off (taken from 8 rows
up). Prints, per block size, the first differing tensors (name, op, largest difference) or "identical".
"""

from __future__ import annotations

import argparse
import ctypes

import numpy as np

from specexec.backends.llamacpp.library import llama_cpp_library
from specexec.models import DEFAULT_TARGET, gguf_file, load_tokenizer

PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
KV_TYPES = {"f32": 0, "f16": 1, "q8_0": 8, "bf16": 30}  # ggml_type ids
GGML_TYPE_F32 = KV_TYPES["f32"]


class Tensor(ctypes.Structure):
    """The head of ggml's `struct ggml_tensor` (ggml.h), up to its name."""

    _fields_ = [
        ("type", ctypes.c_int32), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int32), ("op_params", ctypes.c_int32 * 16),
        ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64),
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", default=None, help="default: the packaged 1.5B target")
    parser.add_argument("--blocks", default="2,4,8,16")
    parser.add_argument("--repack", choices=("on", "off"), default="on")
    parser.add_argument("--flash-attn", choices=("on", "off"), default="off")
    parser.add_argument("--kv", choices=tuple(KV_TYPES), default="f16")
    parser.add_argument("--prefix", type=int, default=0, help="tokens before the block (default: the prompt)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    llama_cpp = llama_cpp_library()
    gguf = args.gguf or str(gguf_file(DEFAULT_TARGET))
    params = llama_cpp.llama_model_default_params()
    params.use_extra_bufts = args.repack == "on"
    model = llama_cpp.llama_model_load_from_file(gguf.encode(), params)
    prompt = load_tokenizer(args.gguf or DEFAULT_TARGET)(PROMPT)["input_ids"]
    if args.prefix:
        prompt = (prompt * (args.prefix // len(prompt) + 2))[: args.prefix + 1]
    rows: list[tuple[str, int, np.ndarray]] = []

    @ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_bool, ctypes.c_void_p)
    def first_rows(address, ask, _):
        tensor = Tensor.from_address(address)
        if not ask and tensor.type == GGML_TYPE_F32 and tensor.data:
            row = (ctypes.c_float * tensor.ne[0]).from_address(tensor.data)
            rows.append((tensor.name.decode(), tensor.op, np.ctypeslib.as_array(row).copy()))
        return True

    def decode(tokens: list[int]) -> list[tuple[str, int, np.ndarray]]:
        context_params = llama_cpp.llama_context_default_params()
        context_params.n_ctx = context_params.n_batch = max(512, len(prompt) + 256)
        context_params.n_threads = context_params.n_threads_batch = args.threads
        context_params.cb_eval = first_rows
        context_params.flash_attn_type = (
            llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if args.flash_attn == "on"
            else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )  # fmt: skip
        context_params.type_k = context_params.type_v = KV_TYPES[args.kv]
        context = llama_cpp.llama_init_from_model(model, context_params)
        prefix = (llama_cpp.llama_token * (len(prompt) - 1))(*prompt[:-1])
        assert llama_cpp.llama_decode(context, llama_cpp.llama_batch_get_one(prefix, len(prompt) - 1)) == 0
        rows.clear()
        batch = llama_cpp.llama_batch_init(len(tokens), 0, 1)
        for i, token in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = (
                token,
                len(prompt) - 1 + i,
                1,
                1,
            )
            batch.seq_id[i][0] = 0
        batch.n_tokens = len(tokens)
        assert llama_cpp.llama_decode(context, batch) == 0
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(context)
        return list(rows)

    block = [prompt[-1], *prompt[: max(map(int, args.blocks.split(","))) - 1]]  # any tokens after it
    alone = decode(block[:1])
    settings = (
        f"repack {args.repack}, flash-attn {args.flash_attn}, KV {args.kv}, prefix {len(prompt) - 1}, "
        f"threads {args.threads}"
    )
    print(f"{gguf}: {settings}")
    for k in map(int, args.blocks.split(",")):
        found = []
        for (name, op, a), (name_b, _, b) in zip(alone, decode(block[:k]), strict=False):
            if name != name_b:
                found.append(f"graphs differ at {name} / {name_b}")
                break
            if a.shape == b.shape and not name.startswith(("kq-", "cache_")) and not np.array_equal(a, b):
                found.append(f"{name} (op {op}) max |diff| {float(np.abs(a - b).max()):.3g}")
        print(f"k={k}: " + ("; ".join(found[:3]) if found else "identical"))


if __name__ == "__main__":
    main()
