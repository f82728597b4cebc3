"""One generation at a time on a dedicated worker thread, fed by a bounded FIFO queue.

The engine is CPU/GPU-bound torch code, so it never runs on the event loop. The HTTP side first `admit`s
a request (before reading its body: a full queue answers 429 at once), then submits its `Job`; the
worker thread runs the jobs one after another and sends each step's text back to the event loop through
the job's asyncio queue. `Job.cancel()` (a client went away) reaches the worker between two decoding
steps or two prefill chunks: the worker stops the engine's generator and takes the next job at once. A
job still waiting in the queue is simply removed. The generations run on the pair (pair.py: in this
process, or in a child process for a target on RPC workers), which keeps a prefix cache: a request that
begins with the tokens of an earlier one (the next turn of a chat) prefills only the rest.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import logging
import math
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass

from specexec.engine import GenerationError, Stats
from specexec.server.metrics import Metrics
from specexec.server.pair import ChildPair, LocalPair, PairLost, Params
from specexec.text import TextStream

log = logging.getLogger("specexec.server")


class ShuttingDown(RuntimeError):
    def __init__(self) -> None:
        super().__init__("the server is shutting down")


class QueueFull(Exception):
    def __init__(self, retry_after: int) -> None:
        super().__init__(f"the queue is full; retry after {retry_after} s")
        self.retry_after = retry_after


@dataclass
class Update:
    """What one decoding step produced, for the HTTP side.

    `finish_reason` and `stats` are set on the last update only; `error` (a GenerationError or another
    exception) ends a job that failed.
    """

    text: str = ""
    tokens: int = 0
    finish_reason: str | None = None
    stats: dict | None = None
    error: BaseException | None = None


@dataclass
class JobRecord:
    """What the worker did with a job, kept for /health and for tests."""

    id: int
    finish_reason: str  # stop, length, cancelled or error
    steps: int
    enqueued_at: float
    started_at: float | None
    ended_at: float


class Job:
    """One request's generation; `params` None is a health probe (a one-token forward of each model)."""

    def __init__(
        self, queue: GenerationQueue, job_id: int, params: Params | None, loop: asyncio.AbstractEventLoop
    ):
        self.id = job_id
        self.params = params
        self.enqueued_at = time.perf_counter()
        self.started_at: float | None = None
        self._queue = queue
        self._loop = loop
        self._updates: asyncio.Queue[Update] = asyncio.Queue()
        self._cancelled = threading.Event()
        self._done = False

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        """Stop this job: dropped from the queue if waiting, stopped after the current step if running.

        Idempotent and safe from any thread; a no-op once the job has finished.
        """
        if not self._cancelled.is_set():
            self._cancelled.set()
            self._queue._discard(self)

    async def next(self) -> Update:
        return await self._updates.get()

    def _push(self, update: Update) -> None:
        """Called from the worker thread."""
        if update.finish_reason is not None or update.error is not None:
            self._done = True  # before the update: whoever reads it may look at the engine at once
        try:
            self._loop.call_soon_threadsafe(self._updates.put_nowait, update)
        except RuntimeError:  # the event loop is gone (shutdown): nobody is listening any more
            self._cancelled.set()


class Admission:
    """A place in the queue held for a request whose body is still being read and tokenized."""

    def __init__(self, queue: GenerationQueue) -> None:
        self._queue = queue
        self._held = True

    def submit(self, params: Params, loop: asyncio.AbstractEventLoop) -> Job:
        """Turn the place into a queued job."""
        self.release()
        return self._queue._enqueue(params, loop)

    def release(self) -> None:
        """Give the place back (the request failed before its job was queued); idempotent."""
        with self._queue._cond:
            if self._held:
                self._held = False
                self._queue._admitted -= 1


class GenerationQueue:
    """Runs the pair's generations one job at a time, in FIFO order, with at most `max_queue` waiting."""

    def __init__(
        self, pair: LocalPair | ChildPair, tokenizer, *, max_queue: int, metrics: Metrics, history: int = 256
    ) -> None:
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.pair = pair
        # The worker decodes while request handlers encode in their own thread; Rust tokenizers refuse
        # concurrent use of one object ("Already borrowed"), so the worker has its own copy.
        try:
            self.tokenizer = copy.deepcopy(tokenizer)
        except Exception:  # pragma: no cover - a tokenizer that cannot be copied
            self.tokenizer = tokenizer
        self.max_queue = max_queue
        self.metrics = metrics
        self.history: deque[JobRecord] = deque(maxlen=history)
        self.last_forward = 0.0  # perf_counter() after the last forward that ran (step, chunk or probe)
        self.probe_seconds: float | None = None  # the last health probe's duration
        self._probe: Job | None = None
        self._admitted = 0  # requests admitted whose job is not queued yet
        self._pending: deque[Job] = deque()
        self._running: Job | None = None
        self._cond = threading.Condition()
        self._ids = itertools.count(1)
        self._stopping = False
        self._mean_seconds = 1.0  # moving average of generation time, for Retry-After
        self._thread: threading.Thread | None = None

    # ---- event-loop side -------------------------------------------------------------------------------

    def start(self) -> None:
        with self._cond:
            self._stopping = False
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._work, name="specexec-generation", daemon=True)
                self._thread.start()

    def ensure_running(self) -> bool:
        """Start the worker if it never started or has died; False once `stop` has been called."""
        if self._stopping:
            return False
        if not self.alive:
            log.warning("starting the generation worker")
            self.start()
        return True

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the worker (the jobs waiting get ShuttingDown) and let the pair go."""
        with self._cond:
            self._stopping = True
            pending, self._pending = list(self._pending), deque()
            if self._running is not None:
                self._running._cancelled.set()
            self._cond.notify_all()
        for job in pending:
            job._cancelled.set()
            job._push(Update(error=ShuttingDown()))
        self.metrics.queue_depth.set(0)
        if self._thread is not None:
            self._thread.join(timeout)
        self.pair.close()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def depth(self) -> int:
        """Jobs waiting (not counting the one running)."""
        return len(self._pending)

    @property
    def busy(self) -> bool:
        return self._running is not None

    def seconds_without_progress(self) -> float | None:
        """Seconds since the running generation started or last ran a forward; None when none runs, or
        the running one has sent its last update (the worker is only recording it)."""
        with self._cond:
            job = self._running
        if job is None or job.params is None or job._done:
            return None
        since = max(self.last_forward, job.started_at or time.perf_counter())
        return time.perf_counter() - since

    def admit(self) -> Admission:
        """Hold a place for a request, or raise QueueFull when `max_queue` requests already wait (admitted
        or queued) behind a running one. Raises ShuttingDown once the queue has been stopped."""
        if not self.ensure_running():
            raise ShuttingDown()
        if self.pair.unavailable is not None:
            raise PairLost(self.pair.unavailable)
        with self._cond:
            waiting = len(self._pending) + self._admitted + (1 if self._running is not None else 0)
            if waiting > self.max_queue:
                self.metrics.rejected.inc()
                ahead = waiting - (1 if self._running is not None else 0) + 1
                raise QueueFull(max(1, min(600, math.ceil(self._mean_seconds * ahead))))
            self._admitted += 1
        return Admission(self)

    def probe(self, loop: asyncio.AbstractEventLoop) -> Job:
        """A health probe ahead of every waiting job (one at a time: a running probe is shared)."""
        with self._cond:
            if self._probe is None or self._probe._done:
                self._probe = Job(self, next(self._ids), None, loop)
                self._pending.appendleft(self._probe)
                self._cond.notify()
            return self._probe

    def _enqueue(self, params: Params, loop: asyncio.AbstractEventLoop) -> Job:
        with self._cond:
            if self._stopping:
                raise ShuttingDown()
            job = Job(self, next(self._ids), params, loop)
            self._pending.append(job)
            self.metrics.queue_depth.set(len(self._pending))
            self._cond.notify()
        return job

    def _discard(self, job: Job) -> None:
        with self._cond:
            try:
                self._pending.remove(job)
            except ValueError:
                return  # running or finished: the worker sees the flag
            self.metrics.queue_depth.set(len(self._pending))
            self._record(job, "cancelled", 0)

    # ---- worker thread -------------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                job = self._pending.popleft()
                self._running = job
                self.metrics.queue_depth.set(len(self._pending))
            self.metrics.running.set(1)
            try:
                self._run(job)
            except BaseException as err:  # never let the worker die: the job fails, the server goes on
                log.exception("generation %d failed", job.id)
                job._push(Update(error=err))
                self._record(job, "error", 0)
            finally:
                with self._cond:
                    self._running = None
                self.metrics.running.set(0)

    def _run(self, job: Job) -> None:
        if job.params is None:
            self._run_probe(job)
            return
        if job.cancelled:
            self._record(job, "cancelled", 0)
            return
        p = job.params
        job.started_at = time.perf_counter()
        self.metrics.queue_wait.observe(job.started_at - job.enqueued_at)
        text = TextStream(self.tokenizer, p.stop)

        def cancelled() -> bool:  # asked between prefill chunks
            self.last_forward = time.perf_counter()
            return job.cancelled

        generator = self.pair.generate(p, cancelled)
        stats: Stats | None = None
        steps = 0
        finish = "cancelled"
        try:
            for chunk in generator:
                self.last_forward = time.perf_counter()
                if steps == 0:
                    self.metrics.first_token.observe(self.last_forward - job.started_at)
                steps += 1
                stats = chunk.stats
                delta = text.add(chunk.tokens, final=chunk.finish_reason is not None)
                if text.stopped or chunk.finish_reason is not None:
                    finish = "stop" if text.stopped else chunk.finish_reason
                    stats.new_tokens = text.token_count  # tokens past a stop sequence do not count
                    job._push(Update(delta, len(chunk.tokens), finish, self._stats(stats, job)))
                    break
                if job.cancelled:
                    break
                job._push(Update(delta, len(chunk.tokens)))
        except (GenerationError, PairLost) as err:  # a bad request, or the pair's process lost (logged)
            job._push(Update(error=err))
            finish = "error"
        finally:
            generator.close()
        self.metrics.prefix_cache_bytes.set(self.pair.finished())
        if finish == "cancelled" and self._stopping:
            job._push(Update(error=ShuttingDown()))
        if stats is not None:
            self.metrics.prompt_tokens.inc(stats.prompt_tokens)
            self.metrics.cached_tokens.inc(stats.cached_tokens)
            self.metrics.completion_tokens.inc(stats.new_tokens)
            self.metrics.target_calls.inc(stats.target_calls)
            if finish in ("stop", "length") and stats.target_calls:
                self.metrics.tokens_per_step.observe(stats.tokens_per_step)
        self._record(job, finish, steps)

    def _run_probe(self, job: Job) -> None:
        """A one-token forward of each model: proof that the engine computes, for /health."""
        start = time.perf_counter()
        try:
            self.pair.probe()
        except PairLost as err:  # logged when it was lost
            update = Update(error=err)
        except Exception as err:  # reported by /health, not raised: the worker goes on
            log.exception("health probe failed")
            update = Update(error=err)
        else:
            self.last_forward = time.perf_counter()
            self.probe_seconds = self.last_forward - start
            update = Update(finish_reason="stop")
        job._push(update)

    def _stats(self, stats: Stats, job: Job) -> dict:
        out = stats.to_dict()
        sizes, accepted, depths = out.pop("tree_sizes"), out.pop("accepted"), out.pop("tree_depths")
        out["mean_tree_size"] = sum(sizes) / len(sizes) if sizes else 0.0
        out["mean_tree_depth"] = sum(depths) / len(depths) if depths else 0.0
        out["mean_accepted"] = sum(accepted) / len(accepted) if accepted else 0.0
        out["queue_seconds"] = (job.started_at or job.enqueued_at) - job.enqueued_at
        return out

    def _record(self, job: Job, finish: str, steps: int) -> None:
        now = time.perf_counter()
        self.metrics.generations.labels(finish).inc()
        if job.started_at is not None:
            seconds = now - job.started_at
            self.metrics.generation_time.observe(seconds)
            if finish in ("stop", "length"):
                self._mean_seconds = 0.8 * self._mean_seconds + 0.2 * seconds
        self.history.append(JobRecord(job.id, finish, steps, job.enqueued_at, job.started_at, now))


def random_seed() -> int:
    return secrets.randbits(63)
