"""A draft that scores only its first N token ids on llama.cpp: a copy of its GGUF whose output layer holds
only the kept rows (`specexec.draft_vocab` says which ids and why), written once under the cache root.
llama.cpp then reads every input as an embedding the caller looks up in the full table, so the input ids
are not restricted."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from specexec.backends.llamacpp.library import LlamaCppError
from specexec.draft_vocab import kept_token_ids
from specexec.paths import cache_root

# What `--draft-vocab auto` keeps for a llama.cpp draft: the packaged 0.5B draft's head is 37% of the bytes
# a pass reads; its first 64,000 ids hold 98% of the tokens the target writes on HumanEval and MT-Bench,
# and on 2 cores this draft made `sd@3` and `specexec` auto 3-8% faster than the whole head and than
# 32,000 ids (docs/benchmarks.md, "A draft that scores fewer tokens"). Where drafting loses (chat text at
# T=0.6) the cheaper pass once made the policies draft more, until the speculation gate learnt to stop
# sooner ("When drafting loses", session 7).
DEFAULT_DRAFT_VOCAB = 64000


def write_reduced_head_gguf(source: Path, size: int, always: Iterable[int], dest: Path) -> None:
    """Write into the folder `dest` the GGUF `source` with a head of `kept_token_ids(size, ...)` only.

    `model.gguf` keeps every tensor but the output layer (the kept rows) and the token embedding (cut
    to the same rows: llama.cpp sizes both by its vocabulary, which becomes the kept tokens, renumbered
    0..n-1); `embedding.npy` holds the full token embedding as stored (quantized rows), for inputs fed as
    embeddings; `head.json` the kept ids, the full vocabulary and the embedding's GGML type.
    """
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(source)
    tensors = {t.name: t for t in reader.tensors}
    embedding = tensors["token_embd.weight"]
    vocab = int(embedding.shape[1])  # GGML order: (n_embd, n_vocab)
    kept = kept_token_ids(size, vocab, always)
    position = {token: i for i, token in enumerate(kept)}
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(dest / "model.gguf", arch)
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
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


def reduced_head(gguf: Path, size: int, always: Iterable[int]) -> Path:
    """The folder of `gguf` with a head of its first `size` ids and `always`, written the first time
    (`write_reduced_head_gguf`) under the cache root."""
    always = sorted(set(always))
    stat = gguf.stat()
    key = f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{size}:{always}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    folder = cache_root() / "draft-heads" / f"{gguf.stem}-{size}-{digest}"
    if not folder.is_dir():
        print(f"[writing {gguf.name} with a head of {size} token ids, once: {folder}]", file=sys.stderr)
        partial = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        try:
            write_reduced_head_gguf(gguf, size, always, partial)
            os.replace(partial, folder)
        except (KeyError, ValueError) as err:  # not a layout the copy knows (no token embedding, ...)
            raise LlamaCppError(f"cannot write {gguf.name} with a smaller head: {err!r}") from None
        except OSError:
            if not folder.is_dir():
                raise
        finally:  # another process wrote it first, or this one failed: nothing half-written stays
            shutil.rmtree(partial, ignore_errors=True)
    return folder
