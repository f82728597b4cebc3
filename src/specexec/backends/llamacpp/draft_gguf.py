"""A llama.cpp draft's own copy of its GGUF, written once under the cache root: a head of its first N token
ids, weights requantized by llama.cpp, or both. The draft's weights only move how often the target accepts
its tokens, never what the target emits.

- A head of N ids (`--draft-vocab`): the output layer holds only the kept rows (`specexec.draft_vocab`
  says which ids and why). llama.cpp then reads every input as an embedding the caller looks up in the
  full table, so the input ids are not restricted.
- Requantized (`--draft-quant q8_0|q4_0`): every weight matrix in that type, by llama.cpp's own quantizer
  (which keeps the output layer at Q8_0 or better under q4_0). Q4_0 is the type ggml repacks for its
  fastest CPU kernels on x86 and ARM, Q8_0 keeps an F16 draft's accuracy at half its bytes. Q4_0 is the
  default beside a target streamed from disk (STREAMED_DRAFT_QUANT, which says why); Q8_0 was no
  faster below 8 tokens a pass (docs/benchmarks-history.md, 2026-12-05, "A requantized draft").
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shutil
import sys
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from specexec.backends.gguf_files import shards, version
from specexec.backends.llamacpp.library import LlamaCppError, llama_cpp_library
from specexec.draft_vocab import kept_token_ids
from specexec.paths import cache_root

# What `--draft-vocab auto` keeps for a llama.cpp draft: the packaged 0.5B draft's head is 37% of the bytes a
# pass reads; its first 64,000 ids hold 98% of the tokens the target writes on HumanEval and MT-Bench, and on
# 2 cores this draft made `sd@3` and `specexec` auto 3-8% faster than the whole head and than 32,000 ids
# (docs/benchmarks-history.md, "A draft that scores fewer tokens"). Where drafting loses (chat text at T=0.6)
# the cheaper pass once made the policies draft more, until the speculation gate learnt to stop sooner
# (2026-12-02, "When drafting loses").
DEFAULT_DRAFT_VOCAB = 64000
# A draft's weights beside a target streamed from disk (`--ram`), unless --draft-quant or --quant says
# otherwise (`loading.draft_quant`). A streamed target's step spends a large share drafting, which the
# window's reads take back only in part; the packaged 0.5B draft in Q4_0 passes 1/4/16 tokens in
# 12/30/69 ms against 18/42/105 on 2 cores, and `specexec --budget auto` ran 7-17% faster with it at
# --ram 512MiB and 0-2% at --ram 0, paired per prompt (docs/benchmarks.md, "Bigger than RAM"). In RAM the
# target's passes are compute-bound and the default decodes plainly, so the draft stays as packaged.
STREAMED_DRAFT_QUANT = "q4_0"
COPY_FILE = "model.gguf"  # the copy's GGUF in its folder (the folder's name says what copy it is)
# llama.cpp's file type for each of base.GGUF_QUANTS.
FILE_TYPES = {"q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0"}


def write_reduced_head_gguf(source: Path, size: int, always: Iterable[int], dest: Path) -> None:
    """Write into the folder `dest` the GGUF `source` (every file of a split one) with a head of
    `kept_token_ids(size, ...)` only.

    `model.gguf`, one file, keeps every tensor but the output layer (the kept rows) and the token
    embedding (cut to the same rows: llama.cpp sizes both by its vocabulary, which becomes the kept
    tokens, renumbered 0..n-1); `embedding.npy` holds the full token embedding as stored (quantized
    rows), for inputs fed as embeddings; `head.json` the kept ids, the full vocabulary and the
    embedding's GGML type.
    """
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    readers = [GGUFReader(path) for path in shards(source)]
    reader = readers[0]  # the metadata
    tensors = {t.name: t for part in readers for t in part.tensors}
    embedding = tensors["token_embd.weight"]
    vocab = int(embedding.shape[1])  # GGML order: (n_embd, n_vocab)
    kept = kept_token_ids(size, vocab, always)
    position = {token: i for i, token in enumerate(kept)}
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(dest / COPY_FILE, arch)
    for name, f in reader.fields.items():
        if name.startswith(("GGUF.", "split.")) or name == "general.architecture":
            continue  # the writer's own, or a split GGUF's (the copy is one file)
        value, kind = f.contents(), f.types[0]
        if name == f"{arch}.vocab_size":
            value = len(kept)
        elif name.startswith("tokenizer.ggml.") and name.endswith("_token_id"):
            if value not in position:
                continue  # a special id outside the head: the reduced vocabulary has no such token
            value = position[value]
        elif kind == GGUFValueType.ARRAY and name != "tokenizer.ggml.merges" and len(value) == vocab:
            value = [value[i] for i in kept]  # tokens, their types and scores
        writer.add_key_value(name, value, kind, sub_type=f.types[-1] if kind == GGUFValueType.ARRAY else None)
    for name, t in tensors.items():
        data = t.data
        if name == "token_embd.weight" or (name == "output.weight" and t.shape[1] == vocab):
            data = data[kept]  # rows are tokens, in every storage type
        writer.add_tensor(name, np.ascontiguousarray(data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    np.save(dest / "embedding.npy", np.asarray(embedding.data))
    head = {"kept": kept, "vocab": vocab, "embedding_type": int(embedding.tensor_type)}
    (dest / "head.json").write_text(json.dumps(head))


def write_requantized_gguf(source: Path, quant: str, dest: Path, threads: int) -> None:
    """Write `source` with its weights requantized to `quant` (one of FILE_TYPES) by llama.cpp's own
    quantizer to the file `dest`."""
    llama_cpp = llama_cpp_library()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, FILE_TYPES[quant])
    params.allow_requantize = True  # the source's weights are quantized already
    params.nthread = threads
    if llama_cpp.llama_model_quantize(str(source).encode(), str(dest).encode(), ctypes.byref(params)) != 0:
        raise LlamaCppError(f"llama.cpp cannot requantize {source.name} to {quant.upper()}")


def derived_draft(gguf: Path, vocab: int, always: Iterable[int], quant: str, threads: int) -> Path:
    """The GGUF of `gguf`'s copy with a head of its first `vocab` ids and `always` (0: every id; its
    folder then has no head.json) and its weights in `quant` ("none": as they are), written the first
    time under the cache root; `gguf` itself where neither asks for a copy."""
    if not vocab and quant == "none":
        return gguf
    always = sorted(set(always))
    key = f"{gguf.resolve()}:{version(gguf)}:{vocab}:{always}:{quant}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    folder = cache_root() / "drafts" / f"{gguf.stem}-{vocab}-{quant}-{digest}"
    if folder.is_dir():
        return folder / COPY_FILE
    what = [f"a head of {vocab} token ids"] if vocab else []
    what += [f"{quant.upper()} weights"] if quant != "none" else []
    print(f"[writing {gguf.name} with {' and '.join(what)}, once: {folder}]", file=sys.stderr)
    partial = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        source = gguf
        if vocab:
            try:
                write_reduced_head_gguf(gguf, vocab, always, partial)
            except (KeyError, ValueError) as err:  # not a layout the copy knows (no token embedding, ...)
                raise LlamaCppError(f"cannot write {gguf.name} with a smaller head: {err!r}") from None
            source = partial / COPY_FILE
        if quant != "none":
            write_requantized_gguf(source, quant, partial / "requantized.gguf", threads)
            os.replace(partial / "requantized.gguf", partial / COPY_FILE)
        os.replace(partial, folder)
    except OSError:
        if not folder.is_dir():
            raise
    finally:  # another process wrote it first, or this one failed: nothing half-written stays
        shutil.rmtree(partial, ignore_errors=True)
    return folder / COPY_FILE
