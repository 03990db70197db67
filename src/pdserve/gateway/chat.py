"""A checkpoint's chat template, rendered the way Hugging Face ``apply_chat_template`` does.

The template comes from, in order: ``--chat-template FILE``; the checkpoint's
``chat_template.jinja``; ``chat_template`` in its ``tokenizer_config.json`` (a string, or a
list of named templates, of which "default" is taken); else ``FALLBACK_TEMPLATE``, ChatML::

    <|im_start|>system
    You are terse.<|im_end|>
    <|im_start|>user
    Hi<|im_end|>
    <|im_start|>assistant

Rendering uses a sandboxed Jinja2 environment with ``trim_blocks``/``lstrip_blocks``, the
``loopcontrols`` extension, ``raise_exception``, ``strftime_now`` and a ``tojson`` that keeps
non-ASCII text, as ``transformers`` does, and the special tokens of ``tokenizer_config.json``
(``bos_token``, ``eos_token``, ``unk_token``, ``pad_token``) as variables. The rendered text
already holds any BOS the template writes, so it is tokenized without adding another.

A request's ``tools`` are the variable ``tools`` (null without), and earlier calls' arguments
are objects, as ``transformers`` gives them. A template that never reads ``tools`` (ChatML
above among them) gets them written into the conversation instead, in the format of the
gateway's tool-call parser (``tools.prompt_messages``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pdserve.errors import InvalidArgumentError, ModelLoadError
from pdserve.gateway.protocol import ChatMessage
from pdserve.gateway.toolparse import CallSyntax
from pdserve.gateway.tools import prompt_messages, template_tool_calls

FALLBACK_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""ChatML, for checkpoints that ship no chat template."""

_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


class TemplateRaisedError(Exception):
    """``raise_exception(...)`` was called by the template (it refuses the conversation)."""


def _raise_exception(message: str) -> NoReturn:
    raise TemplateRaisedError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", "lstrip": false, ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


def _from_config(config: Mapping[str, Any], file: Path) -> str | None:
    template = config.get("chat_template")
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list):  # [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        chosen = named.get("default")
        if isinstance(chosen, str):
            return chosen
    raise ModelLoadError(f"{file}: chat_template is neither a string nor has a 'default' entry")


class ChatTemplate:
    """A compiled chat template and the special tokens it may use."""

    def __init__(
        self,
        source: str,
        special_tokens: Mapping[str, str],
        origin: str,
        tool_syntax: CallSyntax = CallSyntax.HERMES,
    ) -> None:
        self.source = source
        self.special_tokens = dict(special_tokens)
        self.origin = origin
        """Where the template came from: a file path, or "fallback (ChatML)"."""
        self.tool_syntax = tool_syntax
        """How tools are written in for a template that renders none (the gateway's parser)."""
        env = _environment()
        try:
            self._template = env.from_string(source)
            self.renders_tools = "tools" in jinja2.meta.find_undeclared_variables(env.parse(source))
        except jinja2.TemplateError as e:
            raise ModelLoadError(f"cannot compile the chat template from {origin}: {e}") from e

    @classmethod
    def from_dir(
        cls,
        model_dir: str | Path,
        override: Path | None = None,
        tool_syntax: CallSyntax = CallSyntax.HERMES,
    ) -> ChatTemplate:
        """The template of a checkpoint directory (see the module docstring for the order)."""
        root = Path(model_dir)
        config_file = root / "tokenizer_config.json"
        config: dict[str, Any] = {}
        if config_file.is_file():
            try:
                config = json.loads(config_file.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ModelLoadError(f"cannot parse {config_file}: {e}") from e
        special = {k: t for k in _SPECIAL_TOKENS if (t := _token_text(config.get(k))) is not None}
        jinja_file = root / "chat_template.jinja"
        for file in (override, jinja_file if jinja_file.is_file() else None):
            if file is not None:
                return cls(file.read_text(encoding="utf-8"), special, str(file), tool_syntax)
        source = _from_config(config, config_file)
        if source is not None:
            return cls(source, special, str(config_file), tool_syntax)
        return cls(FALLBACK_TEMPLATE, special, "fallback (ChatML)", tool_syntax)

    def render(
        self,
        messages: Sequence[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        documents: Sequence[Mapping[str, str]] | None = None,
        extra: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The prompt text of a conversation; ``InvalidArgumentError`` on ``messages`` when the
        template refuses it or fails on it (or on the arguments of a call in it that are not
        a JSON object).

        ``continue_final_message``: the text ends with the last message's content, open for
        the model to continue it (what follows it in the template, an end-of-turn token, is
        cut), as ``apply_chat_template`` does. ``documents``, ``extra`` and ``tools`` (the
        tools as templates read them) are passed to the template as variables."""
        rendered = [_message(m, i) for i, m in enumerate(messages)]
        if tools and not self.renders_tools:
            rendered = prompt_messages(rendered, tools, self.tool_syntax)
        variables = {
            **self.special_tokens,
            **(extra or {}),
            "messages": rendered,
            "add_generation_prompt": add_generation_prompt,
        }
        if tools:
            variables["tools"] = list(tools)
        variables.setdefault("tools", None)  # as transformers passes it
        if documents is not None:
            variables["documents"] = [dict(d) for d in documents]
        try:
            text = self._template.render(**variables)
        except TemplateRaisedError as e:
            raise InvalidArgumentError("messages", str(e)) from e
        except (jinja2.TemplateError, TypeError, ValueError, KeyError) as e:
            raise InvalidArgumentError(
                "messages", f"the chat template ({self.origin}) failed: {e}"
            ) from e
        return _open_ended(text, messages[-1].text()) if continue_final_message else text


def _message(m: ChatMessage, index: int) -> dict[str, Any]:
    """A message as templates read it: role and content, and the optional keys it has."""
    out: dict[str, Any] = {"role": m.role, "content": m.text()}
    for key in ("name", "tool_call_id"):
        value = getattr(m, key)
        if value:
            out[key] = value
    if m.tool_calls:
        out["tool_calls"] = template_tool_calls(m.tool_calls, f"messages[{index}].tool_calls")
    return out


def _open_ended(text: str, final: str) -> str:
    """``text`` cut right after the last occurrence of the final message's content."""
    stripped = final.strip()
    at = text.rfind(stripped)
    if at < 0:
        raise InvalidArgumentError(
            "continue_final_message", "the last message's content is not in the rendered chat"
        )
    whole = final.lstrip()
    keep = len(whole) if text[at : at + len(whole)] == whole else len(stripped)
    return text[: at + keep]
