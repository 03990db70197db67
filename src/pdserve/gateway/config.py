"""How a gateway is set up: ``GatewayConfig``, the service's flags."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pdserve.gateway.body import DEFAULT_MAX_BODY_BYTES
from pdserve.gateway.pool import DEFAULT_THREADS
from pdserve.gateway.toolparse import CallSyntax
from pdserve.security.tls import TlsConfig


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """How a gateway is set up (the service's flags)."""

    router: str
    """host:port of the Router service."""
    model_dir: Path
    """The checkpoint the cluster serves (its tokenizer, config and chat template)."""
    served_model_name: str | None = None
    """The ``model`` clients name; default: the checkpoint directory's name."""
    timeout_s: float | None = 600.0
    """Each request's deadline in the cluster; None: none."""
    chat_template: Path | None = None
    """A Jinja2 file used instead of the checkpoint's chat template."""
    router_tls: TlsConfig | None = None
    """How to reach a TLS router (its CA; a client certificate for one that demands it);
    None: plaintext."""
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    """Larger request bodies are refused (413) without being read."""
    parse_threads: int = DEFAULT_THREADS
    """Worker threads that prepare large bodies (``pool``)."""
    allow_unknown_fields: bool = False
    """Ignore request fields outside OpenAI's and vLLM's schemas instead of refusing them
    (``fields``)."""
    tool_call_parser: CallSyntax = CallSyntax.HERMES
    """How ``tool_choice: "auto"`` answers hold their calls (``toolparse``), and how tools
    are written into the prompt of a chat template that renders none."""

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model_dir).name
