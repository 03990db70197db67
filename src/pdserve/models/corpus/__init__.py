"""The text the demo tokenizer is trained on, and the training itself.

The corpus is generated deterministically from two small shipped files: ``words.txt`` (common
English words, ranked roughly by frequency) and ``unicode.txt`` (sentences in many scripts, plus
symbols and emoji, so that multi-byte UTF-8 characters get their own merges). Pseudo-words made
of English-like syllables give the trainer enough distinct material to reach a 32000-entry
vocabulary; numbers and code-like lines make digits and punctuation common.

Training is deterministic: the text comes from a seeded ``random.Random`` and the ``tokenizers``
BPE trainer breaks count ties by pair order, whatever its thread count.
"""

from __future__ import annotations

import functools
import random
from importlib import resources

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from pdserve.errors import InvalidArgumentError

UNK_TOKEN = "<unk>"
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
PAD_TOKEN = "<pad>"
# Order fixes the ids: <unk>=0, <s>=1, </s>=2, <pad>=3 (the Llama convention plus a pad).
SPECIAL_TOKENS: tuple[str, ...] = (UNK_TOKEN, BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)
BOS_ID, EOS_ID, PAD_ID = 1, 2, 3

# Byte-level BPE needs its 256 byte symbols plus the special tokens before any merge.
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)

_ONSETS = (
    "", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w",
    "z", "br", "cl", "dr", "fl", "gr", "pl", "st", "tr", "sh", "ch", "th", "qu", "sp",
)  # fmt: skip
_VOWELS = ("a", "e", "i", "o", "u", "y", "ai", "ea", "ee", "oo", "ou", "io")
_CODAS = ("", "", "n", "r", "s", "t", "l", "m", "x", "nd", "st", "ng", "rk", "ck", "ll", "ss")
_ENDINGS = (".", ".", ".", ".", "?", "!", ",", ";", ":")

CORPUS_SEED = 1234


def _read(name: str) -> str:
    return resources.files(__name__).joinpath(name).read_text(encoding="utf-8")


def corpus_lines(num_chars: int, seed: int = CORPUS_SEED) -> list[str]:
    """Deterministic English-like text of about ``num_chars`` characters, one line per item."""
    words = list(dict.fromkeys(_read("words.txt").split()))
    unicode_lines = [line for line in _read("unicode.txt").splitlines() if line.strip()]
    rng = random.Random(seed)
    # Zipf-like weights: the first words of the list are the most common ones.
    cum_weights: list[float] = []
    total_weight = 0.0
    for rank in range(len(words)):
        total_weight += 1.0 / (rank + 8)
        cum_weights.append(total_weight)

    def word() -> str:
        u = rng.random()
        if u < 0.25:
            syllables = rng.randint(1, 3)
            return "".join(
                rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                for _ in range(syllables)
            )
        if u < 0.30:
            return str(rng.choice((rng.randrange(10), rng.randrange(1000), rng.randrange(10**5))))
        return rng.choices(words, cum_weights=cum_weights)[0]

    lines: list[str] = []
    size = 0
    while size < num_chars:
        kind = rng.random()
        if kind < 0.06:
            line = unicode_lines[rng.randrange(len(unicode_lines))]
        elif kind < 0.11:
            a, b, c = word(), word(), word()
            line = f"{a}_{b} = {c}({b}, {rng.randrange(1000)})  # {word()} {word()}"
        else:
            sentence = [word() for _ in range(rng.randint(5, 18))]
            sentence[0] = sentence[0].capitalize()
            line = " ".join(sentence) + rng.choice(_ENDINGS)
        lines.append(line)
        size += len(line) + 1
    return lines


# The Qwen2 pre-tokenizer (digits one by one, letters with one leading non-letter). transformers
# rebuilds Qwen2 tokenizers with exactly this pipeline, ignoring tokenizer.json's, so a qwen2
# demo must use it too or the two tokenizations differ.
QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# "bytelevel": GPT-2 style byte-level BPE whose prompts start with <s> (Llama/Mistral demos).
# "qwen2": NFC + the Qwen2 split regex, and no BOS (as real Qwen2 checkpoints).
TOKENIZER_STYLES = ("bytelevel", "qwen2")


def _empty_tokenizer(style: str) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.decoder = decoders.ByteLevel()
    if style == "qwen2":
        tokenizer.normalizer = normalizers.NFC()
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    return tokenizer


@functools.lru_cache(maxsize=8)
def train_tokenizer_json(
    vocab_size: int, style: str = "bytelevel", num_chars: int | None = None
) -> str:
    """Train a byte-level BPE of exactly ``vocab_size`` entries; returns ``tokenizer.json`` text.

    ``num_chars`` sizes the training text (default: enough to reach a 32000 vocabulary); when
    the trainer learns fewer entries, ``<extra_N>`` added tokens fill the vocabulary up.
    Cached per arguments: the result is an immutable string, so callers share no state.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise InvalidArgumentError("vocab_size", f"must be at least {MIN_VOCAB_SIZE}")
    if style not in TOKENIZER_STYLES:
        raise InvalidArgumentError("style", f"must be one of {TOKENIZER_STYLES}")
    tokenizer = _empty_tokenizer(style)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    if num_chars is None:
        # ~64 characters of text per vocabulary entry is enough to reach 32000.
        num_chars = min(max(vocab_size * 64, 200_000), 4_000_000)
    tokenizer.train_from_iterator(corpus_lines(num_chars), trainer=trainer)
    missing = vocab_size - tokenizer.get_vocab_size()
    if missing > 0:
        # Not special: a random model emits these, and a decode should show them, not drop them.
        tokenizer.add_tokens([AddedToken(f"<extra_{i}>", normalized=False) for i in range(missing)])
    if style == "qwen2":
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    else:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{BOS_TOKEN} $A",
            pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
            special_tokens=[(BOS_TOKEN, BOS_ID)],
        )
    for token_id, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != token_id:  # the trainer puts specials first
            raise RuntimeError(f"special token {token!r} did not get id {token_id}")
    return tokenizer.to_str()
