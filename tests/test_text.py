"""Incremental detokenization (`specexec.text.TextStream`): split characters, stop sequences, text that
a whole-output decode would rewrite, and work linear in the output's length."""

from __future__ import annotations

import pytest
from server_helpers import byte_tokenizer

from specexec.text import TextStream


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


class CountingDecoder:
    """`tok`, counting the tokens every decode call reads."""

    def __init__(self, tok) -> None:
        self.tok = tok
        self.decoded = 0

    def decode(self, ids, **kwargs) -> str:
        self.decoded += len(ids)
        return self.tok.decode(ids, **kwargs)


def test_text_stream_holds_back_split_characters_and_stop_prefixes(tok):
    e_acute = tok("é")["input_ids"]  # two byte tokens
    assert len(e_acute) == 2
    text = TextStream(tok)
    assert text.add(tok("ab")["input_ids"]) == "ab"
    assert text.add(e_acute[:1]) == ""  # half a character
    assert text.add(e_acute[1:]) == "é"
    assert text.add(e_acute[:1], final=True) == "\ufffd"  # a dangling byte at the very end is flushed

    text = TextStream(tok, stop=["STOP", "xyz"])
    assert text.add(tok("hello S")["input_ids"]) == "hello "  # "S" may begin "STOP"
    assert text.add(tok("T")["input_ids"]) == ""
    assert text.add(tok("x")["input_ids"]) == "ST"  # "STx" can no longer become "STOP"; "x" may start "xyz"
    assert text.add(tok("yzSTOP more")["input_ids"]) == "" and text.stopped
    assert text.text == "hello ST"  # cut before the first stop sequence, "xyz"
    assert text.add(tok("later")["input_ids"], final=True) == ""


def test_text_that_clean_up_would_rewrite_streams_on_time_and_once(tok):
    # With clean-up of spaces, decoding "it is ." whole gives "it is.": the " " already sent would be
    # rewritten. The stream sends each token's text as it comes, and never sends anything twice.
    cleaning = byte_tokenizer()
    cleaning.clean_up_tokenization_spaces = True  # as WordPiece tokenizers do; forced here for BPE:
    cleaning.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    assert cleaning.decode(cleaning("it is .")["input_ids"]) == "it is."
    text = TextStream(cleaning)
    deltas = [text.add([t]) for t in cleaning("it is .")["input_ids"]]
    assert deltas == list("it is .")
    assert text.add([], final=True) == "" and text.text == "it is ."


def test_the_same_tokens_give_the_same_text_however_they_are_split(tok):
    ids = tok("héllo wörld, ünïcode… and STOP here")["input_ids"]
    whole = TextStream(tok, stop=["STOP"])
    one_go = whole.add(ids, final=True)
    for step in (1, 2, 3, 5):
        text = TextStream(tok, stop=["STOP"])
        pieces = [text.add(ids[i : i + step], final=i + step >= len(ids)) for i in range(0, len(ids), step)]
        assert "".join(pieces) == one_go == "héllo wörld, ünïcode… and "
        assert (
            text.token_count == whole.token_count == len(tok("héllo wörld, ünïcode… and STOP")["input_ids"])
        )


def test_work_is_linear_in_the_output(tok):
    counting = CountingDecoder(tok)
    ids = tok("lorem ipsum dolor sit amet, é ü " * 200)["input_ids"]  # about 6,800 tokens
    text = TextStream(counting, stop=["never appears"])
    for i in range(0, len(ids), 3):
        text.add(ids[i : i + 3])
    text.add([], final=True)
    assert text.text == tok.decode(ids)
    # Each token is read by a few short windows; re-decoding the whole output every step would read
    # about n^2 / 6 = 7.7 million tokens.
    assert counting.decoded <= 8 * len(ids), counting.decoded
