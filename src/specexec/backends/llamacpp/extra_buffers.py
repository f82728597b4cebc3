"""Whether llama.cpp's extra buffer types (AMX tiles, repacked weights) run on this CPU with this build.

llama.cpp built by GCC 12 for an Intel CPU with AMX dies of SIGILL on its first multi-row AMX multiply
(llama_cpp_build.cmake says why and is the fix). A user's own build must not kill the process, so once per
library build and CPU a child process loads a tiny Q8_0 model with llama.cpp's defaults (extra buffer
types on) and decodes a block of tokens. The answer is cached under the cache root, keyed on the bytes
of llama-cpp-python's libraries and the CPU's identity and flags. Where the child fails, every model
loads with the extra buffer types off (`use_extra_bufts = False`: ggml's plain kernels for the same
model, slower batched passes) and one line says so and how to rebuild.

Run as `python -m specexec.backends.llamacpp.extra_buffers GGUF`, this module is that child.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specexec.paths import cache_root

CACHE_FILE = "llamacpp-extra-buffers.json"
BLOCK = 16  # tokens decoded at once by the child: more than one row takes ggml's AMX tile path
WIDTH = 256  # the tiny model's sizes: multiples of what AMX and repacking need (32 rows, 256 columns)
CHILD_TIMEOUT = 300.0


@dataclass(frozen=True)
class Verdict:
    """The child's answer for one library build and CPU: `usable`, else `reason` says how it failed."""

    usable: bool
    reason: str = ""


@functools.cache
def extra_buffers_usable() -> bool:
    """Whether models may load with llama.cpp's extra buffer types on (asked once per build and CPU, then
    cached; the first answer of this process is kept). Where not, a line on stderr says so once."""
    from specexec.backends.llamacpp.library import rebuild_command

    verdict = cached_verdict(library_build(), cpu_key(), probe)
    if not verdict.usable:
        print(
            f"specexec: llama.cpp's AMX and repacked kernels fail on this CPU with this build "
            f"({verdict.reason}); models load without them (slower verification). Rebuild: "
            f"{rebuild_command()}",
            file=sys.stderr,
        )
    return verdict.usable


def kernels(extra_buffers: bool) -> dict:
    """What a record says of llama.cpp's kernels for a model loaded with extra buffer types on or off:
    that, and whether it means AMX tiles."""
    return {"extra_buffers": extra_buffers, "amx": extra_buffers and amx_in_build()}


def amx_in_build() -> bool:
    """Whether this llama.cpp was built with AMX kernels (ggml's system info: AMX_INT8 = 1)."""
    import llama_cpp

    return b"AMX_INT8 = 1" in llama_cpp.llama_print_system_info()


def cached_verdict(build: str, cpu: str, ask) -> Verdict:
    """The verdict cached for (`build`, `cpu`), or `ask()`'s, then cached."""
    path = cache_root() / CACHE_FILE
    key = f"{build}:{cpu}"
    try:
        answers = json.loads(path.read_text())
    except (OSError, ValueError):
        answers = {}
    if key in answers:
        return Verdict(**answers[key])
    verdict = ask()
    answers[key] = {"usable": verdict.usable, "reason": verdict.reason}
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}")
    partial.write_text(json.dumps(answers, indent=1))
    os.replace(partial, path)
    return verdict


@functools.cache
def library_build() -> str:
    """This process's llama-cpp-python build: a digest of its shared libraries (`build_key`)."""
    import llama_cpp

    return build_key(Path(llama_cpp.__file__).parent / "lib")


def build_key(library_folder: Path) -> str:
    """A digest of the shared libraries in `library_folder` (llama-cpp-python's lib/): a rebuild that
    changes any byte asks again."""
    digest = hashlib.sha256()
    for library in sorted(library_folder.iterdir()):
        if library.is_file():
            digest.update(library.name.encode())
            digest.update(library.read_bytes())
    return digest.hexdigest()[:16]


def cpu_key() -> str:
    """The CPU's vendor, family, model, stepping and flags, as /proc/cpuinfo gives its first CPU (the
    platform's processor string elsewhere)."""
    wanted = ("vendor_id", "cpu family", "model", "stepping", "flags", "CPU implementer", "CPU part")
    try:
        first = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
        fields = [line for line in first.splitlines() if line.split(":")[0].strip() in wanted]
    except OSError:
        fields = [platform.machine(), platform.processor()]
    return hashlib.sha256("\n".join(fields).encode()).hexdigest()[:16]


def probe(command: list[str] | None = None) -> Verdict:
    """Run the child (`command`, default this module on a tiny model written here) and read its end."""
    with tempfile.TemporaryDirectory(prefix="specexec-probe-") as folder:
        if command is None:
            gguf = write_probe_gguf(Path(folder) / "probe.gguf")
            command = [sys.executable, "-m", __name__, str(gguf)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=CHILD_TIMEOUT)
        except subprocess.TimeoutExpired:
            return Verdict(False, f"the check did not finish in {CHILD_TIMEOUT:.0f} s")
    if done.returncode == 0:
        return Verdict(True)
    if done.returncode < 0:
        return Verdict(False, f"the check died of {signal.Signals(-done.returncode).name}")
    last = (done.stderr.strip().splitlines() or [""])[-1]
    return Verdict(False, f"the check exited with status {done.returncode}: {last}".rstrip(": "))


def write_probe_gguf(path: Path) -> Path:
    """A one-layer llama model, Q8_0 matrices of AMX-eligible shapes, no tokenizer (token ids only)."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    rng = np.random.default_rng(0)
    heads, kv_heads = 4, 2
    head_dim = WIDTH // heads
    writer = GGUFWriter(str(path), "llama")
    writer.add_context_length(4 * BLOCK)
    writer.add_embedding_length(WIDTH)
    writer.add_block_count(1)
    writer.add_feed_forward_length(2 * WIDTH)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(WIDTH)
    writer.add_tokenizer_model("no_vocab")
    writer.add_file_type(7)  # MOSTLY_Q8_0
    matrices = {  # name: (rows, columns)
        "token_embd.weight": (WIDTH, WIDTH),
        "blk.0.attn_q.weight": (WIDTH, WIDTH),
        "blk.0.attn_k.weight": (kv_heads * head_dim, WIDTH),
        "blk.0.attn_v.weight": (kv_heads * head_dim, WIDTH),
        "blk.0.attn_output.weight": (WIDTH, WIDTH),
        "blk.0.ffn_gate.weight": (2 * WIDTH, WIDTH),
        "blk.0.ffn_up.weight": (2 * WIDTH, WIDTH),
        "blk.0.ffn_down.weight": (WIDTH, 2 * WIDTH),
        "output.weight": (WIDTH, WIDTH),
    }
    q8_0 = GGMLQuantizationType.Q8_0
    for name, shape in matrices.items():
        weights = rng.standard_normal(shape).astype(np.float32) * 0.1
        writer.add_tensor(name, quantize(weights, q8_0), raw_dtype=q8_0)
    for name in ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight"):
        writer.add_tensor(name, np.ones(WIDTH, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def decode_block(gguf: str) -> int:
    """The child: load `gguf` with llama.cpp's default model parameters and decode BLOCK tokens at once;
    0 when that worked (a fault kills the process before it returns)."""
    from specexec.backends.llamacpp.library import llama_cpp_library

    llama_cpp = llama_cpp_library()
    model = llama_cpp.llama_model_load_from_file(gguf.encode(), llama_cpp.llama_model_default_params())
    if not model:
        print(f"llama.cpp cannot load {gguf}", file=sys.stderr)
        return 3
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = params.n_batch = params.n_ubatch = 4 * BLOCK
    params.n_threads = params.n_threads_batch = 2  # ggml's threads each load the tile configuration
    context = llama_cpp.llama_init_from_model(model, params)
    tokens = (llama_cpp.llama_token * BLOCK)(*range(1, BLOCK + 1))
    status = llama_cpp.llama_decode(context, llama_cpp.llama_batch_get_one(tokens, BLOCK))
    if status != 0:
        print(f"llama_decode returned {status}", file=sys.stderr)
    llama_cpp.llama_free(context)
    llama_cpp.llama_model_free(model)
    return 4 if status else 0


if __name__ == "__main__":
    sys.exit(decode_block(sys.argv[1]))
