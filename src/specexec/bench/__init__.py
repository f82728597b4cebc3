"""Side-by-side benchmark of specexec's methods and Hugging Face's assisted generation and prompt lookup.

`run_benchmark` drives already-loaded models and returns raw records plus per-configuration rows;
`write_outputs` writes results.json, results.md, records.jsonl and the plots; `specexec.bench.cli` is
the command line (`specexec bench`).
"""

from specexec.bench.core import (
    BenchConfig,
    BenchResult,
    make_configs,
    parse_budgets,
    parse_methods,
    run_benchmark,
)
from specexec.bench.errors import BenchError
from specexec.bench.hf import hf_assisted_settings
from specexec.bench.methods import BENCH_METHODS, BUDGET_METHODS, HF_METHODS
from specexec.bench.report import machine_info, markdown, read_records, summarize, write_outputs, write_plots

__all__ = [
    "BENCH_METHODS",
    "BUDGET_METHODS",
    "HF_METHODS",
    "BenchConfig",
    "BenchError",
    "BenchResult",
    "hf_assisted_settings",
    "machine_info",
    "make_configs",
    "markdown",
    "parse_budgets",
    "parse_methods",
    "read_records",
    "run_benchmark",
    "summarize",
    "write_outputs",
    "write_plots",
]
