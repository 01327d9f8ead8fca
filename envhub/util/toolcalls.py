"""Tool calls a model wrote as text, in message content, instead of as ``tool_calls``.

Served without a tool-call parser (a raw completion endpoint, or a trainer that sends only
``{"role", "content"}`` as AgentEvolver's does), Qwen-family and other models write their
calls into the content. The forms read here:

- Hermes/Qwen 2.5 JSON: ``<tool_call>{"name": "f", "arguments": {...}}</tool_call>``
  (``arguments`` may also be a JSON string, or named ``parameters`` as Llama 3.1 does);
- Qwen3-Coder XML: ``<tool_call><function=f><parameter=x>value</parameter></function></tool_call>``,
  each value a string (the tools envhub's environments offer take strings).

Invariants: the calls come back in the order written, each ``{"id", "name",
"arguments"}`` with ``arguments`` a dict; a block that cannot be read is reported in
``errors`` (one message each) and never guessed at, so a caller can count it as a parse
error and tell the model. A ``<tool_call>`` left open at the end of the content (a reply
cut at its token limit) is an error too. Nothing outside the blocks is interpreted.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from envhub.util import strict_json

_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.S)
# A name stops at "<" too: without it, "<parameter=a<parameter=a..." made each start scan
# to the end of the text and back (quadratic in a reply's length).
_FUNCTION = re.compile(r"<function=([^>\s<]+)>(.*?)(?:</function>|\Z)", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\s<]+)>\n?(.*?)\n?(?:</parameter>|(?=<parameter=)|\Z)", re.S)


@dataclass
class TextToolCalls:
    calls: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    content: str = ""  # the content with the blocks taken out

    def __bool__(self) -> bool:
        return bool(self.calls or self.errors)


def parse(content: str) -> TextToolCalls:
    """The tool calls written in ``content`` (see the module docstring)."""
    out = TextToolCalls(content=content)
    if "<tool_call>" not in content:
        return out
    for match in _BLOCK.finditer(content):
        body = match.group(1).strip()
        closed = match.group(0).endswith("</tool_call>")
        try:
            if not closed:
                raise ValueError("a <tool_call> block is not closed (was the reply cut off?)")
            out.calls.append(_one(body))
        except ValueError as e:
            out.errors.append(str(e))
    out.content = _BLOCK.sub("", content).strip()
    return out


def _one(body: str) -> dict[str, Any]:
    if body.startswith("<function="):
        m = _FUNCTION.match(body)
        if m is None:
            raise ValueError("a <function=...> block is malformed")
        parameters = {name: value for name, value in _PARAMETER.findall(m.group(2))}
        return _call(m.group(1), parameters)
    try:
        data = strict_json.loads(body)  # nested past any limit: an error, not a RecursionError
    except ValueError as e:
        raise ValueError(f"a <tool_call> block is not JSON ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        raise ValueError('a <tool_call> block must be {"name": ..., "arguments": {...}}')
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = strict_json.loads(arguments) if arguments.strip() else {}
        except ValueError as e:
            raise ValueError(f"the arguments of {data['name']} are not JSON ({e})") from None
    if not isinstance(arguments, dict):
        raise ValueError(f"the arguments of {data['name']} must be a JSON object")
    return _call(data["name"], arguments)


def _call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:12]}", "name": name, "arguments": arguments}
