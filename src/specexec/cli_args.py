"""What every `specexec` command line shares: the parser whose errors take one line, exit statuses,
integer validators, the model and sampling options, and `pair_spec`, which turns the parsed model
options into the `PairSpec` that `specexec.loading.load_pair` loads.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from specexec.backends.options import LoadOptions
from specexec.loading import PairSpec
from specexec.sizes import SizeError, parse_size

EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

BACKENDS = ("auto", "torch", "llamacpp")


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line instead of usage + message
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")

    def parse_args(self, args=None, namespace=None):
        """Parsed options with their defaults resolved here, once: no deeper code sees None for
        "the default" (--threads: PyTorch's thread count)."""
        parsed = super().parse_args(args, namespace)
        if getattr(parsed, "threads", 0) is None:
            import torch

            parsed.threads = torch.get_num_threads()
        return parsed


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= `minimum`."""

    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = "int"  # argparse names the type in "invalid int value: 'x'"
    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def add_model_args(parser: argparse.ArgumentParser, quant_list: bool = False) -> None:
    """--target, --draft, --dtype, --quant and the offloading flags, shared by every command that loads
    models. With `quant_list`, --quant and --draft-vocab take comma-separated lists (the bench runs each
    level and each draft vocabulary)."""
    _add_source_args(parser)
    _add_quant_args(parser, quant_list)
    _add_offload_args(parser.add_argument_group("offloading (target only)"))
    parser.add_argument_group("streaming from disk (llama.cpp, target only)").add_argument(
        "--ram",
        type=ram_size,
        default=None,
        metavar="SIZE",
        help="RAM the target's weights may use, e.g. 512MiB: layers that fit stay resident, the rest is "
        "read from disk on every pass (0: stream all it can; auto: the memory available less the draft "
        "and 1 GiB). For a GGUF bigger than RAM, or to leave RAM to other programs",
    )
    parser.add_argument(
        "--batch-invariant",
        action="store_true",
        help="verify with kernels whose result for a token does not depend on the other tokens of the "
        "pass, so that greedy output is plain decoding's own, bit for bit (llama.cpp: repacked weights "
        "and ggml's tiled matmul off, flash attention over an 8-bit KV cache; slower, see docs/design.md)",
    )
    workers = parser.add_argument_group("layers on other machines (llama.cpp, target only)")
    workers.add_argument(
        "--rpc",
        type=rpc_endpoints,
        default=(),
        metavar="HOST:PORT[,...]",
        help="put the target's layers on these `specexec worker`s, in contiguous blocks, in order; its "
        "embedding and output head stay here, and so does the draft (docs/cluster.md)",
    )
    workers.add_argument(
        "--split",
        type=shares,
        default=None,
        metavar="W1,W2,...",
        help="the workers' shares of the layers, e.g. 3,1 (default: by each worker's free memory)",
    )
    parser.add_argument(
        "--mlock",
        action="store_true",
        help="lock the models' weights in RAM so that memory pressure cannot page them out (llama.cpp; "
        "not with --ram)",
    )


def _add_source_args(parser: argparse.ArgumentParser) -> None:
    from specexec.models import DEFAULT_DRAFT, DEFAULT_TARGET

    parser.add_argument(
        "--target",
        default=DEFAULT_TARGET,
        help=f"local HF folder, .gguf file, or a packaged model name (default {DEFAULT_TARGET})",
    )
    parser.add_argument(
        "--draft", default=DEFAULT_DRAFT, help=f"same kinds as --target (default {DEFAULT_DRAFT})"
    )
    parser.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        default=None,
        help="weights in memory (default: bfloat16 where the CPU/GPU computes it natively, else float32)",
    )
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default="auto",
        help="torch (Hugging Face models: fp32/bf16, --quant, offloading) or llamacpp (a GGUF run by "
        "llama.cpp's kernels, needs specexec[llamacpp]); auto: llamacpp for GGUF sources when it is "
        "installed and no torch-only option is given (default auto)",
    )
    parser.add_argument(
        "--draft-backend", choices=BACKENDS, default=None, help="the draft's backend (default: --backend)"
    )
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="CPU threads for both backends (default: PyTorch's default, the number of cores)",
    )


def _add_quant_args(parser: argparse.ArgumentParser, lists: bool) -> None:
    from specexec.backends.llamacpp.draft_gguf import DEFAULT_DRAFT_VOCAB
    from specexec.backends.options import GGUF_QUANTS, QUANT_MODES

    quant_help = (
        "CPU quantization of target and draft: int8 per channel or int4 per group of 64 (weight-only, "
        "PyTorch's kernels), or w4a8 (4-bit weights x 8-bit activations, a C kernel compiled on first "
        "use) (default none)"
    )
    if lists:
        parser.add_argument(
            "--quant",
            type=_quant_list,
            default=["none"],
            help=quant_help + "; a comma-separated list runs each",
        )
    else:
        parser.add_argument("--quant", choices=QUANT_MODES, default="none", help=quant_help)
    parser.add_argument(
        "--draft-quant",
        choices=QUANT_MODES + GGUF_QUANTS,
        default=None,
        help="the draft's quantization (default: --quant; q4_0 for a llama.cpp draft when --ram streams "
        "the target); on the llama.cpp backend q8_0 or q4_0 run a copy of the draft's GGUF requantized by "
        "llama.cpp (written once; the output is unchanged, the draft's acceptance may fall)",
    )
    vocab_help = (
        "the draft scores only the first N token ids and the special tokens: a cheaper draft pass; 0 = "
        f"all; auto: {DEFAULT_DRAFT_VOCAB} on the llama.cpp backend where the vocabulary is larger, "
        "else all (default auto)"
    )
    if lists:
        parser.add_argument(
            "--draft-vocab",
            type=_vocab_list,
            default=["auto"],
            metavar="N[,N...]",
            help=vocab_help + "; a comma-separated list runs the drafted methods with each",
        )
    else:
        parser.add_argument("--draft-vocab", type=_draft_vocab, default="auto", metavar="N", help=vocab_help)


def _add_offload_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--offload",
        action="store_true",
        help="stream the target's decoder layers from pinned host memory through a ring of GPU buffers "
        "(needs CUDA)",
    )
    group.add_argument("--ring-size", type=positive_int, default=2, help="GPU layer buffers in the ring")
    group.add_argument(
        "--gpu-memory",
        default=None,
        metavar="SIZE",
        help="GPU memory for the target's weights, e.g. 20GiB: leading layers that fit stay resident, the "
        "rest stream (implies --offload)",
    )
    group.add_argument(
        "--quant-offload",
        choices=("nf4",),
        default=None,
        help="stream layers as 4-bit NF4 (bitsandbytes): fewer bytes per forward, lossy (implies --offload)",
    )
    group.add_argument(
        "--simulate-offload-gbps",
        type=float,
        default=None,
        metavar="GBPS",
        help="no GPU: charge each target forward max(compute, streamed bytes / GBPS GB/s); timings are "
        "SIMULATED",
    )


def ram_size(text: str) -> int | str:
    """--ram's SIZE in bytes, 0 allowed, or "auto" (`loading.resolve_ram`)."""
    if text.strip() == "auto":
        return "auto"
    try:
        return parse_size(text, zero=True)
    except SizeError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _draft_vocab(text: str) -> int | str:
    return "auto" if text.strip() == "auto" else non_negative_int(text)


def _vocab_list(text: str) -> list[int | str]:
    return list(dict.fromkeys(_draft_vocab(part) for part in text.split(",") if part.strip()))


def _quant_list(text: str) -> list[str]:
    from specexec.backends.options import QUANT_MODES

    levels = list(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    unknown = [level for level in levels if level not in QUANT_MODES]
    if not levels or unknown:
        raise argparse.ArgumentTypeError(
            f"invalid quantization {(unknown or [text])[0]!r}; choose from {', '.join(QUANT_MODES)}"
        )
    return levels


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """--temperature, --top-p, --top-k, --seed."""
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=non_negative_int, default=0, help="0 = off")
    parser.add_argument("--seed", type=int, default=0)


def rpc_endpoints(text: str) -> tuple[str, ...]:
    """--rpc's endpoints, or argparse's one-line error."""
    from specexec.backends.llamacpp.rpc import parse_endpoints

    try:
        return parse_endpoints(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def shares(text: str) -> tuple[float, ...]:
    """--split's positive shares, comma-separated."""
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not numbers: {text!r}") from None
    if not all(value > 0 for value in values):
        raise argparse.ArgumentTypeError(f"every share must be above 0: {text!r}")
    return values


def pair_spec(
    args: argparse.Namespace,
    with_draft: bool,
    quant: str | None = None,
    draft_vocab: int | str | None = None,
) -> PairSpec:
    """The pair the model options of `add_model_args` name; the draft only `with_draft`. `quant` and
    `draft_vocab` stand in for the options (the bench's --quant and --draft-vocab are lists)."""
    offloads = args.offload or args.gpu_memory or args.quant_offload  # both imply --offload
    offload = {"ring_size": args.ring_size, "gpu_memory": args.gpu_memory, "codec": args.quant_offload}
    load = LoadOptions(
        dtype=args.dtype,
        quant=args.quant if quant is None else quant,
        threads=args.threads,
        offload=offload if offloads else None,
        simulate_offload_gbps=args.simulate_offload_gbps,
        ram=args.ram,
        mlock=args.mlock,
        batch_invariant=args.batch_invariant,
        rpc=args.rpc,
        split=args.split,
    )
    return PairSpec(
        target=args.target,
        draft=args.draft if with_draft else None,
        load=load,
        backend=args.backend,
        draft_backend=args.draft_backend,
        draft_quant=args.draft_quant,
        draft_vocab=args.draft_vocab if draft_vocab is None else draft_vocab,
    )
