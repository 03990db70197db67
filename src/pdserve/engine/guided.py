"""Structured output, enforced with xgrammar: each guided request's tokens stay in its grammar.

* ``Guides`` (one per engine, thread-safe): imports xgrammar on the first guided request (it
  takes seconds; an engine that never sees one never pays), describes the engine's vocabulary
  to it (special tokens as empty, so they never appear inside guided text; the end-of-sequence
  ids as the grammar's stop tokens), compiles each ``Guide`` once (after its child process,
  ``guide_probe``, compiled it unharmed) and keeps the compiled grammars in an LRU bounded in
  bytes (``EngineConfig.guide_cache_bytes``), keyed by the guide.
* ``GuideState`` (one per guided sequence): its grammar matcher, which has accepted every output
  token the sequence holds, wherever it was drawn: a hand-off's first token and a migrated
  request's tokens are replayed into it before its first step (``Guides.start``); a preempted
  sequence keeps it, since it keeps its tokens. After each step the engine advances it by the
  new token (``advance``); a grammar that has ended (its stop token accepted) ends the request
  with finish reason stop. End-of-sequence is allowed only where the grammar is complete.
* ``mask_guided``: the sampler's batched pass over the rows that use a control: one bitmask
  ``[rows, ceil(V / 32)]``, filled by the guided rows' matchers only, applied once.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from pdserve.engine.guide import Guide, GuideKind
from pdserve.engine.guide_probe import GuideProbe, compile_message, compile_with
from pdserve.errors import FeatureUnavailableError, InvalidArgumentError
from pdserve.tokenizer import Tokenizer

if TYPE_CHECKING:
    import torch

EXTRA = "structured"
"""The optional dependency set (``pip install 'pdserve[structured]'``) that brings xgrammar."""


def load_xgrammar(field: str) -> ModuleType:
    """The xgrammar module; ``FeatureUnavailableError`` naming ``field`` and the extra when it
    is not installed."""
    try:
        import xgrammar
    except ImportError as err:
        raise FeatureUnavailableError(
            f"{field}: structured output needs the xgrammar package on every worker: "
            f"pip install 'pdserve[{EXTRA}]' ({err})"
        ) from err
    return xgrammar


def check_syntax(guide: Guide, *, prefix: str = "") -> None:
    """Parse ``guide`` into a grammar without a vocabulary (a tenth of a millisecond, for an
    engine that compiles it itself: TensorRT-LLM); ``InvalidArgumentError`` naming
    ``prefix`` + its field when it does not parse."""
    field = prefix + guide.kind.field
    xgr = load_xgrammar(field)
    try:
        if guide.kind is GuideKind.JSON:
            xgr.Grammar.from_json_schema(guide.spec)
        elif guide.kind is GuideKind.REGEX:
            xgr.Grammar.from_regex(guide.spec)
        elif guide.kind in (GuideKind.CHOICE, GuideKind.GRAMMAR):
            xgr.Grammar.from_ebnf(guide.ebnf() if guide.kind is GuideKind.CHOICE else guide.spec)
    except (RuntimeError, ValueError) as err:  # parse errors, an unreadable message about one
        raise InvalidArgumentError(field, compile_message(err)) from None


class GuideState:
    """One sequence's grammar matcher (see the module docstring)."""

    __slots__ = ("guide", "matcher", "vocab_size")

    def __init__(self, guide: Guide, matcher: Any, vocab_size: int) -> None:
        self.guide = guide
        self.matcher = matcher
        self.vocab_size = vocab_size

    def advance(self, token: int) -> bool:
        """Accept ``token``, drawn under this grammar's mask; True when the grammar has ended
        (its stop token accepted): the request is done. A token outside the mask means the
        engine drew it unmasked: its state is wrong, so this raises."""
        if not self.matcher.accept_token(token):
            raise RuntimeError(f"token {token} was drawn outside {self.guide.kind.field}'s mask")
        return bool(self.matcher.is_terminated())

    def allowed_tokens(self) -> np.ndarray:
        """The token ids the grammar allows next, ascending (for a runner without logits)."""
        xgr = load_xgrammar(self.guide.kind.field)
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        self.matcher.fill_next_token_bitmask(bitmask, 0)
        # Bit j of int32 word w is token 32 w + j: little-endian bytes, least bit first.
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")
        return np.flatnonzero(bits[: self.vocab_size])


class Guides:
    """Compiles guides for one engine's vocabulary and caches them (thread-safe)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        *,
        cache_bytes: int,
        probe: GuideProbe | None = None,
    ) -> None:
        """``vocab_size``: the model's (the width of its logits, which may differ from the
        tokenizer's). ``probe``: where each new guide is tried first (default: a
        ``GuideProbe`` of its own)."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.cache_bytes = cache_bytes
        self.probe = probe or GuideProbe()
        self._lock = threading.Lock()
        self._compiler: Any = None
        self._cache: OrderedDict[Guide, Any] = OrderedDict()
        self._cached_bytes = 0
        self.compiles = 0
        """Grammars compiled so far (cache misses)."""

    def compile(self, guide: Guide) -> Any:
        """``guide`` compiled (an ``xgrammar.CompiledGrammar``), from the cache when it was
        compiled before. A new guide is tried in the probe's process first: one that
        crashes or hangs the compiler must not take this process with it.
        ``InvalidArgumentError`` naming the guide's field when it does not compile (a regex
        or grammar the library cannot parse, a schema feature it lacks, a crash);
        ``FeatureUnavailableError`` without xgrammar or an end-of-sequence token. The compile
        runs outside the lock: two threads may compile one guide at once, never wait for
        each other's."""
        with self._lock:
            found = self._cache.get(guide)
            if found is not None:
                self._cache.move_to_end(guide)
                return found
        if self._compiler is None:  # the first guide: the child loads while this process does
            self.probe.start()
        compiler = self._compiler_for(guide.kind.field)
        self.probe.check(guide)
        try:
            compiled = compile_with(compiler, guide)
        except (RuntimeError, ValueError) as err:  # the C++ core's parse and conversion
            # errors (a ValueError: its message, cut inside a character, did not decode)
            raise InvalidArgumentError(guide.kind.field, compile_message(err)) from None
        with self._lock:
            self.compiles += 1
            if guide not in self._cache:
                self._cache[guide] = compiled
                self._cached_bytes += int(compiled.memory_size_bytes)
            while self._cached_bytes > self.cache_bytes and len(self._cache) > 1:
                _, old = self._cache.popitem(last=False)
                self._cached_bytes -= int(old.memory_size_bytes)
        return compiled

    def start(self, guide: Guide, drawn: Sequence[int], field: str) -> GuideState:
        """A matcher for a sequence of ``guide`` whose output so far is ``drawn`` (replayed:
        tokens another engine drew before a hand-off or a migration). ``InvalidArgumentError``
        naming ``field`` when they leave the grammar or end it."""
        xgr = load_xgrammar(guide.kind.field)
        state = GuideState(guide, xgr.GrammarMatcher(self.compile(guide)), self.vocab_size)
        for i, token in enumerate(drawn):
            if not 0 <= token < self.vocab_size or not state.matcher.accept_token(token):
                raise InvalidArgumentError(
                    field, f"token {i} ({token}) is not allowed by the request's {guide.kind.field}"
                )
        if state.matcher.is_terminated():
            raise InvalidArgumentError(field, f"the request's {guide.kind.field} already ended")
        return state

    def _compiler_for(self, field: str) -> Any:
        with self._lock:
            if self._compiler is not None:
                return self._compiler
        xgr = load_xgrammar(field)  # seconds, the first time: outside the lock
        stops = list(self.tokenizer.eos_token_ids)
        if not stops:
            raise FeatureUnavailableError(
                f"{field}: the model's tokenizer names no end-of-sequence token, which a "
                "grammar needs to end the output"
            )
        info = xgr.TokenizerInfo(
            _encoded_vocab(self.tokenizer, self.vocab_size),
            **_vocab_metadata(xgr, self.tokenizer),
            vocab_size=self.vocab_size,
            stop_token_ids=stops,
        )
        with self._lock:
            if self._compiler is None:  # our own cache (keyed by guide, bounded), not its
                self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
            return self._compiler


def _encoded_vocab(tokenizer: Tokenizer, vocab_size: int) -> list[str]:
    """Each id's token as ``tokenizer.json`` spells it (what xgrammar decodes by the vocabulary
    type); special tokens and ids the tokenizer lacks as "", which xgrammar never allows
    inside guided text (pdserve's text leaves special tokens out)."""
    backend = tokenizer.backend
    special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    encoded = [""] * vocab_size
    for token, i in backend.get_vocab(with_added_tokens=True).items():
        if i < vocab_size and i not in special:
            encoded[i] = token
    return encoded


def _vocab_metadata(xgr: ModuleType, tokenizer: Tokenizer) -> dict[str, Any]:
    """``vocab_type`` and ``add_prefix_space`` of the tokenizer, read from its
    ``tokenizer.json`` by xgrammar's own reader (the one its Hugging Face constructor uses,
    without importing transformers' tokenizer classes)."""
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer.backend.to_str())
    return {"vocab_type": meta["vocab_type"], "add_prefix_space": meta["add_prefix_space"]}


def mask_guided(rows: torch.Tensor, guides: Sequence[GuideState | None]) -> torch.Tensor:
    """``rows`` ``[C, V]`` (one per sequence; ``guides``: each one's grammar state, ``None``
    where it has none) with the tokens each guided row's grammar forbids at -inf, in place;
    returns it. One bitmask for the block, filled only for the guided rows (a C++ call each, no
    Python over the vocabulary), applied once; the other rows are untouched."""
    guided = [i for i, g in enumerate(guides) if g is not None]
    if not guided:
        return rows
    xgr = load_xgrammar("guide")  # imported already: a guided sequence has a matcher
    bitmask = xgr.allocate_token_bitmask(len(guides), rows.shape[-1])
    for i in guided:
        state = guides[i]
        assert state is not None
        state.matcher.fill_next_token_bitmask(bitmask, i)
    xgr.apply_token_bitmask_inplace(rows, bitmask.to(rows.device), indices=guided)
    return rows
