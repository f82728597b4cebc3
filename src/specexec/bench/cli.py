"""`specexec bench`: argparse setup and the command itself.

Wiring into `specexec.cli` takes two lines: `add_bench_parser(commands)` in `build_parser`, and
`if args.command == "bench": return run_bench(args)` in `main`. `run_bench` prints its own errors (one
line, exit status 1), so it needs nothing from `main`'s handler. `python -m specexec.bench ...` runs the
same command standalone.
"""

from __future__ import annotations

import argparse
import functools
import shlex
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from specexec.cli_args import (
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    OneLineParser,
    add_model_args,
    add_sampling_args,
    int_at_least,
    pair_spec,
)
from specexec.loading import (
    PairSpec,
    draft_backend,
    draft_quant,
    draft_vocab,
    load_draft,
    load_pair,
    resolve_ram,
    target_backend,
)

if TYPE_CHECKING:
    from specexec.bench.core import BenchConfig
    from specexec.bench.llamacpp import LlamaCpp, LlamaCppSpeculative


def _type(parse):
    """Turn a BenchError from `parse` into argparse's one-line usage error."""

    def convert(text: str):
        from specexec.bench.errors import BenchError

        try:
            return parse(text)
        except BenchError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = parse.__name__
    return convert


def _methods(text: str) -> list[str]:
    from specexec.bench.core import parse_methods

    return parse_methods(text)


def _budgets(text: str) -> list[int]:
    from specexec.bench.core import parse_budgets

    return parse_budgets(text, "budget list")


def _ngrams(text: str) -> list[int]:
    from specexec.bench.errors import BenchError

    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise BenchError(f"--ngram: {text!r} is not a comma-separated list of integers") from None
    if any(v < 0 for v in values):
        raise BenchError(f"--ngram: values must be >= 0, got {text!r}")
    return list(dict.fromkeys(values))


def _draft_aheads(text: str) -> list[bool]:
    from specexec.bench.errors import BenchError

    choices = {"on": True, "off": False}
    parts = [part.strip() for part in text.split(",")]
    if not all(part in choices for part in parts):
        raise BenchError(f"--draft-ahead: {text!r} is not a comma-separated list of on and off")
    return list(dict.fromkeys(choices[part] for part in parts))


def add_bench_parser(subcommands) -> argparse.ArgumentParser:
    """Add the `bench` subcommand to an `add_subparsers()` object; returns its parser."""
    p = subcommands.add_parser(
        "bench",
        help="benchmark methods and budgets side by side on a prompt set",
        description="Run every method/budget configuration on the same prompts, interleaved, after a "
        "warm-up; write results.json, results.md, records.jsonl and plots to --out.",
    )
    add_model_args(p, quant_list=True)
    p.add_argument(
        "--prompts", default="humaneval", help="humaneval, mtbench or a JSONL file (default humaneval)"
    )
    p.add_argument("--n-prompts", type=int_at_least(1), default=10, help="first N prompts (default 10)")
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=128)
    _add_config_args(p)
    add_sampling_args(p)
    p.add_argument(
        "--warmup-tokens",
        type=int_at_least(0),
        default=16,
        help="warm-up generation length per configuration, on the first prompt, not counted (0 = none)",
    )
    p.add_argument(
        "--repeats",
        type=int_at_least(1),
        default=1,
        help="time every (prompt, configuration) run this many times, the order reversed on every other "
        "pass over the prompts; rows sum all repeats (default 1)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--out", required=True, help="output folder")
    return p


def _add_config_args(p: argparse.ArgumentParser) -> None:
    """The options that make the configurations: methods, their budget lists and tree shapes."""
    from specexec.bench.core import (
        DEFAULT_BRANCHES,
        DEFAULT_BUDGETS,
        DEFAULT_DSL_BUDGETS,
        DEFAULT_EXPAND,
        DEFAULT_LLAMACPP_SPEC_BUDGETS,
        DEFAULT_SD_BUDGETS,
        DEFAULT_WIDTH,
    )
    from specexec.bench.methods import BENCH_METHODS, DEFAULT_METHODS

    def joined(values) -> str:
        return ",".join(map(str, values))

    p.add_argument(
        "--methods",
        type=_type(_methods),
        default=list(DEFAULT_METHODS),
        help=f"comma-separated, from {','.join(BENCH_METHODS)} (default all but llamacpp and "
        "llamacpp-spec, an optional extra); ar always runs first",
    )
    p.add_argument(
        "--budgets",
        type=_type(_budgets),
        default=None,
        help=f"specexec tree budgets (default {joined(DEFAULT_BUDGETS)}, those that fit the backend's "
        "trees: on llama.cpp up to 255 leaves)",
    )
    p.add_argument(
        "--sd-budgets",
        type=_type(_budgets),
        default=list(DEFAULT_SD_BUDGETS),
        help=f"sd draft lengths (default {joined(DEFAULT_SD_BUDGETS)})",
    )
    p.add_argument(
        "--specinfer-budgets",
        type=_type(_budgets),
        default=None,
        help="specinfer tree budgets (default: --budgets)",
    )
    p.add_argument(
        "--expand", type=int_at_least(1), default=DEFAULT_EXPAND, help="specexec: nodes per draft pass"
    )
    p.add_argument("--width", type=int_at_least(1), default=DEFAULT_WIDTH, help="specexec: children per node")
    p.add_argument(
        "--dsl-budgets",
        type=_type(_budgets),
        default=list(DEFAULT_DSL_BUDGETS),
        help="dsl: 'auto' (chains cut where they stop paying) and/or the longest confidence-stopped chain "
        f"(default {joined(DEFAULT_DSL_BUDGETS)})",
    )
    p.add_argument("--branches", type=int_at_least(1), default=DEFAULT_BRANCHES, help="specinfer: chains")
    p.add_argument(
        "--llamacpp-spec-budgets",
        type=_type(_budgets),
        default=list(DEFAULT_LLAMACPP_SPEC_BUDGETS),
        help=f"llamacpp-spec: llama.cpp's draft lengths (default {joined(DEFAULT_LLAMACPP_SPEC_BUDGETS)})",
    )
    p.add_argument(
        "--ngram",
        type=_type(_ngrams),
        default=[0],
        help="specexec: prompt-lookup tokens grafted per chain, a comma-separated list (default 0 = off)",
    )
    p.add_argument(
        "--draft-ahead",
        type=_type(_draft_aheads),
        default=[False],
        help="specexec: grow the next tree while the target verifies, a comma-separated list of on and off "
        "(default off)",
    )


def run_bench(args: argparse.Namespace, command: str | None = None) -> int:
    """Run `specexec bench` from parsed arguments; errors print one line and return 1."""
    from specexec.backends.base import BackendError
    from specexec.bench.errors import BenchError
    from specexec.draft_vocab import DraftVocabError
    from specexec.engine import GenerationError
    from specexec.models import ModelSourceError
    from specexec.prompts import PromptSetError

    errors = (BenchError, PromptSetError, GenerationError, ModelSourceError, BackendError, DraftVocabError)
    try:
        return _run(args, command or shlex.join(sys.argv))
    except (*errors, OSError) as e:
        print(f"specexec: error: {e}", file=sys.stderr)
        return EXIT_FAILURE


def _network(workers: tuple[str, ...]) -> Callable[[], tuple[int, int]] | None:
    """What counts the bytes sent to and received from the target's RPC workers (None: it has none)."""
    if not workers:
        return None
    from specexec.backends.llamacpp import rpc

    return functools.partial(rpc.traffic, workers)


def _run(args: argparse.Namespace, command: str) -> int:
    import importlib.util
    from pathlib import Path

    from specexec.backends import as_model
    from specexec.bench.core import run_benchmark
    from specexec.bench.errors import BenchError
    from specexec.bench.methods import DRAFT_METHODS
    from specexec.bench.report import machine_info, write_outputs
    from specexec.models import load_tokenizer
    from specexec.prompts import load_prompts

    if importlib.util.find_spec("matplotlib") is None:
        raise BenchError("the plots need matplotlib: pip install 'specexec[bench]'")
    tokenizer = load_tokenizer(args.target)
    need_draft = any(method in DRAFT_METHODS for method in args.methods)
    spec = pair_spec(args, with_draft=need_draft, quant=args.quant[0], draft_vocab=0)  # resolved next
    # Once, for every method (load_pair says when a target without --ram won't fit).
    if spec.load.ram == "auto":
        spec = resolve_ram(spec)
    vocabs = _draft_vocabs(spec, args.draft_vocab, len(tokenizer)) if need_draft else [0]
    if args.budgets is None:
        args.budgets = _default_budgets(spec)
    configs = _configs(args, vocabs)
    prompts = load_prompts(args.prompts, tokenizer, args.n_prompts)  # bad prompt sets fail before loading
    if not prompts:
        raise BenchError(f"prompt set {args.prompts!r} has no prompts")
    llamacpp, llamacpp_spec = _llamacpp_runners(args, spec, max(len(p.input_ids) for p in prompts))
    # The pairs' drafts score the first --draft-vocab value; each other value loads a draft of its own.
    spec = replace(spec, draft_vocab=vocabs[0])
    pairs = {level: load_pair(spec.with_load(quant=level)) for level in args.quant}
    main_pair = pairs[args.quant[0]]
    drafts = {n: load_draft(replace(spec, draft_vocab=n), main_pair.tokenizer).model for n in vocabs[1:]}

    Path(args.out).mkdir(parents=True, exist_ok=True)
    result = run_benchmark(
        main_pair.target,
        main_pair.draft,
        main_pair.tokenizer,
        prompts,
        configs,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        warmup_tokens=args.warmup_tokens,
        repeats=args.repeats,
        progress=not args.no_progress,
        records_path=Path(args.out) / "records.jsonl",  # rewritten in order at the end
        quantized={level: (pair.target, pair.draft) for level, pair in list(pairs.items())[1:]},
        drafts=drafts,
        llamacpp=llamacpp,
        llamacpp_spec=llamacpp_spec,
        network=_network(spec.load.rpc),
    )
    last = list(pairs.values())[-1]  # several levels: the report names the last one's backends
    ran_llama_cpp = llamacpp or llamacpp_spec or "llamacpp" in (last.target_backend, last.draft_backend)
    draft = as_model(main_pair.draft) if main_pair.draft is not None else None
    machine = machine_info(
        dtype=as_model(main_pair.target).weights,
        memory=as_model(main_pair.target).memory(),
        simulated_offload=last.simulated,
        command=command,
        target=args.target,
        draft=args.draft if need_draft else None,
        prompt_set=args.prompts,
        seed=args.seed,
        draft_quant=draft.quantization if draft is not None else None,
        draft_weights=draft.weights if draft is not None else None,
        backend=last.backend_label,
        llama_cpp=_llama_cpp_kernels(spec.load.batch_invariant) if ran_llama_cpp else None,
        rpc=as_model(main_pair.target).workers.record() if spec.load.rpc else None,
    )
    paths = write_outputs(args.out, result.records, result.rows, machine)
    _print_rows(result.rows)
    print(f"wrote {', '.join(str(p) for p in paths.values())}", file=sys.stderr)
    return 0


def _draft_vocabs(spec: PairSpec, requested: list[int | str], vocab_size: int) -> list[int]:
    """--draft-vocab's values as numbers, each checked against the vocabulary before any model loads."""
    from specexec.draft_vocab import check_draft_vocab

    backend = draft_backend(spec)
    vocabs = list(dict.fromkeys(draft_vocab(value, backend, vocab_size) for value in requested))
    for n in vocabs:
        if n:
            check_draft_vocab(n, vocab_size)
    return vocabs


def _llama_cpp_kernels(batch_invariant: bool) -> dict:
    """llama.cpp's version and kernels in this process, for the report (a target streamed from disk runs
    without extra buffer types in any case; --batch-invariant turns them off)."""
    import llama_cpp

    from specexec.backends.llamacpp.extra_buffers import extra_buffers_usable, kernels

    usable = extra_buffers_usable() and not batch_invariant
    return {"llama_cpp_python": llama_cpp.__version__, **kernels(usable), "batch_invariant": batch_invariant}


def _default_budgets(spec: PairSpec) -> list[int | str]:
    """The default specexec budgets whose trees both backends of the pair verify in one pass."""
    from specexec.backends import backend
    from specexec.bench.core import DEFAULT_BUDGETS

    names = {target_backend(spec), *([draft_backend(spec)] if spec.draft else [])}
    limits = [backend(name).MAX_TREE_LEAVES for name in names]
    return [b for b in DEFAULT_BUDGETS if b == "auto" or all(n is None or b <= n for n in limits)]


def _configs(args: argparse.Namespace, vocabs: list[int]) -> list[BenchConfig]:
    from specexec.bench.core import make_configs

    return make_configs(
        args.methods,
        args.budgets,
        sd_budgets=args.sd_budgets,
        specinfer_budgets=args.specinfer_budgets,
        expand=args.expand,
        width=args.width,
        branches=args.branches,
        quants=args.quant,
        draft_vocabs=vocabs,
        ngrams=args.ngram,
        draft_aheads=args.draft_ahead,
        dsl_budgets=args.dsl_budgets,
        llamacpp_spec_budgets=args.llamacpp_spec_budgets,
    )


def _llamacpp_runners(
    args: argparse.Namespace, spec: PairSpec, longest_prompt: int
) -> tuple[LlamaCpp | None, LlamaCppSpeculative | None]:
    """llama.cpp's own runners for the llamacpp and llamacpp-spec methods (None where not asked for).
    llama.cpp's speculation drafts with the GGUF our llama.cpp draft runs: its requantized copy where
    `draft_quant` makes one (its whole head: a reduced head is our draft's own)."""
    from specexec.backends.options import GGUF_QUANTS
    from specexec.models import gguf_file

    llamacpp = llamacpp_spec = None
    if "llamacpp" in args.methods:
        from specexec.bench.llamacpp import LlamaCpp

        context = longest_prompt + args.max_new_tokens + 8
        llamacpp = LlamaCpp(gguf_file(args.target), context, options=spec.load)
    if "llamacpp-spec" in args.methods:
        from specexec.bench.llamacpp import LlamaCppSpeculative

        context = longest_prompt + args.max_new_tokens + max(args.llamacpp_spec_budgets) + 8
        draft = gguf_file(args.draft)
        quant = draft_quant(spec, "llamacpp")  # what our draft runs, were it on llama.cpp
        if quant in GGUF_QUANTS:
            from specexec.backends.llamacpp.draft_gguf import derived_draft

            draft = derived_draft(draft, 0, (), quant, args.threads)
        target = gguf_file(args.target)
        llamacpp_spec = LlamaCppSpeculative(target, draft, context, options=spec.load)
    return llamacpp, llamacpp_spec


def _print_rows(rows: list[dict]) -> None:
    for row in rows:
        speedup = "n/a" if row["speedup_vs_ar"] is None else f"{row['speedup_vs_ar']:.2f}x"
        tps = "n/a" if row["tokens_per_step"] is None else f"{row['tokens_per_step']:.2f}"
        print(
            f"[{row['label']}] {tps} tokens/call, {row['tok_per_s'] or 0:.2f} tok/s decode, "
            f"{row['tok_per_s_with_prefill'] or 0:.2f} tok/s incl. prefill, speedup {speedup}, "
            f"identical to ar: {row['identical_to_ar']}",
            file=sys.stderr,
        )


def main(argv: list[str] | None = None) -> int:
    """`specexec bench` without the rest of the CLI: `python -m specexec.bench --prompts ... --out DIR`."""
    parser = OneLineParser(prog="specexec")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    add_bench_parser(commands)
    args_list = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(["bench", *args_list])
    if argv is not None:
        command = shlex.join(["specexec", "bench", *args_list])
    elif sys.argv[0].endswith("__main__.py"):
        command = shlex.join(["python", "-m", "specexec.bench", *args_list])
    else:
        command = shlex.join(sys.argv)
    try:
        return run_bench(args, command)
    except KeyboardInterrupt:
        print("specexec: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
