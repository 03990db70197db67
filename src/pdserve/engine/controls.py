"""Which tokens a request's logits controls forbid, without the logits: the part of
``logits_processors`` that needs no torch (the engine, the router and the sim use it)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Sequence as Seq
from pdserve.tokenizer import Tokenizer


def is_controlled(seq: Seq) -> bool:
    """``seq``'s logits are changed before this step's token is chosen (a guided sequence's by
    its grammar's mask, ``engine.guided``)."""
    p = seq.params
    return p.has_logits_controls or seq.guide is not None or seq.num_output_tokens < p.min_tokens


def banned_by_bad_words(words: Iterable[Sequence[int]], output: Sequence[int]) -> list[int]:
    """The tokens the bad words forbid next, after ``output`` (vLLM's rule: a word's last
    token, when the output ends with the rest of the word; a one-token word always)."""
    banned: list[int] = []
    for word in words:
        prefix = len(word) - 1
        if prefix > len(output):
            continue
        if prefix == 0 or list(output[len(output) - prefix :]) == list(word[:prefix]):
            banned.append(word[-1])
    return banned


def tokenize_bad_words(params: SamplingParams, tokenizer: Tokenizer) -> SamplingParams:
    """``params`` with its ``bad_words`` tokenized into ``bad_words_token_ids`` (and cleared),
    as vLLM does: each word with its leading spaces stripped, and once more after one space
    when that starts with another token and has as many tokens (the word inside a text)."""
    if not params.bad_words:
        return params
    words = list(params.bad_words_token_ids)
    for word in params.bad_words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_bos=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_bos=False))
        words.append(plain)
        if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
            words.append(spaced)
    return dataclasses.replace(
        params, bad_words=(), bad_words_token_ids=tuple(w for w in words if w)
    )
