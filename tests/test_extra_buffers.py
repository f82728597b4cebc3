"""The guard on llama.cpp's extra buffer types (AMX tiles, repacked weights): a child that dies is caught
and every model loads without them; a child that succeeds changes nothing; the answer is cached per
library build and CPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from tiny_gguf import write_random_gguf

pytest.importorskip("llama_cpp", reason="the llama.cpp backend needs specexec[llamacpp]")

from specexec.backends.llamacpp import extra_buffers  # noqa: E402
from specexec.backends.llamacpp.extra_buffers import Verdict, cached_verdict, probe  # noqa: E402
from specexec.backends.llamacpp.model import LlamaCppModel  # noqa: E402

DIES_OF_SIGILL = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGILL)"]
SUCCEEDS = [sys.executable, "-c", "pass"]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPECEXEC_CACHE", str(tmp_path / "cache"))
    extra_buffers.extra_buffers_usable.cache_clear()
    yield tmp_path / "cache"
    extra_buffers.extra_buffers_usable.cache_clear()  # the next test asks with the real check again


def test_a_child_killed_by_sigill_is_caught() -> None:
    verdict = probe(DIES_OF_SIGILL)
    assert verdict == Verdict(False, "the check died of SIGILL")


def test_a_child_that_succeeds_is_usable() -> None:
    assert probe(SUCCEEDS) == Verdict(True)


def test_a_child_that_fails_otherwise_gives_its_last_line() -> None:
    failing = [sys.executable, "-c", "import sys; print('first', file=sys.stderr); sys.exit('no model')"]
    assert probe(failing) == Verdict(False, "the check exited with status 1: no model")


def test_the_real_check_decodes_a_block_on_this_host() -> None:
    """The child, on its tiny Q8_0 model, in this build: usable wherever no AMX can fail; on an AMX host
    it is usable when the build carries the fix, and otherwise it died without killing this process."""
    verdict = probe()
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if "amx_tile" not in flags:
        assert verdict == Verdict(True)
    else:
        assert verdict.usable or "SIGILL" in verdict.reason, verdict


def test_a_cached_answer_is_reused_and_a_new_build_asks_again(cache: Path) -> None:
    asked = []

    def ask() -> Verdict:
        asked.append(1)
        return Verdict(False, "the check died of SIGILL")

    assert cached_verdict("build-a", "cpu", ask) == Verdict(False, "the check died of SIGILL")
    assert cached_verdict("build-a", "cpu", ask) == Verdict(False, "the check died of SIGILL")
    assert len(asked) == 1
    assert cached_verdict("build-b", "cpu", ask).usable is False
    assert cached_verdict("build-a", "another cpu", ask).usable is False
    assert len(asked) == 3


def test_the_build_key_follows_the_libraries_bytes(tmp_path: Path) -> None:
    (tmp_path / "libggml-cpu.so").write_bytes(b"one build")
    before = extra_buffers.build_key(tmp_path)
    assert extra_buffers.build_key(tmp_path) == before
    (tmp_path / "libggml-cpu.so").write_bytes(b"another build")
    assert extra_buffers.build_key(tmp_path) != before


def _loaded_with(monkeypatch: pytest.MonkeyPatch, gguf: Path) -> tuple[LlamaCppModel, list[bool]]:
    """A model of `gguf` and the `use_extra_bufts` llama.cpp was asked to load it with."""
    import llama_cpp

    seen: list[bool] = []
    load = llama_cpp.llama_model_load_from_file

    def spy(path, params):
        seen.append(bool(params.use_extra_bufts))
        return load(path, params)

    monkeypatch.setattr(llama_cpp, "llama_model_load_from_file", spy)
    return LlamaCppModel(gguf, threads=1), seen


@pytest.mark.parametrize("child", ["dies", "succeeds"])
def test_the_backend_loads_without_extra_buffers_where_the_check_fails(
    child: str, cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    gguf = write_random_gguf(tmp_path / "tiny.gguf", "llama", "q8_0")
    command = DIES_OF_SIGILL if child == "dies" else SUCCEEDS
    monkeypatch.setattr(extra_buffers, "probe", lambda: probe(command))
    model, seen = _loaded_with(monkeypatch, gguf)
    usable = child == "succeeds"
    assert seen == [usable] and model.extra_buffers is usable
    assert model.cost_key().count(":plain-buffers") == (not usable)
    err = capsys.readouterr().err
    if usable:
        assert "specexec:" not in err  # the negative control: nothing changes, nothing said
    else:
        (line,) = [line for line in err.splitlines() if line.startswith("specexec:")]
        assert "the check died of SIGILL" in line and "without them" in line
        assert "llama_cpp_build.cmake" in line and "--force-reinstall --no-cache-dir" in line
        LlamaCppModel(gguf, threads=1)  # a second model: the same answer, no second line
        assert "specexec:" not in capsys.readouterr().err


def test_the_bench_peers_follow_the_check(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import llama_cpp

    from specexec.bench.llamacpp import LlamaCpp, LlamaCppSpeculative

    target = write_random_gguf(tmp_path / "target.gguf", "llama", "q8_0")
    draft = write_random_gguf(tmp_path / "draft.gguf", "llama", "q8_0", noise=0.05)
    seen: list[bool] = []
    load = llama_cpp.llama_cpp.llama_model_load_from_file

    def spy(path, params):
        seen.append(bool(params.use_extra_bufts))
        return load(path, params)

    monkeypatch.setattr(llama_cpp.llama_cpp, "llama_model_load_from_file", spy)
    monkeypatch.setattr(llama_cpp._internals.llama_cpp, "llama_model_load_from_file", spy)
    monkeypatch.setattr(extra_buffers, "probe", lambda: probe(DIES_OF_SIGILL))
    plain = LlamaCpp(target, context=64, threads=1)
    speculative = LlamaCppSpeculative(target, draft, context=64, threads=1)
    assert seen == [False, False, False]  # plain's target, then the draft and the target
    eos = [127]
    for record in (
        plain.run([3, 17, 42], 4, 0, eos, temperature=0.0, top_p=1.0, top_k=0),
        speculative.run([3, 17, 42], 4, 0, eos, draft_length=3, temperature=0.0, top_p=1.0, top_k=0),
    ):
        assert record["hf_settings"]["extra_buffers"] is False
        assert record["hf_settings"]["amx"] is False

    extra_buffers.extra_buffers_usable.cache_clear()
    (cache / extra_buffers.CACHE_FILE).unlink()  # as after a rebuild that works
    monkeypatch.setattr(extra_buffers, "probe", lambda: probe(SUCCEEDS))
    seen.clear()
    assert LlamaCpp(target, context=64, threads=1).extra_buffers is True
    assert seen == [True]


def test_the_report_says_whether_repacking_and_amx_were_on() -> None:
    from specexec.bench.report import markdown

    off = {"llama_cpp_python": "0.3.36", "extra_buffers": False, "amx": False}
    on = {"llama_cpp_python": "0.3.36", "extra_buffers": True, "amx": True}
    assert "llama-cpp-python 0.3.36, repacked kernels off, no AMX;" in markdown(
        [], {"llama_cpp": off}, plots=False
    )
    assert "repacked kernels on, AMX;" in markdown([], {"llama_cpp": on}, plots=False)
    assert "repacked" not in markdown([], {}, plots=False)  # llama.cpp did not run
