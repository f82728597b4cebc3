"""`specexec bench`: schema, greedy identity with ar, outputs, interleaving, seeds and errors, on tiny models.

The models are tiny random Qwen2s in float32. Their weights are drawn with a large initializer range so
next-token distributions are peaked (no near-ties: greedy outputs must match exactly across methods and
across Hugging Face's own cache), and the draft is the target with a little weight noise, so drafts are
partly accepted and the speculative methods take more than one token per target call.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from specexec.bench import (
    BenchConfig,
    BenchError,
    machine_info,
    make_configs,
    parse_budgets,
    parse_methods,
    read_records,
    run_benchmark,
    summarize,
    write_outputs,
)
from specexec.bench.cli import main
from specexec.bench.report import markdown
from specexec.prompts import Prompt, load_prompts

VOCAB = 128
EOS = 1
NEW = 24
REQUIRED = {
    "method": str,
    "budget": (int, type(None)),
    "temperature": float,
    "prompts": int,
    "new_tokens": int,
    "target_calls": int,
    "tokens_per_step": float,
    "tok_per_s": float,
    "tok_per_s_with_prefill": float,
    "speedup_vs_ar": float,
    "identical_to_ar": bool,
}
FLOATS = (
    "tokens_per_step_mean",
    "prefill_seconds",
    "decode_seconds",
    "wall_seconds",
    "draft_seconds",
    "target_seconds",
    "overhead_seconds",
    "draft_share",
    "target_share",
    "overhead_share",
    "identical_prompts_fraction",
    "matching_prefix_fraction",
)
MACHINE = ("cpu_model", "cpu_count", "torch_threads", "torch", "transformers", "dtype", "date", "command")


def tiny_qwen2(seed: int = 0) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.5,  # peaked distributions: clear greedy margins
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).eval()


def noisy_copy(model: Qwen2ForCausalLM, noise: float = 0.05, seed: int = 1) -> Qwen2ForCausalLM:
    """The model plus Gaussian weight noise of `noise` times each tensor's std: a partly agreeing draft."""
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in draft.parameters():
            if param.numel() > 1:
                param.add_(torch.randn(param.shape, generator=gen) * param.std() * noise)
    return draft.eval()


@pytest.fixture(scope="module")
def target() -> Qwen2ForCausalLM:
    return tiny_qwen2(seed=0)


@pytest.fixture(scope="module")
def draft(target: Qwen2ForCausalLM) -> Qwen2ForCausalLM:
    return noisy_copy(target)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    """Word-level: "[UNK]" = 0, "<eos>" = 1, "w2" .. "w127" = 2 .. 127."""
    words = ["[UNK]", "<eos>", *(f"w{i}" for i in range(2, VOCAB))]
    backend = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="<eos>")


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Repeated phrases give prompt lookup something to match.
    lines = []
    for i in range(3):
        phrase = " ".join(f"w{(7 * i + 3 * j) % 120 + 2}" for j in range(8))
        lines.append(json.dumps({"prompt": f"{phrase} w{40 + i} {phrase}"}))
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def prompts(tokenizer: PreTrainedTokenizerFast, prompt_file: Path) -> list[Prompt]:
    return load_prompts(str(prompt_file), tokenizer)


@pytest.fixture(scope="module")
def greedy(target, draft, tokenizer, prompts):
    configs = make_configs(
        ["sd", "specexec", "hf-assisted", "hf-lookup"], [4, 16], sd_budgets=[2], expand=4, width=4
    )
    result = run_benchmark(
        target, draft, tokenizer, prompts, configs, max_new_tokens=NEW, warmup_tokens=4, progress=False
    )
    return configs, result


def test_configs_expand_methods_and_budgets() -> None:
    configs = make_configs(
        ["specexec", "sd", "hf-lookup", "specinfer"], [16, 64], sd_budgets=[2], specinfer_budgets=[8]
    )
    labels = [c.label for c in configs]
    assert labels == ["ar", "specexec@16", "specexec@64", "sd@2", "hf-lookup", "specinfer@8"]
    assert configs[1].expand == 32 and configs[1].width == 8 and configs[-1].branches == 4
    assert [c.label for c in make_configs(["specinfer"], [16, 64])] == ["ar", "specinfer@16", "specinfer@64"]
    # dsl is sized by cost unless told otherwise; an integer is its longest confidence-stopped chain.
    assert [c.label for c in make_configs(["dsl"])] == ["ar", "dsl@auto"]
    assert [c.label for c in make_configs(["dsl"], dsl_budgets=["auto", 20])] == ["ar", "dsl@auto", "dsl@20"]
    with pytest.raises(BenchError, match="'auto' is for specexec and dsl"):
        make_configs(["sd"], sd_budgets=["auto"])


def test_schema(greedy) -> None:
    configs, result = greedy
    rows = result.rows
    assert [r["label"] for r in rows] == [c.label for c in configs]
    assert [r["label"] for r in rows] == [
        "ar",
        "sd@2",
        "specexec@4",
        "specexec@16",
        "hf-assisted",
        "hf-lookup",
    ]
    for row in rows:
        for key, kind in REQUIRED.items():
            assert isinstance(row[key], kind), (row["label"], key, row[key])
        for key in FLOATS:
            assert isinstance(row[key], float), (row["label"], key, row[key])
        assert row["prompts"] == 3
        assert row["temperature"] == 0.0
        assert row["new_tokens"] > 0 and row["target_calls"] > 0
        assert row["tokens_per_step"] == pytest.approx(row["new_tokens"] / row["target_calls"])
        assert row["tok_per_s"] == pytest.approx(row["new_tokens"] / row["decode_seconds"])
        assert row["tok_per_s_with_prefill"] == pytest.approx(row["new_tokens"] / row["wall_seconds"])
        assert row["tok_per_s_with_prefill"] <= row["tok_per_s"]
        assert row["tok_per_s_target_bound"] == pytest.approx(row["new_tokens"] / row["target_seconds"])
        assert row["tok_per_s_target_bound"] > row["tok_per_s"], "decoding holds more than target forwards"
        assert row["draft_share"] + row["target_share"] + row["overhead_share"] == pytest.approx(
            1.0, abs=1e-6
        )
    by_label = {r["label"]: r for r in rows}
    assert by_label["ar"]["tokens_per_step"] == 1.0 and by_label["ar"]["speedup_vs_ar"] == 1.0
    assert by_label["ar"]["draft_calls"] == 0 and by_label["ar"]["mean_tree_size"] == 0.0
    assert by_label["specexec@16"]["tokens_per_step"] > 1.0, "a partly agreeing draft is accepted"
    assert by_label["hf-assisted"]["tokens_per_step"] > 1.0
    assert by_label["hf-assisted"]["draft_calls"] > 0 and by_label["hf-lookup"]["draft_calls"] == 0
    assert by_label["hf-assisted"]["prefill_timing"] == "separate-forward"
    assert 4 < by_label["specexec@16"]["mean_tree_size"] <= 16  # smaller near the end of the output
    assert by_label["sd@2"]["mean_tree_depth"] <= 2
    assert 0 < by_label["hf-lookup"]["mean_tree_size"] <= 10  # prompt_lookup_num_tokens=10


def test_greedy_float32_is_identical_to_ar(greedy) -> None:
    _, result = greedy
    for row in result.rows:
        assert row["identical_to_ar"] is True, row["label"]
        assert row["identical_prompts_fraction"] == 1.0
        assert row["matching_prefix_fraction"] == 1.0


def test_records_stream_to_a_file(target, draft, tokenizer, prompts, tmp_path: Path) -> None:
    configs = [BenchConfig("ar"), BenchConfig("sd", 2)]
    path = tmp_path / "live.jsonl"
    result = run_benchmark(
        target, draft, tokenizer, prompts[:2], configs, max_new_tokens=4, warmup_tokens=0,
        progress=False, records_path=path,
    )  # fmt: skip
    live = read_records(path)  # in run order: prompt 1 starts with sd@2
    assert [r["label"] for r in live] == ["ar", "sd@2", "sd@2", "ar"]
    assert sorted(live, key=lambda r: (r["prompt_index"], r["method"])) == result.records


def test_repeats_time_the_same_runs_again(target, draft, tokenizer, prompts, tmp_path: Path) -> None:
    configs = [BenchConfig("ar"), BenchConfig("sd", 2), BenchConfig("specexec", 4)]
    path = tmp_path / "live.jsonl"
    result = run_benchmark(
        target, draft, tokenizer, prompts[:2], configs, max_new_tokens=4, warmup_tokens=0,
        progress=False, records_path=path, repeats=3,
    )  # fmt: skip
    live = read_records(path)
    assert len(live) == 3 * 2 * 3
    orders = [[r["label"] for r in live[i : i + 3]] for i in range(0, len(live), 3)]
    forward = [["ar", "sd@2", "specexec@4"], ["sd@2", "specexec@4", "ar"]]  # rotated per prompt
    assert orders == forward + [o[::-1] for o in forward] + forward
    assert [r["repeat"] for r in live] == [0] * 6 + [1] * 6 + [2] * 6
    first = {(r["label"], r["prompt_index"]): r["tokens"] for r in live if r["repeat"] == 0}
    assert all(r["tokens"] == first[r["label"], r["prompt_index"]] for r in live)  # same seed, same tokens
    single = run_benchmark(
        target, draft, tokenizer, prompts[:2], configs, max_new_tokens=4, warmup_tokens=0, progress=False,
    )  # fmt: skip
    for row, once in zip(result.rows, single.rows, strict=True):
        assert (row["prompts"], row["repeats"], once["repeats"]) == (2, 3, 1)
        assert row["new_tokens"] == 3 * once["new_tokens"] and row["target_calls"] == 3 * once["target_calls"]
        assert row["tokens_per_step"] == once["tokens_per_step"]
        assert row["identical_to_ar"] is True
    # A stall in one repeat: the totals slow down, the faster-repeat figure keeps the other repeats.
    stalled = [{**r, "decode_seconds": r["decode_seconds"] + 10.0 * (r["repeat"] == 1)} for r in live]
    fastest = {}
    for r in stalled:
        key = (r["label"], r["prompt_index"])
        fastest[key] = min(fastest.get(key, r["decode_seconds"]), r["decode_seconds"])
    for row in summarize(stalled):
        seconds = sum(t for (label, _), t in fastest.items() if label == row["label"])
        assert row["tok_per_s_faster_repeat"] == pytest.approx(row["new_tokens"] / 3 / seconds)
        assert row["tok_per_s"] < row["tok_per_s_faster_repeat"]
    with pytest.raises(BenchError, match="repeats must be >= 1"):
        run_benchmark(target, draft, tokenizer, prompts[:1], configs, repeats=0, progress=False)


def test_auto_budgets_report_the_target_pace(
    target, draft, tokenizer, prompts, tmp_path, monkeypatch
) -> None:
    """An auto budget on a calibration records, per generation, how its target ran against it; the
    report gives the range (the tiny models' own calibration, measured first)."""
    monkeypatch.setenv("SPECEXEC_CACHE", str(tmp_path))
    configs = [BenchConfig("ar"), BenchConfig("specexec", "auto")]
    result = run_benchmark(
        target, draft, tokenizer, prompts[:2], configs, max_new_tokens=8, warmup_tokens=0, progress=False
    )
    paces = [r["target_pace"] for r in result.records if r["label"] == "specexec@auto"]
    assert len(paces) == 2 and all(0.25 <= pace <= 4.0 for pace in paces)
    assert all(r["target_pace"] is None for r in result.records if r["label"] == "ar")
    row = next(row for row in result.rows if row["label"] == "specexec@auto")
    assert row["target_pace"] == [min(paces), max(paces)]
    assert f"specexec@auto {min(paces):.2f}-{max(paces):.2f}" in markdown(result.rows, {}, plots=False)


def test_paired_speedup_is_the_median_ratio_within_passes(greedy) -> None:
    """Passes drift (every other one 3x slower, both methods alike) and one pass of `fast` stalls: the
    paired figure is still the 2x that every other pass shows, while the ratio of totals is not."""
    _, result = greedy
    template = next(r for r in result.records if r["method"] == "ar")
    records = []
    for repeat in range(5):
        drift = 3.0 if repeat % 2 else 1.0
        stall = 20.0 if repeat == 2 else 1.0
        for label, method, seconds in (("ar", "ar", 1.0), ("fast", "sd", 0.5 * stall)):
            record = {**template, "label": label, "method": method, "prompt_index": 0, "repeat": repeat}
            records.append({**record, "new_tokens": 10, "decode_seconds": seconds * drift})
    ar, fast = summarize(records)
    assert ar["speedup_vs_ar_paired"] == pytest.approx(1.0)
    assert fast["speedup_vs_ar_paired"] == pytest.approx(2.0)
    assert fast["speedup_vs_ar"] == pytest.approx(9.0 / (0.5 * 8.0 + 10.0))  # totals: 9 s against 14 s
    assert "| paired vs ar |" in markdown(summarize(records), {}, plots=False)


def test_records_interleaving_and_recompute(greedy, tmp_path: Path) -> None:
    configs, result = greedy
    records = result.records
    assert len(records) == 3 * len(configs), "warm-up runs are not recorded"
    for index in range(3):
        mine = sorted((r for r in records if r["prompt_index"] == index), key=lambda r: r["order"])
        assert [r["label"] for r in mine] == [c.label for c in configs[index:] + configs[:index]]
        assert {r["seed"] for r in mine} == {index}
    for record in records:
        assert record["new_tokens"] == len(record["tokens"])
        assert record["finish_reason"] in ("stop", "length")
        assert record["finish_reason"] == "length" or record["tokens"][-1] == EOS
        assert record["prefill_seconds"] + record["decode_seconds"] <= record["wall_seconds"] + 1e-6
        assert record["prefill_seconds"] > 0
        assert 0 <= record["draft_seconds"] + record["target_seconds"] <= record["decode_seconds"] + 1e-6

    machine = machine_info(dtype="float32", command="specexec bench --test", target="t", draft="d")
    paths = write_outputs(tmp_path, result.records, result.rows, machine)
    assert summarize(read_records(paths["records.jsonl"])) == result.rows
    saved = json.loads(paths["results.json"].read_text())
    assert isinstance(saved, list) and len(saved) == len(configs)
    for row, saved_row in zip(result.rows, saved, strict=True):
        assert {k: v for k, v in saved_row.items() if k != "machine"} == row
        assert all(key in saved_row["machine"] for key in MACHINE)
        assert saved_row["machine"]["command"] == "specexec bench --test"
    text = paths["results.md"].read_text()
    assert "| config |" in text and "specexec bench --test" in text
    for config in configs:
        assert f"| {config.label} |" in text
    for name in ("tokens_per_step.png", "tok_per_s.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sampling_is_seeded_and_not_compared(target, draft, tokenizer, prompts) -> None:
    configs = make_configs(["specexec", "hf-assisted", "hf-lookup"], [8], expand=4, width=4)

    def run():
        return run_benchmark(
            target,
            draft,
            tokenizer,
            prompts[:2],
            configs,
            max_new_tokens=12,
            temperature=0.8,
            top_p=0.9,
            top_k=20,
            seed=5,
            warmup_tokens=0,
            progress=False,
        )

    first, second = run(), run()
    assert [r["tokens"] for r in first.records] == [r["tokens"] for r in second.records]
    for row in first.rows:
        assert row["temperature"] == 0.8 and row["top_p"] == 0.9 and row["top_k"] == 20
        assert row["identical_to_ar"] is None and row["matching_prefix_fraction"] is None
        assert isinstance(row["speedup_vs_ar"], float)


def test_hf_ignores_checkpoint_generation_defaults(target, draft, tokenizer, prompts) -> None:
    """A checkpoint's sampling defaults must not leak into hf-* runs; the assistant keeps HF's defaults."""
    target.generation_config.repetition_penalty = 5.0
    draft.generation_config.num_assistant_tokens = 1
    try:
        configs = [BenchConfig("ar"), BenchConfig("hf-assisted"), BenchConfig("hf-lookup")]
        result = run_benchmark(
            target,
            draft,
            tokenizer,
            prompts[:1],
            configs,
            max_new_tokens=NEW,
            warmup_tokens=0,
            progress=False,
        )
        assert all(row["identical_to_ar"] for row in result.rows)
        assisted = next(r for r in result.records if r["method"] == "hf-assisted")
        assert max(assisted["tree_sizes"]) > 1, "num_assistant_tokens stayed at the default 20"
        assert target.generation_config.repetition_penalty == 5.0, "restored afterwards"
        assert draft.generation_config.num_assistant_tokens == 1
    finally:
        target.generation_config.repetition_penalty = None
        draft.generation_config.num_assistant_tokens = None


def test_api_errors(target, draft, tokenizer, prompts) -> None:
    assert issubclass(BenchError, ValueError)
    assert parse_methods("ar, specexec,ar") == ["ar", "specexec"]
    assert parse_budgets("64,16,64") == [16, 64]
    with pytest.raises(BenchError, match="unknown method 'beam'"):
        parse_methods("ar,beam")
    for bad in ("16,x", "0", "", "16,,64", "-4"):
        with pytest.raises(BenchError):
            parse_budgets(bad)
    with pytest.raises(BenchError, match="takes no budget"):
        BenchConfig("ar", 4)
    with pytest.raises(BenchError, match="needs a budget"):
        BenchConfig("specexec")
    with pytest.raises(BenchError, match="expand"):
        make_configs(["specexec"], [16], expand=0)
    with pytest.raises(BenchError, match="takes no width"):
        BenchConfig("sd", 4, width=2)
    assert BenchConfig("specexec", 4) == BenchConfig("specexec", 4, expand=32, width=8)

    def bench(**kwargs):
        args = {"target": target, "draft": draft, "tokenizer": tokenizer, "prompts": prompts}
        args.update(kwargs)
        configs = args.pop("configs", [BenchConfig("ar"), BenchConfig("specexec", 4)])
        return run_benchmark(configs=configs, max_new_tokens=4, progress=False, **args)

    with pytest.raises(BenchError, match="need a draft"):
        bench(draft=None)
    with pytest.raises(BenchError, match="no prompts"):
        bench(prompts=[])
    with pytest.raises(BenchError, match="temperature"):
        bench(temperature=-1.0)
    with pytest.raises(BenchError, match="context window"):
        bench(prompts=[Prompt("long", "", [2] * 1022)])
    with pytest.raises(BenchError, match="labelled 'ar'"):
        bench(configs=[BenchConfig("ar"), BenchConfig("ar")])
    with pytest.raises(BenchError, match="labelled 'specexec@4'"):
        bench(configs=[BenchConfig("specexec", 4), BenchConfig("specexec", 4, width=2)])


@pytest.fixture
def model_dirs(target, draft, tokenizer, tmp_path_factory, monkeypatch) -> tuple[Path, Path]:
    """The tiny pair saved as model folders, for the command line.

    `AutoTokenizer` picks the tokenizer class from config.json's model type (Qwen2's byte-level BPE), which
    cannot rebuild the word-level test tokenizer, so folders load the fixture tokenizer instead.
    """
    import specexec.models

    root = tmp_path_factory.mktemp("models")
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(root / name)
    real = specexec.models.load_tokenizer
    monkeypatch.setattr(
        specexec.models, "load_tokenizer", lambda source: tokenizer if Path(source).is_dir() else real(source)
    )
    return root / "target", root / "draft"


def test_cli_end_to_end(model_dirs, prompt_file: Path, tmp_path: Path, capsys) -> None:
    target_dir, draft_dir = model_dirs
    argv = [
        "--target", str(target_dir), "--draft", str(draft_dir), "--dtype", "float32",
        "--prompts", str(prompt_file), "--n-prompts", "2", "--max-new-tokens", "12",
        "--methods", "specexec,hf-lookup", "--budgets", "4", "--expand", "4", "--width", "2",
        "--warmup-tokens", "2", "--no-progress", "--out", str(tmp_path / "out"),
    ]  # fmt: skip
    assert main(argv) == 0
    rows = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [r["label"] for r in rows] == ["ar", "specexec@4", "hf-lookup"]
    assert all(r["identical_to_ar"] and r["prompts"] == 2 for r in rows)
    assert rows[1]["expand"] == 4 and rows[1]["width"] == 2
    machine = rows[0]["machine"]
    assert machine["command"].startswith("specexec bench --target") and machine["dtype"] == "float32"
    assert machine["target"] == str(target_dir) and machine["prompt_set"] == str(prompt_file)
    for name in ("results.md", "records.jsonl", "tokens_per_step.png", "tok_per_s.png"):
        assert (tmp_path / "out" / name).is_file()
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--methods", "ar,beam"], "unknown method 'beam'"),
        (["--budgets", "16,abc"], "'abc' is not an integer"),
        (["--sd-budgets", "0"], "budgets must be >= 1"),
        (["--n-prompts", "0"], "must be >= 1"),
    ],
)
def test_cli_usage_errors(args: list[str], message: str, tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prompts", "no-such-set"], "unknown prompt set 'no-such-set'"),
        (["--target", "MISSING"], "model path does not exist"),
        (["--draft", "MISSING"], "model path does not exist"),
        (["--draft-vocab", "1000000"], "--draft-vocab must be between 1 and"),
    ],
)
def test_cli_errors_are_one_line(
    args: list[str], message: str, model_dirs, prompt_file: Path, tmp_path: Path, capsys
) -> None:
    target_dir, draft_dir = model_dirs
    argv = ["--target", str(target_dir), "--draft", str(draft_dir), "--prompts", str(prompt_file)]
    argv += [str(tmp_path / "missing") if a == "MISSING" else a for a in args]
    assert main([*argv, "--n-prompts", "1", "--no-progress", "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("specexec: error: ") and err.count("\n") == 1 and message in err
    assert not (tmp_path / "out").exists()


def test_configs_per_quantization_level_and_ngram() -> None:
    configs = make_configs(
        ["specexec", "llamacpp"], [8], quants=["none", "int4"], ngrams=[0, 6], expand=4, width=4
    )
    assert [c.label for c in configs] == [
        "ar",
        "specexec@8",
        "specexec@8+ngram6",
        "llamacpp",
        "ar/int4",
        "specexec@8/int4",
        "specexec@8+ngram6/int4",
    ]
    with pytest.raises(BenchError, match="quantization"):
        BenchConfig("ar", quant="int3")
    with pytest.raises(BenchError, match="own GGUF"):
        BenchConfig("llamacpp", quant="int8")
    with pytest.raises(BenchError, match="takes no ngram"):
        BenchConfig("sd", 2, ngram=4)


def test_draft_vocabularies_compared_in_one_run(model_dirs, prompt_file: Path, tmp_path: Path) -> None:
    configs = make_configs(["sd", "specexec", "llamacpp"], [8], sd_budgets=[2], draft_vocabs=[0, 64])
    assert [c.label for c in configs] == [
        "ar", "sd@2", "sd@2/dv64", "specexec@8", "specexec@8/dv64", "llamacpp",
    ]  # fmt: skip
    with pytest.raises(BenchError, match="takes no --draft-vocab"):
        BenchConfig("ar", draft_vocab=64)
    with pytest.raises(BenchError, match="one quantization level at a time"):
        make_configs(["sd"], quants=["none", "int8"], draft_vocabs=[0, 64])
    target_dir, draft_dir = model_dirs
    argv = [
        "--target", str(target_dir), "--draft", str(draft_dir), "--dtype", "float32",
        "--prompts", str(prompt_file), "--n-prompts", "2", "--max-new-tokens", "12",
        "--methods", "sd", "--sd-budgets", "3", "--draft-vocab", "0,64", "--warmup-tokens", "0",
        "--no-progress", "--out", str(tmp_path / "out"),
    ]  # fmt: skip
    assert main(argv) == 0
    rows = {r["label"]: r for r in json.loads((tmp_path / "out" / "results.json").read_text())}
    assert list(rows) == ["ar", "sd@3", "sd@3/dv64"]
    assert rows["sd@3/dv64"]["draft_vocab"] == 64 and rows["sd@3"]["draft_vocab"] == 0
    assert all(row["identical_to_ar"] for row in rows.values())
    # Another draft really ran: it cannot propose ids >= 64, so it agrees with the target less often.
    assert rows["sd@3/dv64"]["tokens_per_step"] < rows["sd@3"]["tokens_per_step"]


def test_draft_vocab_auto_is_a_smaller_head_for_llamacpp_drafts_only() -> None:
    from specexec.backends.llamacpp.draft_gguf import DEFAULT_DRAFT_VOCAB
    from specexec.loading import draft_vocab

    assert draft_vocab("auto", "llamacpp", 151_936) == DEFAULT_DRAFT_VOCAB
    assert draft_vocab("auto", "llamacpp", 32_000) == 0  # nothing to cut
    assert draft_vocab("auto", "torch", 151_936) == 0
    assert draft_vocab(0, "llamacpp", 151_936) == 0 and draft_vocab(500, "torch", 151_936) == 500


class FakeLlamaCpp:
    """Stands in for `specexec.bench.llamacpp.LlamaCpp`: replays the target's greedy tokens."""

    def __init__(self, model) -> None:
        self.model = model

    def run(self, input_ids, max_new_tokens, seed, eos, **sampling) -> dict:
        from specexec.engine import generate

        record = generate(self.model, None, input_ids, method="ar", max_new_tokens=max_new_tokens)
        return {
            "prompt_tokens": len(input_ids), "new_tokens": len(record.tokens), "tokens": record.tokens,
            "finish_reason": record.finish_reason, "target_calls": len(record.tokens), "draft_calls": 0,
            "prefill_seconds": 0.01, "decode_seconds": 0.1, "wall_seconds": 0.11, "draft_seconds": 0.0,
            "target_seconds": 0.1, "tree_sizes": [0] * len(record.tokens),
            "tree_depths": [0] * len(record.tokens), "accepted": None, "prefill_timing": "llamacpp",
            "hf_settings": None,
        }  # fmt: skip


def test_quantized_levels_are_exact_relative_to_their_own_ar(target, draft, tokenizer, prompts) -> None:
    from specexec.backends.torch.quant import quantize_model

    pair = tuple(quantize_model(copy.deepcopy(m), "int4") for m in (target, draft))
    configs = make_configs(["specexec", "llamacpp"], [8], quants=["none", "int4"], ngrams=[0, 4], expand=4)
    result = run_benchmark(
        target, draft, tokenizer, prompts, configs, max_new_tokens=NEW, warmup_tokens=0, progress=False,
        quantized={"int4": pair}, llamacpp=FakeLlamaCpp(target),
    )  # fmt: skip
    rows = {row["label"]: row for row in result.rows}
    for row in result.rows:
        assert row["identical_to_ar"] is True, row["label"]  # ar of its own level
    assert rows["ar/int4"]["quant"] == "int4" and rows["llamacpp"]["quant"] == "none"
    assert rows["ar"]["speedup_vs_ar"] == 1.0  # the unquantized ar is the speed reference
    int4_tokens = [r["tokens"] for r in result.records if r["label"] == "ar/int4"]
    plain_tokens = [r["tokens"] for r in result.records if r["label"] == "ar"]
    assert int4_tokens != plain_tokens  # the quantized pair really is another model
    assert summarize(result.records) == result.rows
    with pytest.raises(BenchError, match="no int8 model pair"):
        run_benchmark(target, draft, tokenizer, prompts, [BenchConfig("ar", quant="int8")], progress=False)
    with pytest.raises(BenchError, match="llama.cpp runner"):
        run_benchmark(target, draft, tokenizer, prompts, [BenchConfig("llamacpp")], progress=False)
