"""specexec.loading (what a command loads, without argparse) and specexec.cli_args.pair_spec, with the
model loaders replaced by recorders: no model is built here."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
import torch

import specexec.models
from specexec.backends.llamacpp.draft_gguf import DEFAULT_DRAFT_VOCAB as LLAMACPP_DRAFT_VOCAB
from specexec.backends.options import Given, LoadOptions
from specexec.cli_args import OneLineParser, add_model_args, non_negative_int, pair_spec, positive_int
from specexec.loading import (
    LoadedPair,
    PairSpec,
    backend_label,
    draft_backend,
    load_pair,
    target_backend,
)


@pytest.fixture
def chosen(monkeypatch) -> list[tuple]:
    """choose_backend's calls: (requested, source, the options given in the user's words); GGUF sources
    get llamacpp."""
    calls = []

    def choose(requested, source, given):
        torch_options = [option.words for option in given]
        calls.append((requested, source, torch_options))
        if requested == "torch" or torch_options:
            return "torch"
        return "llamacpp" if source.endswith(".gguf") else "torch"

    monkeypatch.setattr(specexec.models, "choose_backend", choose)
    return calls


@pytest.fixture
def loaded(monkeypatch, chosen) -> list[dict]:
    """load_model's calls; tokenizers report a vocabulary of 100 000 ids."""
    calls = []

    def load_model(source, dtype, backend, options):
        calls.append({"source": source, "dtype": dtype, "backend": backend, "options": options})
        return SimpleNamespace(source=source, device=torch.device("cpu"))

    monkeypatch.setattr(specexec.models, "load_model", load_model)
    monkeypatch.setattr(specexec.models, "load_tokenizer", lambda source: [source] * 100_000)
    monkeypatch.setattr(specexec.models, "check_same_vocab", lambda target, draft: None)
    return calls


def test_load_options_say_what_was_given_in_the_users_words() -> None:
    assert LoadOptions(threads=4, vocab=100).given() == []  # every backend takes these
    given = LoadOptions(dtype=torch.float32, quant="int8", ram=0).given()  # a torch.dtype, by name
    assert [(option.key, option.words) for option in given] == [
        ("dtype", "--dtype float32"), ("quant", "--quant int8"), ("ram", "--ram")
    ]  # fmt: skip
    assert LoadOptions(quant="q4_0").given() == [
        Given("gguf_quant", "--draft-quant q4_0", "a GGUF draft requantized by llama.cpp")
    ]


def test_a_draft_loads_with_the_targets_options_less_the_targets_own() -> None:
    target = LoadOptions(dtype="float32", threads=2, offload={}, simulate_offload_gbps=1.0, ram="auto")
    assert target.for_draft() == LoadOptions(dtype="float32", threads=2)


def test_target_backend_names_the_torch_only_options(chosen) -> None:
    load = LoadOptions(dtype="float32", quant="int8", offload={"gpu_memory": "1GiB"})
    target_backend(PairSpec("t.gguf", None, load, backend="llamacpp"))
    target_backend(PairSpec("t.gguf", None, LoadOptions(offload={}, simulate_offload_gbps=2.0)))
    assert chosen == [
        ("llamacpp", "t.gguf", ["--dtype float32", "--quant int8", "--offload"]),
        ("auto", "t.gguf", ["--offload", "--simulate-offload-gbps"]),
    ]


def test_draft_backend_follows_its_own_options_before_the_pairs(chosen) -> None:
    int8 = LoadOptions(quant="int8")
    draft_backend(PairSpec("t", "d.gguf", int8, backend="torch", draft_backend="llamacpp"))
    draft_backend(PairSpec("t", "d.gguf", LoadOptions(quant="int8", offload={}), draft_quant="none"))
    draft_backend(PairSpec("t", "d.gguf", LoadOptions(dtype="bfloat16"), draft_quant="int4"))
    assert chosen == [
        ("llamacpp", "d.gguf", ["--quant int8"]),
        ("auto", "d.gguf", []),  # offloading is the target's alone
        ("auto", "d.gguf", ["--dtype bfloat16", "--quant int4"]),
    ]


def test_a_gguf_quant_is_given_to_the_backend_choice_in_the_users_words(chosen) -> None:
    draft_backend(PairSpec("t", "d.gguf", draft_quant="q4_0"))
    assert chosen == [("auto", "d.gguf", ["--draft-quant q4_0"])]


def test_a_draft_runs_its_own_quantization_else_the_targets(loaded) -> None:
    for spec, quant in [
        (PairSpec("t", "d.gguf"), "none"),
        (PairSpec("t", "d.gguf", draft_quant="q4_0"), "q4_0"),
        (PairSpec("t", "d", LoadOptions(quant="int8")), "int8"),
        (PairSpec("t", "d", LoadOptions(quant="int8"), draft_quant="int4"), "int4"),
    ]:
        loaded.clear()
        load_pair(spec)
        assert loaded[0]["options"].quant == quant, spec  # the draft loads first


def test_a_llamacpp_draft_beside_a_streamed_target_runs_q4_0_unless_told(loaded) -> None:
    for spec, quant in [
        (PairSpec("t.gguf", "d.gguf", LoadOptions(ram=0)), "q4_0"),
        (PairSpec("t.gguf", "d.gguf", LoadOptions(ram=2**29), draft_quant="none"), "none"),
        (PairSpec("t.gguf", "d.gguf", LoadOptions(ram=0), draft_quant="q8_0"), "q8_0"),
        (PairSpec("t.gguf", "d", LoadOptions(ram=0)), "none"),  # a torch draft
        (PairSpec("t.gguf", "d.gguf"), "none"),  # a target in RAM
    ]:
        loaded.clear()
        load_pair(spec)
        assert loaded[0]["options"].quant == quant, spec


def test_backend_label() -> None:
    assert backend_label("torch", None) == "torch"
    assert backend_label("llamacpp", "llamacpp") == "llamacpp"
    assert backend_label("llamacpp", "torch") == "target llamacpp, draft torch"
    assert LoadedPair(None, None, "torch", draft_backend="llamacpp").backend_label == (
        "target torch, draft llamacpp"
    )


def test_load_pair_loads_each_model_as_the_spec_asks(loaded) -> None:
    offload = {"ring_size": 3, "gpu_memory": "2GiB", "codec": None}
    load = LoadOptions(quant="int8", threads=2, offload=offload)
    pair = load_pair(PairSpec("t", "d.gguf", load, draft_quant="none"))
    draft, target = loaded  # the draft loads first: its errors come before the slow target load
    assert draft == {
        "source": "d.gguf", "dtype": None, "backend": "llamacpp",
        "options": LoadOptions(threads=2, vocab=LLAMACPP_DRAFT_VOCAB),  # not the target's offloading
    }  # fmt: skip
    dtype = str(specexec.models.default_dtype()).removeprefix("torch.")
    assert target == {"source": "t", "dtype": dtype, "backend": "torch", "options": load}
    assert (pair.target.source, pair.draft.source) == ("t", "d.gguf")
    assert (pair.target_backend, pair.draft_backend) == ("torch", "llamacpp")
    assert (
        pair.draft_vocab == LLAMACPP_DRAFT_VOCAB and pair.simulated is None and len(pair.tokenizer) == 100_000
    )


def test_load_pair_without_a_draft_and_with_a_fixed_draft_vocab(loaded) -> None:
    pair = load_pair(PairSpec("t.gguf", None))
    assert pair.draft is None and pair.draft_backend is None and pair.backend_label == "llamacpp"
    assert loaded == [{"source": "t.gguf", "dtype": None, "backend": "llamacpp", "options": LoadOptions()}]
    loaded.clear()
    assert load_pair(PairSpec("t", "d.gguf", draft_vocab=500)).draft_vocab == 500
    assert loaded[0]["options"].vocab == 500


def _parse(*argv: str, quant_list: bool = False) -> argparse.Namespace:
    parser = OneLineParser(prog="test")
    add_model_args(parser, quant_list=quant_list)
    return parser.parse_args(list(argv))


def test_pair_spec_carries_every_model_option() -> None:
    args = _parse(
        "--target", "t", "--draft", "d", "--dtype", "float32", "--backend", "torch", "--draft-backend",
        "llamacpp", "--threads", "3", "--quant", "int8", "--draft-quant", "int4", "--draft-vocab", "7",
        "--ring-size", "4", "--gpu-memory", "1GiB", "--quant-offload", "nf4",
        "--simulate-offload-gbps", "2.5",
    )  # fmt: skip
    offload = {"ring_size": 4, "gpu_memory": "1GiB", "codec": "nf4"}
    load = LoadOptions(dtype="float32", quant="int8", threads=3, offload=offload, simulate_offload_gbps=2.5)
    assert pair_spec(args, with_draft=True) == PairSpec(
        target="t", draft="d", load=load, backend="torch", draft_backend="llamacpp", draft_quant="int4",
        draft_vocab=7,
    )  # fmt: skip
    assert pair_spec(args, with_draft=False).draft is None


def test_pair_spec_takes_one_level_of_the_benchs_lists() -> None:
    args = _parse("--quant", "none,int8", "--draft-vocab", "auto,64", quant_list=True)
    spec = pair_spec(args, with_draft=True, quant="int8", draft_vocab=64)
    assert (spec.load.quant, spec.draft_vocab, spec.load.offload) == ("int8", 64, None)
    assert pair_spec(_parse("--offload"), with_draft=True).load.offload == {
        "ring_size": 2, "gpu_memory": None, "codec": None
    }  # fmt: skip


def test_integer_options_say_what_is_wrong(capsys) -> None:
    assert positive_int("3") == 3 and non_negative_int("0") == 0
    with pytest.raises(argparse.ArgumentTypeError, match="must be >= 1, got 0"):
        positive_int("0")
    with pytest.raises(SystemExit):
        _parse("--threads", "x")
    assert capsys.readouterr().err == "test: error: argument --threads: invalid int value: 'x'\n"
