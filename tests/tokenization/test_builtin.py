"""The shared tokenizer: realistic counts, stable ids, lossless pieces, the chat template."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from extproc.tokenization import builtin as tokenizer
from extproc.tokenization.builtin import IM_END, IM_START, PLACEHOLDER, VOCAB_SIZE, count, encode, pieces, render_chat

ENGLISH = (
    "Routing quality can only be measured against model servers whose KV cache behaves like the "
    "real thing, and no GPU is available. The simulator must be faithful enough that a benchmark's "
    "hit rates and time-to-first-token figures mean something, yet light enough that eight replicas, "
    "a proxy, the picker and a load generator share two cores. In 1867 the United States purchased "
    "Alaska from Russia for $7.2 million, roughly two cents per acre; nobody regretted it later."
)


def test_english_is_about_four_characters_per_token() -> None:
    ratio = len(ENGLISH) / count(ENGLISH)
    assert 3.5 <= ratio <= 5.0, ratio


def test_pieces_are_lossless_for_arbitrary_unicode() -> None:
    rng = random.Random(7)
    text = "".join(chr(rng.randrange(1, 0x2FFF)) for _ in range(5000)) + " \t\n  x__y <|im_end|>"
    assert "".join(pieces(text)) == text
    assert len(encode(text)) == count(text)


def test_the_fast_word_rules_split_as_the_backtracking_rule_does() -> None:
    """The word alternative is matched possessively and tried for ASCII letters first, for speed;
    the module's rules, written once with a backtracking run, give the same pieces on long words,
    digits, specials and mixed scripts (ASCII runs that stop at another letter included)."""
    import re

    letter, special = tokenizer._LETTER, tokenizer._SPECIAL
    backtracking = re.compile(
        rf" ?{letter}{{1,{tokenizer.MAX_WORD_CHARS}}}(?!{letter})| ?{letter}{{1,{tokenizer.WORD_PIECE_CHARS}}}"
        rf"|\d{{1,3}}|{special}| ?(?:(?!{special})[^\s\w]){{1,4}}|_{{1,4}}|\s{{1,16}}(?!\S)|\s")
    rng = random.Random(11)
    alphabet = "abcdefghijklmnopqrstuvwxyz\u00c4\u00e9\u00df\u0436\u6f22\u5b57\u00b2\u216b  \n\t.,;:!?-_0123456789<|>"
    texts = [ENGLISH, "internationalization " * 5 + "<|im_start|>a" + "x" * 23]
    # ASCII runs of 1-12 letters, then another letter (\u00e9, superscript two, Roman twelve) or not.
    tails = ("", "\u00e9", "\u00b2x", "\u216b", "_", "1")
    texts += [" ".join("abcdefghijkl"[:n] + tail for n in range(1, 13) for tail in tails)]
    texts += ["".join(rng.choice(alphabet) for _ in range(3000)) for _ in range(50)]
    for text in texts:
        assert pieces(text) == backtracking.findall(text)


def test_ids_are_in_vocab_and_stable_across_processes() -> None:
    ids = encode(ENGLISH)
    assert all(0 <= t < VOCAB_SIZE for t in ids)
    code = f"from extproc.tokenization.builtin import encode; print(encode({ENGLISH!r}))"
    for seed in ("0", "12345"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={"PYTHONHASHSEED": seed, "PATH": ""})
        assert out.stdout.strip() == str(ids)


def test_memo_limit_does_not_change_ids() -> None:
    before = encode(ENGLISH)
    tokenizer._IDS.clear()
    assert encode(ENGLISH) == before


def test_words_split_into_pieces_like_bpe() -> None:
    assert pieces("Hello, world!") == ["Hello", ",", " world", "!"]
    # A word longer than 10 letters loses 4-letter chunks until the rest fits in one piece.
    assert pieces(" internationalization") == [" inte", "rnat", "iona", "lization"]
    assert pieces("year 2024") == ["year", " ", "202", "4"]
    assert 97 <= count("a" * 400) <= 100


def test_special_tokens_are_single_tokens_even_after_punctuation() -> None:
    assert pieces(f"Hi.{IM_END}\n{IM_START}user") == ["Hi", ".", IM_END, "\n", IM_START, "user"]


def test_render_chat_template() -> None:
    text = render_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert text == (f"{IM_START}system\nBe brief.{IM_END}\n{IM_START}user\nHi{IM_END}\n"
                    f"{IM_START}assistant\n")
    assert render_chat([{"role": "user", "content": "x"}], add_generation_prompt=False).endswith(f"{IM_END}\n")


def test_render_chat_content_parts_keep_a_placeholder_for_media() -> None:
    parts = [{"type": "text", "text": "look: "}, {"type": "image_url", "image_url": {"url": "u"}},
             {"type": "text", "text": " ok"}]
    text = render_chat([{"role": "user", "content": parts}, {"role": "assistant", "content": None}])
    assert f"user\nlook: {PLACEHOLDER} ok{IM_END}" in text
    assert f"{IM_START}assistant\n{IM_END}\n" in text


@pytest.mark.parametrize("bad", [[{"content": "no role"}], [{"role": "user", "content": 5}], ["x"]])
def test_render_chat_rejects_malformed_messages(bad: list[object]) -> None:
    with pytest.raises(ValueError):
        render_chat(bad)  # type: ignore[arg-type]
