"""Text <-> token ids for a checkpoint directory, streamed detokenization and stop strings.

``Tokenizer`` wraps a Hugging Face ``tokenizer.json`` (the ``tokenizers`` library, no
``transformers``) and reads the special ids the way ``transformers`` would: BOS from
``config.json``/``generation_config.json``/``tokenizer_config.json``, and every EOS id any of the
three names (Llama 3 instruct models stop on several).

``IncrementalDetokenizer`` turns token ids into text deltas without ever emitting half of a
multi-byte character, and ``StopStringMatcher`` cuts a text stream at the first stop string
while holding back text that may be the start of one.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers

from pdserve.errors import InvalidArgumentError, ModelLoadError

REPLACEMENT_CHAR = "\ufffd"
# Tokens of context decoded before the first new token, so that decoders which strip a leading
# space from the first token (SentencePiece "Metaspace") render the first delta correctly.
_CONTEXT_TOKENS = 5


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"cannot parse {file}: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{file} does not hold a JSON object")
    return data


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, list):
        return [int(v) for v in value]
    return [int(value)]


class Tokenizer:
    """A checkpoint's tokenizer: encode, decode, and its BOS/EOS ids."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        adds_bos: bool,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_token_ids))
        # Whether this model's prompts start with BOS (Llama: yes; Qwen2: no).
        self.adds_bos = adds_bos and bos_token_id is not None

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` and the special ids from a checkpoint directory."""
        root = Path(path)
        file = root / "tokenizer.json"
        if not file.is_file():
            raise ModelLoadError(f"missing file: {file}")
        try:
            backend = tokenizers.Tokenizer.from_file(str(file))
        except Exception as e:  # the Rust side raises a bare Exception for a malformed file
            raise ModelLoadError(f"cannot load {file}: {e}") from e
        config = _read_json(root / "config.json")
        gen_config = _read_json(root / "generation_config.json")
        tok_config = _read_json(root / "tokenizer_config.json")

        def token_id(key: str) -> int | None:
            token = tok_config.get(key)
            if isinstance(token, dict):  # {"content": "<s>", "lstrip": false, ...}
                token = token.get("content")
            return backend.token_to_id(token) if isinstance(token, str) else None

        bos_ids = _as_ids(gen_config.get("bos_token_id")) or _as_ids(config.get("bos_token_id"))
        bos = bos_ids[0] if bos_ids else token_id("bos_token")
        eos = [
            *_as_ids(gen_config.get("eos_token_id")),
            *_as_ids(config.get("eos_token_id")),
        ]
        tok_eos = token_id("eos_token")
        if tok_eos is not None:
            eos.append(tok_eos)
        if "add_bos_token" in tok_config:
            adds_bos = bool(tok_config["add_bos_token"])
        else:  # no flag: do what tokenizer.json's post-processor does
            adds_bos = backend.encode("", add_special_tokens=True).ids[:1] == [bos]
        return cls(backend, bos_token_id=bos, eos_token_ids=eos, adds_bos=adds_bos)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added tokens included."""
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_bos: bool = True, *, release_gil: bool = False) -> list[int]:
        """Token ids of ``text``; with ``add_bos``, BOS first if this model uses one.

        ``release_gil``: let other Python threads run meanwhile (the library's ``encode``
        holds the GIL throughout, its batch form does not), for a long text tokenized on a
        worker thread while an event loop keeps running. The ids are the same.
        """
        if release_gil:
            ids: list[int] = self.backend.encode_batch([text], add_special_tokens=False)[0].ids
        else:
            ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_bos and self.adds_bos and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; bytes that do not form a whole character decode to U+FFFD."""
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_to_id(self, token: str) -> int | None:
        """Id of one vocabulary entry, or None."""
        result = self.backend.token_to_id(token)
        return None if result is None else int(result)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas, one call per step.

    The deltas joined equal ``decode`` of all ids. Text is held back while its decoded tail ends
    in U+FFFD, because that usually means a character whose bytes are split across tokens;
    ``flush()`` releases whatever is held at the end of the stream.

    Offsets follow the usual prefix/read scheme: ``ids[prefix:read]`` has been emitted and is
    decoded again only as context for the next delta, so each call decodes a few tokens.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        skip_special_tokens: bool = True,
        context_ids: Sequence[int] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = list(context_ids[-_CONTEXT_TOKENS:])
        self._prefix = 0
        self._read = len(self._ids)
        self._pieces: list[str] = []

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _emit(self, *, final: bool) -> str:
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) <= len(prefix_text) or (not final and new_text.endswith(REPLACEMENT_CHAR)):
            return ""
        delta = new_text[len(prefix_text) :]
        # The ids just emitted become the context of the next delta; older ids are not needed.
        del self._ids[: self._read]
        self._prefix = 0
        self._read = len(self._ids)
        self._pieces.append(delta)
        return delta

    def add(self, token_ids: Iterable[int]) -> str:
        """Take the step's new ids; returns the new text, possibly empty."""
        self._ids.extend(token_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """End of stream: return the held-back text, incomplete characters as U+FFFD."""
        return self._emit(final=True)

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._pieces)


@dataclass(frozen=True, slots=True)
class StopMatch:
    """Where a stop string occurs in a text: ``text[start:end] == stop``."""

    start: int
    end: int
    stop: str


def _check_stops(stop_strings: Sequence[str]) -> None:
    if any(not s for s in stop_strings):
        raise InvalidArgumentError("stop", "stop strings must not be empty")


def find_stop_string(text: str, stop_strings: Sequence[str], start: int = 0) -> StopMatch | None:
    """The stop string occurrence in ``text`` that ends first, among those ending after ``start``.

    ``start`` is how much of ``text`` was already searched (the engine passes the length before
    the newest delta), so each call looks only at the new text plus the overlap a stop string
    can straddle. Cut the output at ``match.start`` (or ``match.end`` to keep the stop string).
    "Ends first" makes the result independent of how the text was split into deltas.
    """
    _check_stops(stop_strings)
    best: StopMatch | None = None
    for stop in stop_strings:
        pos = text.find(stop, max(0, start - len(stop) + 1))
        if pos < 0:
            continue
        match = StopMatch(pos, pos + len(stop), stop)
        if best is None or (match.end, match.start) < (best.end, best.start):
            best = match
    return best


class StopStringMatcher:
    """Streams text through and stops at the first stop string.

    ``feed(delta)`` returns the text that is safe to show now and the stop string that ended the
    stream, if any. Text that could be the beginning of a stop string is held back until the
    next delta decides it; ``flush()`` releases it when the stream ends without a stop.
    """

    def __init__(self, stop_strings: Sequence[str], *, include_stop: bool = False) -> None:
        _check_stops(stop_strings)
        self._stops = tuple(stop_strings)
        self._include_stop = include_stop
        self._pending = ""
        self.matched: str | None = None

    def feed(self, delta: str, *, match: bool = True) -> tuple[str, str | None]:
        """Add newly decoded text; returns (text to emit, matched stop string or None).
        ``match=False``: this text ends no stop string (a request's ``min_tokens``)."""
        if self.matched is not None:
            return "", self.matched
        pending = self._pending + delta
        # Held text is never the whole of a stop string, so any match ends in this delta.
        found = find_stop_string(pending, self._stops, len(self._pending)) if match else None
        if found is not None:
            self._pending = ""
            self.matched = found.stop
            return pending[: found.end if self._include_stop else found.start], found.stop
        held = self._partial_suffix(pending)
        self._pending = pending[len(pending) - held :]
        return pending[: len(pending) - held], None

    def flush(self) -> str:
        """End of stream: return the held-back text."""
        out, self._pending = self._pending, ""
        return out

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
