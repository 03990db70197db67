"""A chat request's ``tools``: checked, rendered into the prompt, and how its answer is read.

* ``tool_use`` checks ``tools``, ``tool_choice`` and ``parallel_tool_calls`` (a 400
  naming the field at fault: ``tools[1].function.name``) into a ``ToolUse``, or None when the
  request has no tools;
* the chat template gets ``tools`` as Hugging Face's ``apply_chat_template`` gives them
  (``[{"type": "function", "function": {...}}]``) and earlier calls' arguments as objects
  (``template_tool_calls``). A template that never reads ``tools`` gets the conversation with
  the tools written in by the gateway instead (``prompt_messages``), in the format the
  gateway's parser reads: Hermes (Qwen2.5's words) or Llama 3.1's JSON calls;
* ``ToolUse.rules`` says how the answer is read (``toolparse``): ``auto`` with the gateway's
  parser, ``required`` and a named function through a guide (``ToolUse.guide``, a JSON schema
  the engine enforces, so the calls always parse), ``none`` not at all (the tools are still
  rendered, as vLLM does).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.errors import InvalidArgumentError
from pdserve.gateway.errors import bad_request
from pdserve.gateway.protocol import MessageToolCall, ToolChoice, ToolDefinition
from pdserve.gateway.toolparse import HERMES_CLOSE, HERMES_OPEN, CallRules, CallSyntax

NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
"""A function name, as OpenAI takes it."""
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
_DEFS = "$defs"

HERMES_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""
"""The tools section of a system prompt for templates that render none (Qwen2.5's)."""
LLAMA3_PROMPT = """Given the following functions, please respond with a JSON for a function \
call with its proper arguments that best answers the given prompt.

Respond in the format {{"name": function name, "parameters": dictionary of argument name and \
its value}}. Do not use variables.

{tools}"""
"""The same for ``--tool-call-parser llama3_json`` (Llama 3.1's JSON tool calling)."""


@dataclass(frozen=True, slots=True)
class ToolUse:
    """A request's tools and what it asks of them."""

    tools: tuple[ToolDefinition, ...]
    choice: str
    """``none``, ``auto``, ``required`` or ``named``."""
    named: str = ""
    """The function ``tool_choice`` names."""
    parallel: bool = True
    """``parallel_tool_calls``: false takes one call at most."""

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t.function.name for t in self.tools)

    @property
    def guided(self) -> bool:
        """The answer is guided (``guide``): ``required`` or a named function."""
        return self.choice in ("required", "named")

    def template_tools(self) -> list[dict[str, Any]]:
        """The tools as chat templates read them."""
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def rules(self, parser: CallSyntax) -> CallRules | None:
        """How the answer is read; None: not at all (``tool_choice: "none"``)."""
        most = None if self.parallel else 1
        if self.choice == "none":
            return None
        if self.choice == "named":
            return CallRules(CallSyntax.NAMED, self.names, named=self.named)
        syntax = CallSyntax.REQUIRED if self.choice == "required" else parser
        return CallRules(syntax, self.names, max_calls=most)

    def guide(self) -> dict[str, Any] | None:
        """The JSON schema the answer must follow: the named function's parameters, or for
        ``required`` an array of ``{"name", "parameters"}`` objects, one of each function's
        (``maxItems`` 1 without ``parallel``); None for ``auto`` and ``none``."""
        if not self.guided:
            return None
        if self.choice == "named":
            return _parameters(next(t for t in self.tools if t.function.name == self.named))
        defs: dict[str, Any] = {}
        cases = []
        for i, tool in enumerate(self.tools):
            parameters = dict(_parameters(tool))
            for key, value in parameters.pop(_DEFS, {}).items():
                if defs.setdefault(key, value) != value:
                    raise bad_request(
                        f"tools[{i}].function.parameters",
                        f'"$defs" has "{key}" unlike another function\'s "{key}", and '
                        'tool_choice "required" puts the functions in one schema',
                    )  # fmt: skip
            cases.append({
                "type": "object",
                "properties": {"name": {"const": tool.function.name}, "parameters": parameters},
                "required": ["name", "parameters"],
            })  # fmt: skip
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": cases}}
        if not self.parallel:
            schema["maxItems"] = 1
        if defs:
            schema[_DEFS] = defs
        return schema


def _parameters(tool: ToolDefinition) -> dict[str, Any]:
    return tool.function.parameters or NO_PARAMETERS


def tool_use(
    tools: Sequence[ToolDefinition] | None,
    tool_choice: ToolChoice | None = None,
    parallel_tool_calls: bool | None = None,
) -> ToolUse | None:
    """A request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``, checked (see the
    module docstring); None without tools."""
    choice = tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice", "is only allowed when tools are given")
        if parallel_tool_calls is not None:
            raise bad_request("parallel_tool_calls", "is only allowed when tools are given")
        return None
    seen: dict[str, int] = {}
    for i, tool in enumerate(tools):
        function = tool.function
        where = f"tools[{i}].function"
        if not NAME.fullmatch(function.name):
            raise bad_request(
                f"{where}.name", f"{function.name!r} is not 1 to 64 letters, digits, _ or -"
            )
        if function.name in seen:
            raise bad_request(
                f"{where}.name", f"{function.name!r} is tools[{seen[function.name]}]'s name too"
            )
        seen[function.name] = i
        parameters = function.parameters
        if parameters and parameters.get("type") != "object":
            raise bad_request(f"{where}.parameters", 'must be a JSON schema of "type": "object"')
    kind: str
    if choice is None or isinstance(choice, str):
        kind, named = choice or "auto", ""
    else:
        kind, named = "named", choice.function.name
        if named not in seen:
            raise bad_request("tool_choice.function.name", f"no tool is named {named!r}")
    return ToolUse(tuple(tools), kind, named, parallel_tool_calls is not False)


def template_tool_calls(calls: Sequence[MessageToolCall], where: str) -> list[dict[str, Any]]:
    """Earlier calls as templates read them: arguments as an object (``InvalidArgumentError``
    naming ``{where}[j].function.arguments`` for text that is not a JSON object)."""
    out = []
    for j, call in enumerate(calls):
        arguments: Any = call.function.arguments
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                arguments = None
            if not isinstance(arguments, dict):
                raise InvalidArgumentError(
                    f"{where}[{j}].function.arguments", "must be a JSON object's text"
                )
        function = {"name": call.function.name, "arguments": arguments}
        out.append({**({"id": call.id} if call.id else {}), "type": "function",
                    "function": function})  # fmt: skip
    return out


def _call_text(call: Mapping[str, Any], syntax: CallSyntax) -> str:
    function = call["function"]
    if syntax is CallSyntax.LLAMA3_JSON:
        return json.dumps({"name": function["name"], "parameters": function["arguments"]},
                          ensure_ascii=False)  # fmt: skip
    body = json.dumps({"name": function["name"], "arguments": function["arguments"]},
                      ensure_ascii=False)  # fmt: skip
    return f"{HERMES_OPEN}\n{body}\n{HERMES_CLOSE}"


def prompt_messages(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]], syntax: CallSyntax
) -> list[dict[str, Any]]:
    """A conversation (templates' messages) with its tools written in, for a template that
    renders none: the tools section of ``syntax``'s prompt at the end of the first system
    message (or as a system message of its own), earlier calls in the content of their
    assistant messages, and (Hermes) tool results in ``<tool_response>`` tags."""
    listed = [json.dumps(t, ensure_ascii=False) for t in tools]
    if syntax is CallSyntax.LLAMA3_JSON:
        section = LLAMA3_PROMPT.format(tools="\n\n".join(listed))
    else:
        section = HERMES_PROMPT.format(tools="\n".join(listed))
    out = [dict(m) for m in messages]
    if out and out[0]["role"] in ("system", "developer"):
        out[0]["content"] = f"{out[0]['content']}\n\n{section}"
    else:
        out.insert(0, {"role": "system", "content": section})
    separator = "; " if syntax is CallSyntax.LLAMA3_JSON else "\n"
    for message in out:
        calls = message.get("tool_calls")
        if calls:
            written = separator.join(_call_text(c, syntax) for c in calls)
            before = message["content"]
            message["content"] = f"{before}\n{written}" if before else written
        if message["role"] == "tool" and syntax is CallSyntax.HERMES:
            message["content"] = f"<tool_response>\n{message['content']}\n</tool_response>"
    return out
