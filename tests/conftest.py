"""Shared test setup."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# --batch-invariant turns ggml's tiled matmul off process-wide, which it reads once, before the first
# pass: set here, the tests of the mode can run after any other test.
os.environ.setdefault("GGML_CPU_TILED_MM", "0")

# The core tests drive tiny models (hidden size 16-48, one or two layers), where a forward is a few small
# kernels and thread hand-offs dominate: one intra-op thread is several times faster than two, and far
# faster when other jobs compete for the cores. Other test modules keep torch's default.
ONE_THREAD_MODULES = {
    "test_sampling.py",
    "test_tree.py",
    "test_runner.py",
    "test_exactness.py",
    "test_distribution.py",
    "test_api.py",
    "test_quant.py",
    "test_lookup.py",
    "test_draft_vocab.py",
}


@pytest.fixture(autouse=True)
def _one_intra_op_thread(request: pytest.FixtureRequest):
    if request.path.name not in ONE_THREAD_MODULES:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def tokenized_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A tiny qwen2 GGUF with a byte-level BPE tokenizer (test_models), caches kept in the test's folder."""
    from test_models import write_tiny_gguf

    monkeypatch.setenv("SPECEXEC_CACHE", str(tmp_path / "cache"))
    write_tiny_gguf(tmp_path / "tiny.gguf")
    return tmp_path / "tiny.gguf"


@pytest.fixture
def inference_mode():
    """The drafter tests run as the engine does: under `torch.inference_mode`."""
    with torch.inference_mode():
        yield


@pytest.fixture(scope="module")
def draft_model():
    """The drafter tests' tiny draft model (tests/drafting.py)."""
    from drafting import drafting_model

    return drafting_model()


@pytest.fixture(scope="session")
def rpc_workers() -> Iterator[tuple[str, ...]]:
    """Two `specexec worker`s on loopback, for every test that puts a target's layers on workers."""
    from rpc_workers import start_workers, stop

    endpoints, started = start_workers(2)
    yield endpoints
    for worker in started:
        stop(worker)
