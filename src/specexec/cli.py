"""Command line: `specexec generate`, `specexec bench`.

Every user error ends in one line on stderr and a non-zero exit status, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
import time

from specexec.methods import METHODS

EXIT_USAGE = 2
EXIT_FAILURE = 1


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line instead of usage + message
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _budget(text: str) -> int | str:
    return "auto" if text == "auto" else _positive_int(text)


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def add_model_args(parser: argparse.ArgumentParser, quant_list: bool = False) -> None:
    """--target, --draft, --dtype, --quant and the offloading flags, shared by every command that loads
    models. With `quant_list`, --quant and --draft-vocab take comma-separated lists (the bench runs each
    level and each draft vocabulary)."""
    from specexec.backends.llamacpp.head import DEFAULT_DRAFT_VOCAB
    from specexec.backends.torch.quant import QUANT_MODES
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
        type=_positive_int,
        default=None,
        help="CPU threads for both backends (default: PyTorch's default, the number of cores)",
    )
    quant_help = (
        "CPU quantization of target and draft: int8 per channel or int4 per group of 64 (weight-only, "
        "PyTorch's kernels), or w4a8 (4-bit weights x 8-bit activations, a C kernel compiled on first "
        "use) (default none)"
    )
    if quant_list:
        parser.add_argument(
            "--quant",
            type=_quant_list,
            default=["none"],
            help=quant_help + "; a comma-separated list runs each",
        )
    else:
        parser.add_argument("--quant", choices=QUANT_MODES, default="none", help=quant_help)
    parser.add_argument(
        "--draft-quant", choices=QUANT_MODES, default=None, help="the draft's quantization (default: --quant)"
    )
    vocab_help = (
        "the draft scores only the first N token ids and the special tokens: a cheaper draft pass; 0 = "
        f"all; auto: {DEFAULT_DRAFT_VOCAB} on the llama.cpp backend where the vocabulary is larger, "
        "else all (default auto)"
    )
    if quant_list:
        parser.add_argument(
            "--draft-vocab",
            type=_vocab_list,
            default=["auto"],
            metavar="N[,N...]",
            help=vocab_help + "; a comma-separated list runs the drafted methods with each",
        )
    else:
        parser.add_argument("--draft-vocab", type=_draft_vocab, default="auto", metavar="N", help=vocab_help)
    off = parser.add_argument_group("offloading (target only)")
    off.add_argument(
        "--offload",
        action="store_true",
        help="stream the target's decoder layers from pinned host memory through a ring of GPU buffers "
        "(needs CUDA)",
    )
    off.add_argument("--ring-size", type=_positive_int, default=2, help="GPU layer buffers in the ring")
    off.add_argument(
        "--gpu-memory",
        default=None,
        metavar="SIZE",
        help="GPU memory for the target's weights, e.g. 20GiB: leading layers that fit stay resident, the "
        "rest stream (implies --offload)",
    )
    off.add_argument(
        "--quant-offload",
        choices=("nf4",),
        default=None,
        help="stream layers as 4-bit NF4 (bitsandbytes): fewer bytes per forward, lossy (implies --offload)",
    )
    off.add_argument(
        "--simulate-offload-gbps",
        type=float,
        default=None,
        metavar="GBPS",
        help="no GPU: charge each target forward max(compute, streamed bytes / GBPS GB/s); timings are "
        "SIMULATED",
    )


BACKENDS = ("auto", "torch", "llamacpp")


def _draft_vocab(text: str) -> int | str:
    return "auto" if text.strip() == "auto" else _non_negative_int(text)


def _vocab_list(text: str) -> list[int | str]:
    return list(dict.fromkeys(_draft_vocab(part) for part in text.split(",") if part.strip()))


def _quant_list(text: str) -> list[str]:
    from specexec.backends.torch.quant import QUANT_MODES

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
    parser.add_argument("--top-k", type=_non_negative_int, default=0, help="0 = off")
    parser.add_argument("--seed", type=int, default=0)


NGRAM_HELP = (
    "specexec: graft prompt-lookup chains of up to N tokens into each tree, free of draft cost (0 = off)"
)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="specexec", description="Fast LLM generation through speculative decoding.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)

    gen = commands.add_parser("generate", help="generate text from a prompt, streamed to stdout")
    add_model_args(gen)
    gen.add_argument("--method", choices=list(METHODS), default="specexec")
    gen.add_argument(
        "--budget",
        type=_budget,
        default=None,
        help="draft tokens verified per target pass, or 'auto' (specexec, dsl: sized per step from the "
        "calibrated costs) (default per method: "
        + ", ".join(f"{m.name} {m.default_budget}" for m in METHODS.values() if m.drafts)
        + ")",
    )
    gen.add_argument(
        "--lookahead-schedule", choices=("constant", "heuristic"), default="constant", help="sd only"
    )
    gen.add_argument("--ngram", type=_non_negative_int, default=0, help=NGRAM_HELP)
    gen.add_argument("--max-new-tokens", type=_positive_int, default=128)
    add_sampling_args(gen)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("prompt", help="the prompt text ('-' reads it from stdin)")

    cal = commands.add_parser(
        "calibrate", help="measure forward costs of the pair on this machine (used by --budget auto)"
    )
    add_model_args(cal)

    srv = commands.add_parser("serve", help="serve an OpenAI-compatible HTTP API (needs specexec[server])")
    add_model_args(srv)
    srv.add_argument("--method", choices=list(METHODS), default="specexec")
    srv.add_argument(
        "--budget",
        type=_budget,
        default=None,
        help="draft tokens verified per target pass, or 'auto' (specexec, dsl) (default per method)",
    )
    srv.add_argument(
        "--lookahead-schedule", choices=("constant", "heuristic"), default="constant", help="sd only"
    )
    srv.add_argument("--ngram", type=_non_negative_int, default=0, help=NGRAM_HELP)
    from specexec.server import add_serve_arguments

    add_serve_arguments(srv)

    from specexec.bench.cli import add_bench_parser

    add_bench_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # stderr carries our one-line messages and stats only
    if args.simulate_offload_gbps is not None and (args.offload or args.gpu_memory or args.quant_offload):
        parser.error("--simulate-offload-gbps stands in for a GPU: it cannot be combined with --offload")
    from specexec.backends.torch.offload import OffloadError
    from specexec.backends.torch.quant import QuantError
    from specexec.draft_vocab import DraftVocabError
    from specexec.engine import GenerationError
    from specexec.models import ModelSourceError

    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "calibrate":
            return _calibrate(args)
        if args.command == "serve":
            from specexec.server import serve

            return serve(args)
        if args.command == "bench":
            from specexec.bench.cli import run_bench

            return run_bench(args)
    except (GenerationError, ModelSourceError, OffloadError, QuantError, DraftVocabError, OSError) as e:
        print(f"specexec: error: {e}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print("specexec: interrupted", file=sys.stderr)
        return 130
    return EXIT_USAGE


def load_pair(args: argparse.Namespace, need_draft: bool, quant: str | None = None, vocab: int | None = None):
    """Tokenizer, target and draft (None unless `need_draft`) as the model arguments ask, each on its
    backend (`args.backends` records them); a torch target is offloaded or its offloading simulated if
    requested (the label is left in `args.simulated`). `quant` overrides --quant (the bench loads one
    pair per level), `vocab` --draft-vocab."""
    import torch

    from specexec.models import choose_backend, default_dtype, load_model, load_tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype) if args.dtype else default_dtype()
    quant = quant or args.quant
    shared = [("dtype", f"--dtype {args.dtype}")] if args.dtype else []
    offload = None
    if args.offload or args.gpu_memory or args.quant_offload:
        offload = {"ring_size": args.ring_size, "gpu_memory": args.gpu_memory, "codec": args.quant_offload}
    target_only = [("quant", f"--quant {quant}")] if quant != "none" else []
    target_only += [("offload", "--offload")] if offload else []
    target_only += [("offload", "--simulate-offload-gbps")] if args.simulate_offload_gbps is not None else []
    target_backend = choose_backend(args.backend, args.target, shared + target_only)
    args.backends = {"target": target_backend, "draft": None}

    tokenizer = load_tokenizer(args.target)
    draft = load_draft(args, quant, args.draft_vocab if vocab is None else vocab) if need_draft else None
    target = load_model(
        args.target, dtype if target_backend == "torch" else None, offload=offload, quant=quant,
        backend=target_backend, threads=args.threads,
    )  # fmt: skip
    args.simulated = None
    if args.simulate_offload_gbps is not None:
        from specexec.backends.torch.offload import simulate_offload

        args.simulated = simulate_offload(target, args.simulate_offload_gbps).label
        print(f"[{args.simulated}; every timing below is SIMULATED]", file=sys.stderr)
    if draft is not None and target.device.type == "cuda":
        draft = draft.to(target.device)  # the draft stays resident on the GPU
    return tokenizer, target, draft


def load_draft(args: argparse.Namespace, quant: str, vocab: int | str):
    """The draft as the model arguments ask, at quantization level `quant` (or --draft-quant) and scoring
    `vocab` token ids (0 = all, "auto": `draft_vocab`); its backend is recorded in `args.backends`."""
    import torch

    from specexec.models import check_same_vocab, default_dtype, load_model, load_tokenizer

    backend = draft_backend(args, quant)
    args.backends["draft"] = backend
    tokenizer = load_tokenizer(args.draft)
    check_same_vocab(load_tokenizer(args.target), tokenizer)
    dtype = (getattr(torch, args.dtype) if args.dtype else default_dtype()) if backend == "torch" else None
    return load_model(
        args.draft, dtype, quant=args.draft_quant or quant, vocab=draft_vocab(vocab, backend, len(tokenizer)),
        backend=backend, threads=args.threads,
    )  # fmt: skip


def draft_backend(args: argparse.Namespace, quant: str) -> str:
    """The backend the draft runs on at quantization level `quant` (or --draft-quant)."""
    from specexec.models import choose_backend

    draft_quant = args.draft_quant or quant
    given = [("dtype", f"--dtype {args.dtype}")] if args.dtype else []
    given += [("quant", f"--quant {draft_quant}")] if draft_quant != "none" else []
    return choose_backend(args.draft_backend or args.backend, args.draft, given)


def draft_vocab(value: int | str, backend: str, vocab_size: int) -> int:
    """--draft-vocab as a number: "auto" is the backend's default for a draft of `vocab_size` ids (64,000
    on llama.cpp where the vocabulary is larger, measured faster there; else 0, the whole vocabulary)."""
    from specexec.backends import backend as runtime

    if value != "auto":
        return int(value)
    return runtime(backend).default_draft_vocab(vocab_size)


def backend_label(args: argparse.Namespace) -> str:
    """ "llamacpp", "torch", or "target llamacpp, draft torch" for the stats line."""
    target, draft = args.backends["target"], args.backends["draft"]
    return target if draft in (None, target) else f"target {target}, draft {draft}"


def _generate(args: argparse.Namespace) -> int:
    from specexec.calibration import cached_cost_model, is_calibrated, persisted_policies
    from specexec.engine import GenerationError, sized_by_cost, stream

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt:
        raise GenerationError("the prompt is empty")
    tokenizer, target, draft = load_pair(args, need_draft=args.method != "ar")
    if args.chat:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
    input_ids = tokenizer(prompt, add_special_tokens=not args.chat)["input_ids"]
    # What --budget auto learns (acceptance rates, whether drafting pays) carries over to the next run.
    learnt = persisted_policies(target, draft) if draft is not None else None
    # A first run on this machine measures forward costs before its first token; that is timed apart so
    # the generation's own figures stay comparable with later runs.
    cost, calibration = None, ""
    if sized_by_cost(args.method, args.budget):
        fresh = not is_calibrated(target, draft)
        calibration_start = time.perf_counter()
        cost = cached_cost_model(target, draft)
        if fresh:
            calibration = f" | calibrated in {time.perf_counter() - calibration_start:.2f} s (once)"
    printed = ""
    tokens: list[int] = []
    start = time.perf_counter()
    chunk = None
    for chunk in stream(
        target,
        draft,
        input_ids,
        method=args.method,
        budget=args.budget,
        lookahead_schedule=args.lookahead_schedule,
        ngram=args.ngram,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop_strings=args.stop,
        tokenizer=tokenizer,
        cost_model=cost,
        learnt=learnt,
    ):
        tokens += chunk.tokens
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        if not text.endswith("\ufffd"):  # hold back a character whose bytes are still incomplete
            sys.stdout.write(text[len(printed) :])
            sys.stdout.flush()
            printed = text
    sys.stdout.write(tokenizer.decode(tokens, skip_special_tokens=True)[len(printed) :] + "\n")
    elapsed = time.perf_counter() - start
    if learnt is not None:
        learnt.save()
    stats = chunk.stats
    simulated = f"[{args.simulated}] " if args.simulated else ""
    print(
        f"{simulated}[{args.method}, {backend_label(args)}] {stats.new_tokens} tokens in {elapsed:.2f} s | "
        f"{stats.tokens_per_step:.2f} tokens/step over {stats.target_calls} target calls | "
        f"decode {stats.decode_tokens_per_second:.2f} tok/s | prefill {stats.prefill_seconds:.2f} s | "
        f"draft {stats.draft_seconds:.2f} s, target {stats.target_seconds:.2f} s, "
        f"overhead {stats.overhead_seconds:.2f} s | finish: {chunk.finish_reason}{calibration}",
        file=sys.stderr,
    )
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from specexec.calibration import cached_cost_model

    _, target, draft = load_pair(args, need_draft=True)
    cost = cached_cost_model(target, draft, recalibrate=True)
    print(
        f"calibration{' (' + cost.label + ')' if cost.label else ''}: seconds per forward, 256-token context"
    )
    print("| tokens | target | draft |\n|---:|---:|---:|")
    for n in sorted(set(cost.target) | set(cost.draft)):
        t = f"{cost.target[n]:.4f}" if n in cost.target else ""
        d = f"{cost.draft[n]:.4f}" if n in cost.draft else ""
        print(f"| {n} | {t} | {d} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
