"""Tiny random GGUF models for the llama.cpp backend's tests, written with the `gguf` package.

Llama and Qwen2 architectures (Qwen2 adds q/k/v biases), weights in float32 or Q8_0, no tokenizer
(llama.cpp's "no_vocab" type with `vocab_size` dummy tokens: the tests work on token ids). Weights are
drawn with a large scale so next-token distributions are peaked and greedy decoding has clear margins.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

VOCAB = 128
HIDDEN = 64
FFN = 128
HEADS = 4
KV_HEADS = 2
LAYERS = 2
CONTEXT = 1024
Q8_0 = GGMLQuantizationType.Q8_0


def write_random_gguf(
    path: Path,
    arch: str = "llama",
    weights: str = "f32",
    seed: int = 0,
    noise: float = 0.0,
    logit_scale: float = 1.0,
    vocab: int = VOCAB,
    hidden: int = HIDDEN,
    ffn: int = FFN,
    layers: int = LAYERS,
    split_max_tensors: int = 0,
    metadata_first: bool = False,
) -> Path:
    """Write a tiny `arch` ("llama" or "qwen2") GGUF with `weights` "f32" or "q8_0"; with
    `split_max_tensors`, as a split GGUF of files of at most that many tensors each (the path returned is
    its first, PATH's stem + "-00001-of-0000N.gguf"), with `metadata_first` a first file of metadata only
    (`llama-gguf-split --no-tensor-first-split`).

    `noise` > 0 perturbs every weight of the `seed` model by that relative amount: a draft close to,
    but not equal to, the target written with the same seed. `logit_scale` scales the output matrix:
    below 1, spread-out next-token distributions (for sampling tests). The sizes default to the module's.
    """
    rng = np.random.default_rng(seed)
    noise_rng = np.random.default_rng(seed + 1000)
    head_dim = hidden // HEADS

    def tensor(*shape: int, scale: float) -> np.ndarray:
        data = rng.standard_normal(shape).astype(np.float32) * scale
        if noise:
            data += noise * np.abs(data).mean() * noise_rng.standard_normal(shape).astype(np.float32)
        return data

    writer = GGUFWriter(
        str(path), arch, split_max_tensors=split_max_tensors, small_first_shard=metadata_first
    )
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("no_vocab")
    writer.add_file_type(0 if weights == "f32" else 7)  # ALL_F32 / MOSTLY_Q8_0

    def add(name: str, data: np.ndarray, matrix: bool = True) -> None:
        if matrix and weights == "q8_0":
            writer.add_tensor(name, quantize(data, Q8_0), raw_dtype=Q8_0)  # shape read from the bytes
        else:
            writer.add_tensor(name, data)

    # Scales tuned for peaked distributions (greedy margins well above llama.cpp's batch-shape noise).
    add("token_embd.weight", tensor(vocab, hidden, scale=1.0))
    for i in range(layers):
        add(f"blk.{i}.attn_norm.weight", np.ones(hidden, dtype=np.float32), matrix=False)
        add(f"blk.{i}.attn_q.weight", tensor(HEADS * head_dim, hidden, scale=0.3))
        add(f"blk.{i}.attn_k.weight", tensor(KV_HEADS * head_dim, hidden, scale=0.3))
        add(f"blk.{i}.attn_v.weight", tensor(KV_HEADS * head_dim, hidden, scale=0.3))
        if arch == "qwen2":
            add(f"blk.{i}.attn_q.bias", tensor(HEADS * head_dim, scale=0.3), matrix=False)
            add(f"blk.{i}.attn_k.bias", tensor(KV_HEADS * head_dim, scale=0.3), matrix=False)
            add(f"blk.{i}.attn_v.bias", tensor(KV_HEADS * head_dim, scale=0.3), matrix=False)
        add(f"blk.{i}.attn_output.weight", tensor(hidden, HEADS * head_dim, scale=0.3))
        add(f"blk.{i}.ffn_norm.weight", np.ones(hidden, dtype=np.float32), matrix=False)
        add(f"blk.{i}.ffn_gate.weight", tensor(ffn, hidden, scale=0.3))
        add(f"blk.{i}.ffn_up.weight", tensor(ffn, hidden, scale=0.3))
        add(f"blk.{i}.ffn_down.weight", tensor(hidden, ffn, scale=0.3))
    add("output_norm.weight", np.ones(hidden, dtype=np.float32), matrix=False)
    add("output.weight", tensor(vocab, hidden, scale=logit_scale))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    shards = sorted(path.parent.glob(f"{path.stem}-*-of-*.gguf"))
    return shards[0] if split_max_tensors and shards else path


def on_storage(path: Path) -> bool:
    """Whether `path` is on a file system whose pages can be evicted and read again (not tmpfs): what
    streaming a GGUF from disk (`--ram`) needs."""
    best, kind = "", ""
    with open("/proc/mounts") as mounts:
        for line in mounts:
            point, fs = line.split()[1:3]
            if str(path.resolve()).startswith(point) and len(point) > len(best):
                best, kind = point, fs
    return kind not in ("tmpfs", "ramfs")


def synced(path: Path) -> Path:
    """`path` written through to storage: dirty pages cannot be evicted, and streaming tests need them to."""
    with open(path, "rb+") as f:
        os.fsync(f.fileno())
    return path
