"""The server's pair in a child process (`ChildPair`, used for a target on RPC workers): it generates what
the pair in this process generates, stops a generation when asked, and when its process dies or hangs the
request gets PairLost (the 503) and a new process takes over. On a tiny GGUF, on the llama.cpp backend."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp", reason="the child pair is tested on the llama.cpp backend")
pytest.importorskip("fastapi", reason="the server needs specexec[server]")

from specexec.backends.options import LoadOptions  # noqa: E402
from specexec.loading import PairSpec, load_pair  # noqa: E402
from specexec.methods import METHODS  # noqa: E402
from specexec.server.pair import ChildPair, LocalPair, PairLost, Params  # noqa: E402

PROMPT = [3, 1, 4, 1, 5]


@pytest.fixture
def spec(tokenized_gguf: Path) -> PairSpec:
    gguf = str(tokenized_gguf)
    return PairSpec(gguf, gguf, LoadOptions(threads=1), backend="llamacpp")


def config(budget: int = 4) -> dict:
    return {"method": "specexec", "budget": METHODS["specexec"].resolve_budget(budget), "options": {},
            "prefix_cache_bytes": 1 << 20}  # fmt: skip


def tokens(chunks) -> list[int]:
    return [token for chunk in chunks for token in chunk.tokens]


def never() -> bool:
    return False


def wait_available(pair: ChildPair, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while pair.unavailable is not None:
        assert time.monotonic() < deadline, f"no new child: {pair.unavailable}"
        time.sleep(0.1)


def test_the_child_generates_what_the_pair_here_does_and_stops_when_asked(spec) -> None:
    here = LocalPair.of(load_pair(spec), **config())
    params = Params(PROMPT, max_tokens=40, temperature=0.8, seed=7)
    expected = tokens(here.generate(params, never))
    pair = ChildPair(spec, **config())
    try:
        assert pair.facts.context_window == here.facts.context_window
        assert pair.facts.eos_token_id == here.facts.eos_token_id
        assert pair.facts.backend_label == "llamacpp"
        assert tokens(pair.generate(params, never)) == expected
        pair.probe()
        first = pair.generate(params, never)
        next(first)
        first.close()  # the request went away after one step: the child stops, and serves the next
        assert tokens(pair.generate(params, never)) == expected
        asked = []
        cancelled = pair.generate(Params(PROMPT * 4, max_tokens=40), lambda: asked.append(1) or True)
        assert tokens(cancelled) == [] and asked  # cancelled during its prefill: no step ran
        assert pair.unavailable is None
    finally:
        pair.close()


@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP])
def test_a_dead_or_hung_child_is_a_pair_lost_and_a_new_one_takes_over(spec, fault) -> None:
    """SIGKILL stands for ggml-rpc ending the child (a worker lost), SIGSTOP for a worker that hangs: the
    generation ends with PairLost (dead: at once; hung: after `stall_seconds`), requests meanwhile get
    PairLost at once, and a new child serves within seconds. Negative control: before the fault, the
    same generation succeeds."""
    pair = ChildPair(spec, **config(), stall_seconds=2.0, retry_seconds=0.2)
    params = Params(PROMPT, max_tokens=40)
    try:
        expected = tokens(pair.generate(params, never))
        generation = pair.generate(params, never)
        next(generation)
        child = pair._process
        os.kill(child.pid, fault)
        started = time.monotonic()
        with pytest.raises(PairLost, match="ended" if fault == signal.SIGKILL else "did nothing for 2 s"):
            list(generation)
        assert time.monotonic() - started < 10
        assert not child.is_alive()  # a hung child is ended, not left behind
        with pytest.raises(PairLost):  # meanwhile, at once
            next(pair.generate(params, never))
        wait_available(pair)
        assert tokens(pair.generate(params, never)) == expected
    finally:
        pair.close()


def test_a_pair_that_cannot_load_raises_what_loading_raised(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing.gguf")
    with pytest.raises(ValueError, match="missing.gguf"):
        ChildPair(PairSpec(missing, None, backend="llamacpp"), **{**config(), "method": "ar"})
