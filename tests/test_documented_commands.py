"""Every command the README and docs/ show: its options exist, and each command form runs at its defaults.

The forms run on a tiny tokenized GGUF pair the test writes (test_models.write_tiny_gguf), with the
documented options kept and only what names the models, the prompts, the output folder and the sizes
replaced: no --threads unless the docs give one, the default budgets, methods as written.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from specexec.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND = re.compile(
    r"(?:specexec|python -m specexec\.bench)\s+(generate|bench|calibrate|serve|worker)?\b([^`\n]*)"
)


def documented_commands(text: str) -> list[tuple[str, str]]:
    """(subcommand, the rest of the line) of every `specexec SUB ...` in `text`'s code: fenced blocks
    (continuation lines joined) and inline code spans."""
    code = re.findall(r"```[a-z]*\n(.*?)```", text, re.S) + re.findall(r"`([^`\n]+)`", text)
    found = []
    for span in code:
        for line in span.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s#.*", "", line)  # a shell comment is prose
            for match in COMMAND.finditer(line):
                sub = match.group(1) or ("bench" if "specexec.bench" in match.group(0) else None)
                if sub:
                    found.append((sub, match.group(2)))
    return found


def unknown_options(text: str) -> list[str]:
    """The options `text`'s commands use that their subcommand's --help does not list."""
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.choices and "generate" in a.choices).choices
    known = {sub: set(p._option_string_actions) for sub, p in subparsers.items()}
    return [
        f"specexec {sub} {option}"
        for sub, rest in documented_commands(text)
        for option in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", rest)
        if option not in known[sub]
    ]


def test_every_option_the_docs_show_is_in_help() -> None:
    commands = [c for doc in DOCS for c in documented_commands(doc.read_text())]
    assert len(commands) > 20 and {sub for sub, _ in commands} == {
        "generate",
        "bench",
        "calibrate",
        "serve",
        "worker",
    }
    unknown = {f"{doc.name}: {u}" for doc in DOCS for u in unknown_options(doc.read_text())}
    assert not unknown, sorted(unknown)


def test_an_option_help_does_not_list_is_found() -> None:
    text = (
        "```bash\nspecexec bench --methods ar \\\n  --no-such-option 3\n```\nor `specexec generate --ramm 0`"
    )
    assert unknown_options(text) == ["specexec bench --no-such-option", "specexec generate --ramm"]


# Each form: the document, the command as it shows it (checked to be still there), and the options the
# run keeps from it. SIZE stands for a --ram size that makes the tiny target stream part of its weights.
FORMS = [
    ("README.md", "specexec generate --max-new-tokens 96 'def quicksort(arr):'", ["generate"]),
    (
        "bigger-than-ram.md",
        'specexec generate --ram 512MiB "def quicksort(xs):"',
        ["generate", "--ram", "SIZE"],
    ),
    ("bigger-than-ram.md", 'specexec generate --ram 0 "def quicksort(xs):"', ["generate", "--ram", "0"]),
    ("bigger-than-ram.md", "--ram auto", ["generate", "--ram", "auto"]),
    ("README.md", "specexec calibrate [--target SRC] [--draft SRC]", ["calibrate"]),
    ("bigger-than-ram.md", "specexec calibrate --ram 512MiB", ["calibrate", "--ram", "SIZE"]),
    (
        "bigger-than-ram.md",
        "specexec bench --ram 512MiB --methods ar,llamacpp,llamacpp-spec,specexec",
        ["bench", "--ram", "SIZE", "--methods", "ar,llamacpp,llamacpp-spec,specexec"],
    ),
    ("bigger-than-ram.md", "specexec bench", ["bench", "--ram", "0", "--methods", "ar,llamacpp-spec"]),
    ("bigger-than-ram.md", "specexec bench", ["bench", "--ram", "auto", "--methods", "ar,llamacpp"]),
    (
        "benchmarks.md",
        "--methods ar,llamacpp,specexec,dsl",
        ["bench", "--methods", "ar,llamacpp,specexec,dsl"],
    ),
]


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("documented") / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "ab a"}) + "\n")
    return path


def tiny_pair(folder: Path) -> tuple[Path, Path]:
    """A tiny tokenized target written in `folder`, and its draft (a copy: mapped apart). Written, not
    copied: a copied file's pages did not leave RAM when --ram 0 asked them to."""
    from test_models import write_tiny_gguf
    from tiny_gguf import synced

    target = folder / "target.gguf"
    write_tiny_gguf(target)
    return synced(target), Path(shutil.copy(target, folder / "draft.gguf"))


def _argv(form: list[str], prompts: Path, folder: Path) -> list[str]:
    """The form's command on a tiny pair of its own in `folder`."""
    from specexec.backends.llamacpp import least_ram

    target, draft = tiny_pair(folder)
    argv = [str(least_ram(target)) if word == "SIZE" else word for word in form]
    argv += ["--target", str(target), "--draft", str(draft)]
    if form[0] == "generate":
        argv += ["--max-new-tokens", "4", "ab a"]
    if form[0] == "bench":
        argv += ["--prompts", str(prompts), "--max-new-tokens", "4", "--warmup-tokens", "2"]
        argv += ["--no-progress", "--out", str(folder / "out")]
    return argv


@pytest.mark.parametrize("doc, shown, form", FORMS, ids=[" ".join(f[2]) for f in FORMS])
def test_each_documented_form_runs_at_its_defaults(
    doc: str, shown: str, form: list[str], prompts: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("llama_cpp", reason="the documented forms run on the default llama.cpp backend")
    from tiny_gguf import on_storage

    from specexec.cli import main

    path = ROOT / doc if doc == "README.md" else ROOT / "docs" / doc
    assert shown in path.read_text(), f"{doc} no longer shows {shown!r}: update FORMS"
    if "--ram" in form and form[form.index("--ram") + 1] in ("SIZE", "0") and not on_storage(tmp_path):
        pytest.skip("streaming needs a file system whose pages can be evicted (not tmpfs)")
    monkeypatch.setenv("SPECEXEC_CACHE", str(tmp_path / "cache"))
    assert main(_argv(form, prompts, tmp_path)) == 0


def test_serve_runs_at_its_defaults_with_ram(tmp_path: Path) -> None:
    """docs/bigger-than-ram.md's `specexec serve --ram 12GiB ...`: it comes up and answers."""
    import httpx

    assert "specexec serve --ram 12GiB" in (ROOT / "docs" / "bigger-than-ram.md").read_text()
    pytest.importorskip("llama_cpp", reason="the documented forms run on the default llama.cpp backend")
    pytest.importorskip("fastapi", reason="the server needs specexec[server]")
    from server_helpers import wait_serving

    target, draft = tiny_pair(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = ["serve", "--ram", "12GiB", "--target", str(target), "--draft", str(draft), "--port", str(port)]
    env = {"SPECEXEC_CACHE": str(tmp_path / "cache")}
    script = "import sys; from specexec.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.Popen(
        [sys.executable, "-c", script, *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, **env},
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        wait_serving(proc, url, 180)
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        request = {"model": model, "prompt": "ab a", "max_tokens": 4}
        reply = httpx.post(url + "/v1/completions", json=request, timeout=60)
        assert reply.status_code == 200, reply.text
        assert isinstance(reply.json()["choices"][0]["text"], str)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
