"""llama-cpp-python's low-level API, loaded once with its log quieted; the backend's error and limits."""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

import torch

from specexec.backends.base import BackendError

MAX_SEQUENCES = 256  # llama.cpp's LLAMA_MAX_SEQ: sequence 0 is the committed one, the rest leaves
CPU = torch.device("cpu")
INSTALL_HINT = "pip install 'specexec[llamacpp]' (pip builds llama.cpp from source, about 10 minutes)"


def rebuild_command() -> str:
    """The command that rebuilds the installed llama-cpp-python as the README's install builds it: with
    llama.cpp's RPC backend and llama_cpp_build.cmake's fixes (the installed version, from source)."""
    import llama_cpp

    include = Path(__file__).with_name("llama_cpp_build.cmake")
    return (
        f'CMAKE_ARGS="-DGGML_RPC=ON -DCMAKE_PROJECT_INCLUDE={include}" python -m pip install '
        f"--force-reinstall --no-cache-dir --no-deps llama-cpp-python=={llama_cpp.__version__}"
    )


class LlamaCppError(BackendError, RuntimeError):
    """The llama.cpp backend cannot run this request; the message says why."""


def llama_cpp_library():
    """The `llama_cpp` module, its backend initialised and its log routed to stderr for errors only."""
    try:
        import llama_cpp
    except ImportError:
        raise LlamaCppError(f"the llama.cpp backend needs llama-cpp-python: {INSTALL_HINT}") from None
    _quiet(llama_cpp)
    return llama_cpp


# Whether this process made a llama.cpp context yet, which any pass needs (`batch_invariant_kernels` must
# come before the first).
_contexts_made = False
# ggml's tiled K-quant matmul (from 8 rows up) sums a dot product in another order than one row's
# vec_dot; ggml reads this switch once, at the first matmul that could take it.
TILED_MATMUL_SWITCH = "GGML_CPU_TILED_MM"


def note_context() -> None:
    global _contexts_made
    _contexts_made = True


def batch_invariant_kernels() -> None:
    """Keep ggml's matmuls off kernels whose result for one row depends on the other rows of the block,
    process-wide: its tiled K-quant matmul off (repacked weights and flash attention's tiling are a
    model's and a context's own: `weights.load_weights`, the runner's context). Raises where a context
    was made with it on: a pass may have run, and ggml read the switch."""
    if os.environ.get(TILED_MATMUL_SWITCH) == "0":
        return
    if _contexts_made:
        raise LlamaCppError(
            "--batch-invariant must be chosen before this process's first llama.cpp context (or set "
            f"{TILED_MATMUL_SWITCH}=0 in the environment)"
        )
    os.environ[TILED_MATMUL_SWITCH] = "0"


def ggml_library(name: str) -> ctypes.CDLL | None:
    """The library `name` ("libggml-base", "libggml", "libggml-cpu", "libggml-rpc") as libllama loaded it,
    None where it is not loaded. llama-cpp-python's wheel holds each library as copies, not links
    (libggml.so, libggml.so.0, ...): opening another copy than libllama's would load a second instance
    of ggml, with state of its own (its backends, its abort callback)."""
    llama_cpp = llama_cpp_library()
    folder = Path(llama_cpp.__file__).parent / "lib"
    try:
        mapped = {line.split(maxsplit=5)[-1] for line in Path("/proc/self/maps").read_text().splitlines()}
    except OSError:  # no /proc: the file the loader names by the library's major version
        candidates = [folder / f"{name}.so.0"]
    else:
        candidates = [Path(path) for path in mapped if path.startswith(f"{folder}/{name}.so")]
    found = [path for path in candidates if path.is_file()]
    return ctypes.CDLL(str(found[0])) if found else None


_TENSOR_NAME = None


def tensor_name(tensor: int) -> bytes:
    """A ggml tensor's name (`ggml_get_name`, from the ggml library llama-cpp-python ships)."""
    global _TENSOR_NAME
    if _TENSOR_NAME is None:
        ggml = ggml_library("libggml-base")
        ggml.ggml_get_name.restype = ctypes.c_char_p
        ggml.ggml_get_name.argtypes = (ctypes.c_void_p,)
        _TENSOR_NAME = ggml.ggml_get_name
    return _TENSOR_NAME(tensor)


_LOG_CALLBACK = None


def _quiet(llama_cpp) -> None:
    """Route llama.cpp's log to stderr for errors only (its default prints every loaded tensor)."""
    global _LOG_CALLBACK
    if _LOG_CALLBACK is None:

        @llama_cpp.llama_log_callback
        def errors_only(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
            # ggml-rpc's transport errors come before the abort that says them in one line (`rpc`)
            if level == 4 and not text.startswith((b"send failed", b"recv failed")):  # GGML_LOG_LEVEL_ERROR
                sys.stderr.write(text.decode("utf-8", "replace"))

        _LOG_CALLBACK = errors_only
        llama_cpp.llama_backend_init()
    llama_cpp.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))
