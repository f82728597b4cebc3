"""Where the server's generations run: `LocalPair` holds the pair in this process, `ChildPair` in a child
process that the server starts again when it dies.

ggml-rpc ends the process that holds a model when the connection to one of its workers breaks
(backends/llamacpp/rpc.py), so a server whose target runs on RPC workers would die with any worker.
`ChildPair` loads the pair in a child process instead: a lost worker ends the child, the request it was
serving gets a 503, requests meanwhile get a 503 at once, and a new child (connecting to the workers
again) takes over as soon as every worker answers, without restarting the server.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import multiprocessing
import signal
import threading
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from specexec.engine import SETTINGS, Chunk, GenerationError, probe, sized_by_cost, stream
from specexec.methods import METHODS, Budget
from specexec.prefix_cache import PrefixCache

if TYPE_CHECKING:
    from specexec.loading import LoadedPair, PairSpec

log = logging.getLogger("specexec.server")

# A generation without a forward for this long makes /health a 503, and a child pair that says nothing for
# this long is taken for hung (a worker that stays connected but stopped computing, and answers no
# heartbeats, which would end the child in seconds: backends/llamacpp/heartbeat.py): a 70B model's prefill
# chunk can take a minute on CPUs.
STALL_SECONDS = 300.0
RETRY_SECONDS = 2.0  # how often a server whose child died tries to start a new one


@dataclass
class Params:
    """One validated request, in engine terms."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: list[str] = field(default_factory=list)


class PairLost(RuntimeError):
    """The pair's process is gone (an RPC worker lost) or not back yet: the request gets a 503."""


@dataclass(frozen=True)
class PairFacts:
    """What the HTTP side needs to know of the pair it serves."""

    context_window: int | None
    vocab_size: int
    eos_token_id: list[int]
    backend_label: str = ""
    memory: str = ""  # where the target's weights are, when part of them streams from disk
    placement: str = ""  # which of the target's layers run on which RPC worker


def check_engine_config(
    method: str, budget: int | str | None, engine_options: dict | None, has_draft: bool
) -> tuple[dict, Budget]:
    """Refuse a configuration that would fail every request, before serving anything; the engine's
    options and the budget resolved once, for every request."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    if METHODS[method].drafts and not has_draft:
        raise ValueError(f"method {method!r} needs a draft model")
    resolved = METHODS[method].resolve_budget(budget)  # a BudgetError (a ValueError) says why it cannot
    options = dict(engine_options or {})
    allowed = (SETTINGS | set(inspect.signature(stream).parameters)) - _PER_REQUEST - {"settings"}
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ValueError(f"engine_options not accepted by specexec.stream: {', '.join(unknown)}")
    return options, resolved


# What the server sets itself for every request, so not an engine option.
_PER_REQUEST = {
    "target", "draft", "input_ids", "method", "budget", "max_new_tokens", "temperature", "top_p", "top_k",
    "seed", "eos_token_id", "stop_strings", "tokenizer",
}  # fmt: skip


class LocalPair:
    """The pair in this process: runs one generation at a time (the queue's worker thread calls it)."""

    unavailable: str | None = None  # a local pair is always there

    def __init__(
        self,
        target,
        draft,
        tokenizer,
        *,
        method: str,
        budget: Budget,
        options: dict,
        prefix_cache_bytes: int,
        eos_token_id: list[int] | None = None,
    ) -> None:
        from specexec.backends import as_model
        from specexec.models import eos_token_ids

        self.target, self.draft, self.method, self.budget = target, draft, method, budget
        self.options = dict(options)
        if sized_by_cost(method, budget):
            from specexec.calibration import cached_cost_model, persisted_policies

            if self.options.get("cost_model") is None:
                self.options["cost_model"] = cached_cost_model(target, draft)  # calibrates if not cached
            # Requests run one at a time: each starts from what the auto budget learnt on the ones
            # before, and the first from what the last server (or `specexec generate`) of this pair
            # learnt.
            self.options.setdefault("learnt", persisted_policies(target, draft))
        self.prefix_cache = PrefixCache(prefix_cache_bytes)
        model = as_model(target)
        self.facts = PairFacts(
            model.context_window,
            model.vocab_size,
            eos_token_id if eos_token_id is not None else eos_token_ids(target, tokenizer),
        )

    @classmethod
    def of(cls, loaded: LoadedPair, **config: Any) -> LocalPair:
        """The pair `load_pair` loaded, its facts telling where its weights are; `config` as `__init__`."""
        pair = cls(loaded.target, loaded.draft, loaded.tokenizer, **config)
        pair.facts = replace(
            pair.facts, backend_label=loaded.backend_label, memory=loaded.memory, placement=loaded.placement
        )
        return pair

    def generate(self, p: Params, cancelled: Callable[[], bool]) -> Iterator[Chunk]:
        """The chunks of one generation; `cancelled` is asked between prefill chunks."""
        return stream(
            self.target,
            self.draft,
            p.prompt_ids,
            method=self.method,
            budget=self.budget,
            max_new_tokens=p.max_tokens,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            seed=p.seed,
            eos_token_id=self.facts.eos_token_id,
            prefix_cache=self.prefix_cache,
            cancelled=cancelled,
            **self.options,
        )

    def probe(self) -> None:
        """A one-token forward of each model: proof that the engine computes."""
        for model in (self.target, self.draft):
            if model is not None:
                probe(model)

    def finished(self) -> int:
        """After a generation: what the auto budget learnt saved, and the prefix cache's bytes returned."""
        learnt = self.options.get("learnt")
        if learnt is not None:
            try:
                learnt.save()  # a restarted server starts from what this one learnt
            except OSError as err:  # an unwritable cache costs the next server its head start, no more
                log.warning("could not save what the auto budget learnt: %s", err)
        return self.prefix_cache.nbytes

    def close(self) -> None:
        pass


class ChildPair:
    """The pair loaded and run in a child process, started again (connecting to the workers again) when
    it dies. The first start happens here and raises what loading raised; a child that dies later makes
    `unavailable` say why until a new one has loaded."""

    def __init__(
        self,
        spec: PairSpec,
        *,
        method: str,
        budget: Budget,
        options: dict,
        prefix_cache_bytes: int,
        stall_seconds: float = STALL_SECONDS,
        retry_seconds: float = RETRY_SECONDS,
    ) -> None:
        self._spec = spec
        self._config = (method, budget, options, prefix_cache_bytes)
        self.stall_seconds = stall_seconds
        self.retry_seconds = retry_seconds
        self._context = multiprocessing.get_context("spawn")  # no fork of a process holding threads
        self._process: Any = None
        self._conn: Any = None
        self._lock = threading.Lock()  # held while a child starts
        self._closed = threading.Event()
        self.unavailable: str | None = None
        self.prefix_bytes = 0
        self.facts = self._start()
        self._supervisor = threading.Thread(target=self._supervise, name="specexec-pair", daemon=True)
        self._supervisor.start()

    # ---- what the queue calls (its worker thread) ------------------------------------------------------

    def generate(self, p: Params, cancelled: Callable[[], bool]) -> Iterator[Chunk]:
        conn = self._connection()
        self._send(conn, ("generate", p))
        ended = cancel_sent = False
        try:
            while True:
                kind, payload = self._receive(conn)
                if kind == "tick":  # the child's prefill asks whether to go on
                    if cancelled() and not cancel_sent:
                        self._send(conn, ("cancel", None))
                        cancel_sent = True
                elif kind == "chunk":
                    yield payload
                elif kind == "done":
                    ended = True
                    self.prefix_bytes = payload
                    return
                elif kind == "error":
                    ended = True
                    raise payload
        finally:
            if not ended:  # closed early (the request is done or gone): stop the child's generation
                self._wind_down(conn, cancel_sent)

    def probe(self) -> None:
        conn = self._connection()
        self._send(conn, ("probe", None))
        kind, payload = self._receive(conn)
        if kind == "error":
            raise payload

    def finished(self) -> int:
        return self.prefix_bytes  # the child saved what the auto budget learnt

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            self._stop_child()

    # ---- the child's life ------------------------------------------------------------------------------

    def _start(self) -> PairFacts:
        """Start a child and wait for its pair to load; raises what loading raised, or PairLost."""
        parent, child = self._context.Pipe()
        process = self._context.Process(
            target=_child_main, args=(child, self._spec, *self._config), name="specexec-pair", daemon=True
        )
        process.start()
        child.close()
        try:
            kind, payload = parent.recv()  # as long as loading takes
        except (EOFError, OSError):
            process.join(5)
            parent.close()
            raise PairLost(
                f"the model's process ended while loading (exit status {process.exitcode})"
            ) from None
        if kind != "ready":
            process.join(5)
            parent.close()
            raise payload
        self._process, self._conn = process, parent
        return payload

    def _supervise(self) -> None:
        """While the child is gone, try a new one every `retry_seconds`."""
        while not self._closed.wait(self.retry_seconds):
            if self.unavailable is None:
                continue
            with self._lock:
                if self._closed.is_set():
                    return
                try:
                    self._check_workers()
                    self.facts = self._start()
                except Exception as err:  # the workers are not back yet: try again later
                    self.unavailable = _one_line(err)
                    continue
                self.unavailable = None
            log.info("the model's process is back: serving again")

    def _check_workers(self) -> None:
        """Raise unless every RPC worker answers: a child started before would only fail (and starting
        one costs seconds of CPU), so it waits until a probe, which costs a round trip, passes."""
        if self._spec.load.rpc:
            from specexec.backends.llamacpp import rpc

            for endpoint in self._spec.load.rpc:
                rpc.probe(endpoint)

    def _connection(self):
        if self.unavailable is not None or self._conn is None:
            raise PairLost(self.unavailable or "the model's process is not running")
        return self._conn

    def _send(self, conn, message: tuple) -> None:
        try:
            conn.send(message)
        except (OSError, ValueError):
            self._lost("the model's process ended")

    def _receive(self, conn) -> tuple[str, Any]:
        """The child's next message; PairLost when it ended or said nothing for `stall_seconds`."""
        process = self._process
        try:
            if not conn.poll(self.stall_seconds):
                self._lost(f"the model's process did nothing for {self.stall_seconds:g} s: a worker hung?")
            return conn.recv()
        except (EOFError, OSError):
            process.join(5)
            self._lost(f"the model's process ended (exit status {process.exitcode}): an RPC worker lost?")

    def _wind_down(self, conn, cancel_sent: bool) -> None:
        """Stop the running generation and wait for the child to say it stopped."""
        try:
            if not cancel_sent:
                self._send(conn, ("cancel", None))
            while self._receive(conn)[0] not in ("done", "error"):
                pass
        except PairLost:
            pass  # recorded; the next request gets the 503

    def _lost(self, reason: str):
        """Record that the child is gone, end it for sure, and raise PairLost."""
        log.error("%s; the server starts it again once every worker answers", reason)
        with self._lock:
            self._stop_child(graceful=False)
            self.unavailable = reason
        raise PairLost(reason)

    def _stop_child(self, graceful: bool = True) -> None:
        """End the child: asked to stop when `graceful` (it frees its models), else killed at once."""
        process, conn = self._process, self._conn
        self._process = self._conn = None
        if conn is not None:
            if graceful:
                with contextlib.suppress(OSError, ValueError):
                    conn.send(("stop", None))
            conn.close()
        if process is not None:
            process.join(2 if graceful else 0)
            if process.is_alive():
                process.kill()
                process.join(5)


def _one_line(err: BaseException) -> str:
    return str(err).splitlines()[0] if str(err) else type(err).__name__


def _child_main(conn, spec: PairSpec, method: str, budget: Budget, options: dict, prefix_bytes: int) -> None:
    """The child: load the pair, say "ready" with its facts, then serve the parent's messages."""
    from specexec.loading import load_pair

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the server stops it

    try:
        pair = LocalPair.of(
            load_pair(spec),
            method=method,
            budget=budget,
            options=options,
            prefix_cache_bytes=prefix_bytes,
        )
    except Exception as err:
        conn.send(("failed", _sendable(err)))
        return
    conn.send(("ready", pair.facts))
    while True:
        try:
            kind, payload = conn.recv()
        except (EOFError, OSError):
            return  # the server is gone
        if kind == "stop":
            return
        if kind == "generate":
            _child_generate(conn, pair, payload)
        elif kind == "probe":
            try:
                pair.probe()
            except Exception as err:
                conn.send(("error", _sendable(err)))
            else:
                conn.send(("done", None))
        # a "cancel" that came after its generation ended is dropped


def _child_generate(conn, pair: LocalPair, p: Params) -> None:
    def cancel_asked() -> bool:
        while conn.poll():
            if conn.recv()[0] == "cancel":
                return True
        return False

    def cancelled() -> bool:  # asked between prefill chunks: the parent answers with a cancel or not
        conn.send(("tick", None))
        return cancel_asked()

    generator = pair.generate(p, cancelled)
    try:
        for chunk in generator:
            conn.send(("chunk", chunk))
            if chunk.finish_reason is not None or cancel_asked():
                break
    except Exception as err:
        generator.close()
        pair.finished()
        conn.send(("error", _sendable(err)))
        return
    generator.close()
    conn.send(("done", pair.finished()))


def _sendable(err: Exception) -> Exception:
    """`err` as the parent can unpickle it: a GenerationError keeps its class (a 400), others their line."""
    if isinstance(err, GenerationError):
        return GenerationError(str(err))
    from specexec.backends.base import BackendError
    from specexec.models import ModelSourceError

    for kind in (BackendError, ModelSourceError, OSError, ValueError):
        if isinstance(err, kind):
            return kind(_one_line(err))
    traceback.print_exc()  # not one of the errors a user's input causes: its trace, in the server's log
    return PairLost(f"the model's process failed: {_one_line(err)}")
