"""Command line: `specexec generate`, `specexec bench`.

Every user error ends in one line on stderr and a non-zero exit status, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
import time

from specexec.cli_args import (
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    OneLineParser,
    add_model_args,
    add_sampling_args,
    non_negative_int,
    pair_spec,
    positive_int,
)
from specexec.loading import load_pair
from specexec.methods import METHODS


def _budget(text: str) -> int | str:
    return "auto" if text == "auto" else positive_int(text)


NGRAM_HELP = (
    "specexec: graft prompt-lookup chains of up to N tokens into each tree, free of draft cost (0 = off)"
)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="specexec", description="Fast LLM generation through speculative decoding.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)

    gen = commands.add_parser("generate", help="generate text from a prompt, streamed to stdout")
    add_model_args(gen)
    _add_method_args(
        gen,
        budget_help="draft tokens verified per target pass, or 'auto' (specexec, dsl: sized per step from "
        "the calibrated costs) (default per method: "
        + ", ".join(f"{m.name} {m.default_budget}" for m in METHODS.values() if m.drafts)
        + ")",
    )
    gen.add_argument("--max-new-tokens", type=positive_int, default=128)
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
    _add_method_args(
        srv,
        budget_help="draft tokens verified per target pass, or 'auto' (specexec, dsl) (default per method)",
    )
    from specexec.server import add_serve_arguments

    add_serve_arguments(srv)

    worker = commands.add_parser(
        "worker", help="serve this machine's CPU to hold and compute a target's layers (llama.cpp RPC)"
    )
    worker.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1; another one serves the network: the protocol has "
        "no authentication, a trusted network only)",
    )
    worker.add_argument("--port", type=positive_int, default=50052)
    worker.add_argument(
        "--threads", type=positive_int, default=None, help="compute threads (default: PyTorch's, the cores)"
    )
    worker.add_argument(
        "--batch-invariant",
        action="store_true",
        help="compute a row of a block bit for bit as the row alone (ggml's tiled matmul off), for clients "
        "run with --batch-invariant",
    )

    from specexec.bench.cli import add_bench_parser

    add_bench_parser(commands)
    return parser


def _add_method_args(parser: argparse.ArgumentParser, budget_help: str) -> None:
    """--method, --budget, --lookahead-schedule, --ngram and --draft-ahead: one generation's method
    (generate, serve)."""
    parser.add_argument("--method", choices=list(METHODS), default="specexec")
    parser.add_argument("--budget", type=_budget, default=None, help=budget_help)
    parser.add_argument(
        "--lookahead-schedule", choices=("constant", "heuristic"), default="constant", help="sd only"
    )
    parser.add_argument("--ngram", type=non_negative_int, default=0, help=NGRAM_HELP)
    parser.add_argument(
        "--draft-ahead",
        action="store_true",
        help="specexec: grow the next tree while the target verifies, on a thread of its own (off: it was "
        "slower where measured, docs/bigger-than-ram.md)",
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "worker":
        return _worker(args)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # stderr carries our one-line messages and stats only
    if args.simulate_offload_gbps is not None and (args.offload or args.gpu_memory or args.quant_offload):
        parser.error("--simulate-offload-gbps stands in for a GPU: it cannot be combined with --offload")
    from specexec.backends.base import BackendError
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
    except (GenerationError, ModelSourceError, BackendError, DraftVocabError, OSError) as e:
        print(f"specexec: error: {e}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print("specexec: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_USAGE


def _generate(args: argparse.Namespace) -> int:
    from specexec.calibration import cached_cost_model, is_calibrated, persisted_policies
    from specexec.engine import GenerationError, sized_by_cost, stream

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt:
        raise GenerationError("the prompt is empty")
    pair = load_pair(pair_spec(args, with_draft=args.method != "ar"))
    tokenizer, target, draft = pair.tokenizer, pair.target, pair.draft
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
        draft_ahead=args.draft_ahead,
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
    simulated = f"[{pair.simulated}] " if pair.simulated else ""
    print(
        f"{simulated}[{args.method}, {pair.backend_label}] {stats.new_tokens} tokens in {elapsed:.2f} s | "
        f"{stats.tokens_per_step:.2f} tokens/step over {stats.target_calls} target calls | "
        f"decode {stats.decode_tokens_per_second:.2f} tok/s | prefill {stats.prefill_seconds:.2f} s | "
        f"draft {stats.draft_seconds:.2f} s, target {stats.target_seconds:.2f} s, "
        f"overhead {stats.overhead_seconds:.2f} s{_drafted_ahead(stats)} | finish: {chunk.finish_reason}"
        f"{calibration}"
        f"{' | ' + pair.memory if pair.memory else ''}"
        f"{f', plus {stats.cache_bytes / 2**20:.0f} MiB of KV caches and buffers' if pair.memory else ''}"
        f"{' | ' + pair.placement if pair.placement else ''}",
        file=sys.stderr,
    )
    return 0


def _drafted_ahead(stats) -> str:
    """The stats line's account of `--draft-ahead` (nothing without it)."""
    if not stats.ahead_calls:
        return ""
    return (
        f", drafted ahead {stats.ahead_seconds:.2f} s beside the target ({stats.ahead_calls} passes, "
        f"{stats.carried} nodes carried into steps)"
    )


def _worker(args: argparse.Namespace) -> int:
    """Serve as an RPC worker until stopped; one-line errors for a port it cannot take."""
    import signal
    import socket

    from specexec.backends.base import BackendError
    from specexec.backends.llamacpp import heartbeat, rpc
    from specexec.backends.llamacpp.library import batch_invariant_kernels

    if args.batch_invariant:
        batch_invariant_kernels()  # before the server's first matmul, which reads the switch
    if not rpc.is_loopback(args.host):
        print(
            f"specexec worker: warning: listening on {args.host}: llama.cpp's RPC protocol has no "
            "authentication, and whoever reaches this port can run computations here; use it on a trusted "
            "network only",
            file=sys.stderr,
        )
    try:
        with socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET) as taken:
            taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            taken.bind((args.host.strip("[]"), args.port))
        if not heartbeat.answer(args.host, args.port):
            print(
                f"specexec worker: warning: UDP port {args.port} is taken, so this worker answers no "
                "heartbeats: a client waits on it, if it hangs, until Ctrl-C",
                file=sys.stderr,
            )
        print(
            f"specexec worker: serving on {args.host}:{args.port}"
            f"{', batch-invariant' if args.batch_invariant else ''} (Ctrl-C stops it)",
            file=sys.stderr,
            flush=True,
        )
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # the server's accept loop never returns to Python
        rpc.serve(args.host, args.port, args.threads)
        error = f"llama.cpp's RPC server could not listen on {args.host}:{args.port}"
    except (OSError, BackendError) as e:
        error = f"cannot serve on {args.host}:{args.port}: {e.strerror if isinstance(e, OSError) else e}"
    print(f"specexec worker: error: {error}", file=sys.stderr)
    return EXIT_FAILURE


def _calibrate(args: argparse.Namespace) -> int:
    from specexec.calibration import cached_cost_model

    pair = load_pair(pair_spec(args, with_draft=True))
    cost = cached_cost_model(pair.target, pair.draft, recalibrate=True)
    print(
        f"calibration{' (' + cost.label + ')' if cost.label else ''}: seconds per forward, 256-token context"
    )
    print("| tokens | target | draft |\n|---:|---:|---:|")
    for n in sorted(set(cost.target) | set(cost.draft)):
        t = f"{cost.target[n]:.4f}" if n in cost.target else ""
        d = f"{cost.draft[n]:.4f}" if n in cost.draft else ""
        print(f"| {n} | {t} | {d} |")
    print(f"overlap: {cost.overlap:.3f} s of drafting before a target pass that the pass takes back")
    return 0


if __name__ == "__main__":
    sys.exit(main())
