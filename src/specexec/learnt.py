"""What the auto policies learn, kept across generations (and across processes, in a file per pair)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from specexec.budget.chains import ChainCostStop
from specexec.budget.trees import AutoBudget

LEARNT_FORMAT = 2  # a saved `LearntPolicies` file of another format is ignored
Policy = TypeVar("Policy", AutoBudget, ChainCostStop)


class LearntPolicies:
    """What the auto budgets learn (acceptance rates, the speculation gate and the achieved rate λ, the
    target's pace against the calibration), kept across generations.

    Pass the same object to every `stream` call that should share it (a server, a benchmark): each generation
    then starts from what the ones before it learnt, instead of from the draft's own probabilities and an open
    gate, and does not pay again to find out that drafting loses on this kind of text (measured on MT-Bench,
    docs/benchmarks-history.md). One policy per model pair, method, sampling rule and cost model; generations
    sharing one must not run at the same time.

    With `path` (one file per model pair: `calibration.persisted_policies`), policies start from what
    `save` last wrote there, so a new process (one `specexec generate`) starts where the last one
    stopped. A file that cannot be read is ignored: the policies then start fresh.
    """

    def __init__(self, path: str | os.PathLike | None = None) -> None:
        self._policies: dict[tuple, AutoBudget | ChainCostStop] = {}
        self.path = Path(path) if path is not None else None
        self._saved: dict[str, dict] = {}
        if self.path is not None and self.path.is_file():
            try:
                data = json.loads(self.path.read_text())
                if data.get("format") == LEARNT_FORMAT:
                    self._saved = dict(data["policies"])
            except (OSError, ValueError, KeyError, AttributeError, TypeError):
                self._saved = {}

    def get(self, pair: tuple, setting: tuple, make: Callable[[], Policy]) -> Policy:
        """The policy kept for `pair` (the models' identities in this process) and `setting` (method,
        sampling, cost model: what a saved policy is found by), made by `make()` the first time."""
        key = (pair, setting)
        if key not in self._policies:
            policy = make()
            saved = self._saved.get(repr(setting))
            if saved is not None:
                try:
                    policy.restore_pace(float(saved.get("pace", 1.0)))  # before λ: it prices the gate
                    policy.acceptance.restore(saved["acceptance"])
                    policy.gate.restore(saved["gate"])
                except (KeyError, TypeError, ValueError):  # a damaged entry: start fresh
                    policy = make()
            self._policies[key] = policy
        return self._policies[key]  # type: ignore[return-value]

    def save(self) -> None:
        """Write every policy's state to `path` (atomically; settings not used here are kept)."""
        if self.path is None or not self._policies:
            return
        states = dict(self._saved)
        for (_, setting), policy in self._policies.items():
            states[repr(setting)] = {
                "acceptance": policy.acceptance.state(),
                "gate": policy.gate.state(),
                "pace": policy.pace.factor,
            }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(f"{self.path.name}.{os.getpid()}.partial")
        partial.write_text(json.dumps({"format": LEARNT_FORMAT, "policies": states}))
        os.replace(partial, self.path)
        self._saved = states
