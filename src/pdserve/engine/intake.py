"""Request intake: an added request checked and made the ``Sequence`` the engine queues.

Owns what ``Engine.add_request`` does before anything is queued or allocated: the prompt's
tokens, the sampling parameters completed (bad words, EOS stop ids) and checked against the
model, the blocks the request could ever need, its seed and guide, and the tokens another
engine already drew (an imported first token, a migrated request's output) replayed through
its text stream. Apart from ``engine.py``, which keeps the queues and the step loop.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from pdserve.engine.admission import check_import, prompt_ids, resumed_ids
from pdserve.engine.controls import tokenize_bad_words
from pdserve.engine.guided import Guides
from pdserve.engine.kv_payload import KVLayout, KVPayload
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import LayerHook, Sequence, SequenceStatus
from pdserve.engine.text import TextStream
from pdserve.errors import CapacityError, InvalidArgumentError
from pdserve.tokenizer import Tokenizer


@dataclass(slots=True)
class LiveRequest:
    """A request in the engine: its sequence and its text stream."""

    seq: Sequence
    text: TextStream


@dataclass
class Intake:
    """Makes added requests into ``LiveRequest``s, numbered in arrival order."""

    tokenizer: Tokenizer
    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int
    layout: KVLayout
    guides: Guides
    token_stop: Callable[[Sequence, int], SequenceStatus | None]
    """The scheduler's: whether a token ends a sequence (a stop token or its length)."""
    arrivals: int = 0
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    def request(
        self,
        request_id: str,
        prompt: str | Seq[int],
        params: SamplingParams,
        *,
        hold_kv: bool,
        layer_hook: LayerHook | None,
        tenant: str,
        kv: KVPayload | None,
        first_token: tuple[int, float] | None,
        generated: Seq[int],
    ) -> LiveRequest:
        """The request ``Engine.add_request`` describes, checked (raises before anything of it
        is kept); with ``kv``, its first token appended."""
        vocab = self.vocab_size
        token_ids = prompt_ids(prompt, self.tokenizer, vocab, self.max_model_len)
        params = tokenize_bad_words(params, self.tokenizer)
        params.check_against(
            vocab_size=vocab, max_model_len=self.max_model_len, prompt_len=len(token_ids)
        )
        resumed = resumed_ids(generated, params, kv, vocab)
        if resumed or kv is not None:  # prefilled elsewhere: its prompt logprobs went from there
            params = params.without_prompt_logprobs()
        need = -(-(len(token_ids) + params.max_tokens) // self.block_size)
        if need > self.num_blocks:
            raise CapacityError(
                f"request needs {need} KV blocks; this engine has {self.num_blocks} in all"
            )
        if not params.ignore_eos and self.tokenizer.eos_token_ids:
            params = dataclasses.replace(
                params, stop_token_ids=params.stop_token_ids + tuple(self.tokenizer.eos_token_ids)
            )
        self.arrivals += 1
        seq = Sequence(
            request_id, token_ids, params, arrival=self.arrivals, hold_kv=hold_kv,
            layer_hook=layer_hook, tenant=tenant,
        )  # fmt: skip
        if not params.greedy:
            seq.seed = params.seed if params.seed is not None else self.rng.getrandbits(62)
        if params.guide is not None:  # its matcher replays what was drawn elsewhere
            first = [first_token[0]] if kv is not None and first_token is not None else []
            named = "generated" if resumed else "first_token"
            seq.guide = self.guides.start(params.guide, resumed or first, named)
        req = LiveRequest(seq, TextStream(self.tokenizer, params.stop, params.min_tokens))
        if resumed:
            self._resume(req, resumed)
        elif kv is not None:
            check_import(self.layout, kv, token_ids, first_token, vocab)
            assert first_token is not None
            seq.token_ids.append(first_token[0])
            seq.output_logprobs.append(first_token[1])
            req.text.add(first_token[0])  # already streamed by the prefill side
        return req

    def _resume(self, req: LiveRequest, generated: list[int]) -> None:
        """Give a sequence the output tokens it already has. Its text stream sees them (they
        were streamed elsewhere), so that a stop string spanning the move is still caught."""
        seq = req.seq
        for token in generated:
            if req.text.add(token):
                raise InvalidArgumentError("generated", "a stop string already ended the request")
        req.text.take()  # streamed already
        seq.token_ids += generated
        seq.output_logprobs += [0.0] * len(generated)  # reported by the engine that drew them
        if self.token_stop(seq, generated[-1]) is not None:
            raise InvalidArgumentError(
                "generated", "the request already ended (a stop token or its length)"
            )
