"""Tokenizer wrapper, streamed detokenization and stop strings."""

from __future__ import annotations

import json
import random
import shutil
import unicodedata
from pathlib import Path

import pytest

from pdserve.errors import InvalidArgumentError, ModelLoadError
from pdserve.models.corpus import train_tokenizer_json
from pdserve.tokenizer import (
    IncrementalDetokenizer,
    StopStringMatcher,
    Tokenizer,
    find_stop_string,
)

TEXTS = [
    "Hello world, this is a test.",
    "  two  spaces\n\nnew line\ttab and trailing space ",
    "Grüße aus München — café, naïve, façade.",
    "今天天气很好，我们一起去公园散步吧。",  # noqa: RUF001
    "東京の桜 · 서울 · Москва · Αθήνα · עברית · العربية",
    "Emoji: 🙂🚀 👩\u200d💻 👍🏽 🇩🇪 and math ∑ xᵢ ≤ ∞",
    "numbers 12345 and 3.14159, code: x_y = f(a, 42)  # note",
    "",
]


def _random_text(rng: random.Random, n: int) -> str:
    # Code points from ASCII, Latin-1, Cyrillic, CJK and the astral plane (4-byte UTF-8).
    ranges = [(0x20, 0x7E), (0xA0, 0xFF), (0x400, 0x4FF), (0x4E00, 0x4FFF), (0x1F600, 0x1F64F)]
    out = []
    for _ in range(n):
        lo, hi = rng.choice(ranges)
        out.append(chr(rng.randint(lo, hi)))
    return "".join(out)


@pytest.fixture(scope="module")
def tok(tiny_llama_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_llama_dir)


@pytest.fixture(scope="module")
def qwen_tok(tiny_qwen2_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_qwen2_dir)


def test_vocab_size_and_special_ids_follow_the_config(tok: Tokenizer, tiny_llama_dir: Path) -> None:
    cfg = json.loads((tiny_llama_dir / "config.json").read_text())
    assert tok.vocab_size == cfg["vocab_size"]
    assert tok.bos_token_id == cfg["bos_token_id"]
    assert tok.eos_token_ids == (cfg["eos_token_id"],)
    assert tok.token_to_id("<s>") == cfg["bos_token_id"]
    assert tok.token_to_id("</s>") == cfg["eos_token_id"]


def test_encode_adds_bos_only_where_the_model_uses_one(tok: Tokenizer, qwen_tok: Tokenizer) -> None:
    assert tok.encode("hi")[0] == tok.bos_token_id
    assert tok.encode("hi", add_bos=False) == tok.encode("hi")[1:]
    # Qwen2 prompts carry no BOS even though the config names one.
    assert qwen_tok.bos_token_id is not None
    assert qwen_tok.encode("hi") == qwen_tok.encode("hi", add_bos=False)
    assert qwen_tok.bos_token_id not in qwen_tok.encode("hi")


def test_round_trip(tok: Tokenizer, qwen_tok: Tokenizer) -> None:
    rng = random.Random(0)
    texts = TEXTS + [_random_text(rng, rng.randint(1, 60)) for _ in range(50)]
    for text in texts:
        assert tok.decode(tok.encode(text)) == text
        # The Qwen2 pipeline normalizes to NFC first, as the real one does.
        assert qwen_tok.decode(qwen_tok.encode(text)) == unicodedata.normalize("NFC", text)


def test_multibyte_characters_span_tokens(tok: Tokenizer) -> None:
    # The tiny vocabulary leaves some characters as byte tokens: one token alone is not text.
    ids = tok.encode("🙂👍🏽", add_bos=False)
    assert len(ids) > 2
    assert any("\ufffd" in tok.decode([i]) for i in ids)


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_matches_transformers(fixture: str, request: pytest.FixtureRequest) -> None:
    transformers = pytest.importorskip("transformers")
    path: Path = request.getfixturevalue(fixture)
    ours = Tokenizer.from_dir(path)
    hf = transformers.AutoTokenizer.from_pretrained(path)
    rng = random.Random(1)
    for text in TEXTS + [_random_text(rng, 40) for _ in range(20)]:
        ids = hf(text).input_ids
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    mixed = [ours.bos_token_id or 1, 50, 2, 60, 3]
    assert ours.decode(mixed, skip_special_tokens=False) == hf.decode(mixed)


def test_eos_ids_gather_generation_config(tmp_path: Path, tiny_llama_dir: Path) -> None:
    path = tmp_path / "ckpt"
    shutil.copytree(tiny_llama_dir, path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2]}))
    tok = Tokenizer.from_dir(path)
    assert tok.eos_token_ids == (7, 2)
    assert tok.bos_token_id == 1  # from config.json when generation_config has none


def test_missing_tokenizer_json_is_named(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)


def test_vocab_is_padded_when_training_learns_too_few() -> None:
    import tokenizers

    backend = tokenizers.Tokenizer.from_str(train_tokenizer_json(3000, num_chars=3000))
    assert backend.get_vocab_size(with_added_tokens=True) == 3000
    assert backend.token_to_id("<extra_0>") is not None


def test_training_is_deterministic_across_processes_and_thread_counts() -> None:
    import os
    import subprocess
    import sys

    here = train_tokenizer_json.__wrapped__(600, num_chars=50_000)
    assert train_tokenizer_json.__wrapped__(600, num_chars=50_000) == here
    code = (
        "import sys; from pdserve.models.corpus import train_tokenizer_json as t; "
        "sys.stdout.write(t(600, num_chars=50_000))"
    )
    env = {**os.environ, "RAYON_NUM_THREADS": "1", "PYTHONIOENCODING": "utf-8"}
    other = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, encoding="utf-8", check=True
    )
    assert other.stdout == here


# -- streaming -------------------------------------------------------------------------------


def _stream(tok: Tokenizer, ids: list[int], chunk: int = 1) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return deltas, detok.flush()


def test_deltas_join_to_the_full_decode_for_random_ids(tok: Tokenizer) -> None:
    rng = random.Random(2)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 40))]
        for chunk in (1, 3):
            deltas, tail = _stream(tok, ids, chunk)
            assert "".join(deltas) + tail == tok.decode(ids)


def test_deltas_of_valid_text_never_hold_a_partial_character(tok: Tokenizer) -> None:
    rng = random.Random(3)
    for text in TEXTS + [_random_text(rng, 30) for _ in range(40)]:
        ids = tok.encode(text, add_bos=False)
        detok = IncrementalDetokenizer(tok)
        for k, token in enumerate(ids, start=1):
            delta = detok.add([token])
            assert "\ufffd" not in delta
            so_far = tok.decode(ids[:k])
            assert so_far.startswith(detok.text)
            if not so_far.endswith("\ufffd"):  # nothing pending: everything was released
                assert detok.text == so_far
        assert detok.flush() == ""
        assert detok.text == text


def test_special_tokens_are_skipped_or_kept(tok: Tokenizer) -> None:
    ids = [*tok.encode("a b", add_bos=True), 2, *tok.encode(" c", add_bos=False)]
    assert "".join(_stream(tok, ids)[0]) == "a b c"
    detok = IncrementalDetokenizer(tok, skip_special_tokens=False)
    text = "".join(detok.add([i]) for i in ids) + detok.flush()
    assert text == "<s>a b</s> c"


def test_context_ids_are_not_emitted(tok: Tokenizer) -> None:
    prompt = tok.encode("The weather is")
    gen = tok.encode(" nice 🙂 today", add_bos=False)
    detok = IncrementalDetokenizer(tok, context_ids=prompt)
    out = "".join(detok.add([t]) for t in gen) + detok.flush()
    assert out == tok.decode(prompt + gen)[len(tok.decode(prompt)) :] == " nice 🙂 today"


# -- stop strings ----------------------------------------------------------------------------


def _reference_cut(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Brute force: the first position where some stop string has just been completed."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            stop = max(done, key=len)  # the one that started earliest
            return text[: end if include else end - len(stop)], stop
    return text, None


def _feed_in_pieces(
    text: str, stops: list[str], cuts: list[int], include: bool
) -> tuple[str, str | None]:
    matcher = StopStringMatcher(stops, include_stop=include)
    out, matched = [], None
    for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
        piece, matched = matcher.feed(text[a:b])
        out.append(piece)
        if matched is not None:
            return "".join(out), matched
    return "".join(out) + matcher.flush(), None


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_across_delta_boundaries(include: bool) -> None:
    rng = random.Random(4)
    alphabet = "ab中🙂 "
    for _ in range(400):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 16)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(2)]
        positions = range(1, len(text))  # empty for texts of 0 or 1 characters
        cuts = sorted(rng.sample(positions, k=rng.randint(0, min(len(positions), 6))))
        assert _feed_in_pieces(text, stops, cuts, include) == _reference_cut(text, stops, include)


def test_stop_text_is_held_back_until_decided() -> None:
    matcher = StopStringMatcher(["</answer>"])
    assert matcher.feed("yes </ans") == ("yes ", None)
    assert matcher.feed("wer") == ("", None)
    assert matcher.feed("> more") == ("", "</answer>")
    other = StopStringMatcher(["</answer>"])
    assert other.feed("a </an") == ("a ", None)
    assert other.feed("d b") == ("</and b", None)
    assert other.flush() == ""


def test_find_stop_string_searches_only_new_text() -> None:
    text = "STOP then more text STOP"
    match = find_stop_string(text, ["STOP"], start=10)
    assert match is not None and (match.start, match.end) == (20, 24)
    assert find_stop_string(text, ["STOP"], start=0).start == 0  # type: ignore[union-attr]
    assert find_stop_string("abc", ["x"]) is None
    with pytest.raises(InvalidArgumentError, match="stop"):
        find_stop_string("abc", [""])


def test_detokenizer_and_stop_matcher_compose(tok: Tokenizer) -> None:
    text = "Answer: 你好世界 and more"
    ids = tok.encode(text, add_bos=False)
    detok = IncrementalDetokenizer(tok)
    matcher = StopStringMatcher(["世界"])
    out = []
    for token in ids:
        piece, stop = matcher.feed(detok.add([token]))
        out.append(piece)
        if stop is not None:
            break
    assert "".join(out) == "Answer: 你好"
