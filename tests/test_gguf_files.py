"""A GGUF's files and its tensors' bytes, read from the headers (`specexec.backends.gguf_files`): one
file or a split GGUF, against the `gguf` package's reader; the errors of a file that is not a GGUF or a
split GGUF given wrongly. No llama.cpp needed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from gguf import GGUFReader
from test_models import write_tiny_gguf
from tiny_gguf import write_random_gguf

from specexec.backends.gguf_files import GGUFFileError, file_bytes, shards, split, tensor_spans, version


def reader_spans(path: Path, k: int = 0) -> dict[str, tuple[int, int]]:
    """The `gguf` package's tensor offsets in file `path`, shifted as file k of a split GGUF."""
    origin = k << 48
    return {
        t.name: (origin + int(t.data_offset), origin + int(t.data_offset + t.n_bytes))
        for t in GGUFReader(path).tensors
    }


def test_tensor_spans_read_from_the_header_equal_the_gguf_readers(tmp_path: Path) -> None:
    one = write_random_gguf(tmp_path / "one.gguf", "qwen2", "q8_0")
    tokenized = tmp_path / "tokenized.gguf"
    write_tiny_gguf(tokenized)  # its vocabulary's string arrays are skipped, not decoded
    for path in (one, tokenized):
        assert shards(path) == (path,) and tensor_spans(path) == reader_spans(path), path
        assert file_bytes(path) == path.stat().st_size


def test_a_split_ggufs_tensors_lie_in_its_files_at_global_offsets(tmp_path: Path) -> None:
    first = write_random_gguf(tmp_path / "m.gguf", "qwen2", split_max_tensors=10, metadata_first=True)
    files = shards(first)
    assert [f.name for f in files] == [f"m-0000{k}-of-00004.gguf" for k in (1, 2, 3, 4)]
    expected = {}
    for k, path in enumerate(files):
        expected.update(reader_spans(path, k))
    spans = tensor_spans(first)
    assert spans == expected and len(spans) == 27  # 2 layers of 12 tensors, the embedding, norm, head
    assert {split(start)[0] for start, _ in spans.values()} == {1, 2, 3}  # the first holds metadata only
    assert split(spans["output.weight"][1]) == (3, reader_spans(files[3])["output.weight"][1])
    assert file_bytes(first) == sum(f.stat().st_size for f in files)


def test_a_ggufs_version_changes_with_any_of_its_files(tmp_path: Path) -> None:
    """What the calibration and the draft's copies are keyed on: a split GGUF's last part rewritten is
    another model, as a single file rewritten is."""
    one = write_random_gguf(tmp_path / "one.gguf", "qwen2")
    stat = one.stat()
    assert version(one) == f"{stat.st_size}:{stat.st_mtime_ns}"
    first = write_random_gguf(tmp_path / "m.gguf", "qwen2", split_max_tensors=10, metadata_first=True)
    before = version(first)
    assert len(before.split(",")) == 4
    last = shards(first)[-1]
    os.utime(last, ns=(last.stat().st_atime_ns, last.stat().st_mtime_ns + 10**9))
    assert version(first) != before and version(first).split(",")[:3] == before.split(",")[:3]


def test_a_file_that_is_not_a_gguf_or_a_split_gguf_given_wrongly_is_a_one_line_error(tmp_path: Path) -> None:
    other = tmp_path / "not.gguf"
    other.write_bytes(b"PK\x03\x04" + bytes(64))
    with pytest.raises(GGUFFileError) as error:
        tensor_spans(other)
    assert str(error.value) == f"{other} is not a GGUF file"
    tokenized = tmp_path / "tokenized.gguf"
    write_tiny_gguf(tokenized)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tokenized.read_bytes()[:200])  # the file ends inside its metadata
    with pytest.raises(GGUFFileError, match="cut.gguf is not a readable GGUF file \\(error: unpack_from"):
        tensor_spans(cut)

    first = write_random_gguf(tmp_path / "m.gguf", "qwen2", split_max_tensors=10)
    second = first.with_name("m-00002-of-00003.gguf")
    with pytest.raises(GGUFFileError) as error:
        shards(second)
    assert str(error.value) == (
        f"{second} is part of a split GGUF of 3 files: give its first, NAME-00001-of-00003.gguf"
    )
    renamed = first.with_name("renamed.gguf")
    first.rename(renamed)
    with pytest.raises(GGUFFileError, match="give its first"):
        shards(renamed)  # llama.cpp finds the other files by the first one's name
    renamed.rename(first)
    second.unlink()
    with pytest.raises(GGUFFileError) as error:
        tensor_spans(first)
    missing = "m-00002-of-00003.gguf, part 2 of the split GGUF m-00001-of-00003.gguf, is missing"
    assert str(error.value) == missing
