"""Tool calls written as text in message content (envhub/util/toolcalls.py): the forms
models emit when served without a tool-call parser, and what cannot be read."""

from __future__ import annotations

import json
import time

from envhub.util import toolcalls


def names_and_arguments(content: str) -> list[tuple[str, dict]]:
    return [(c["name"], c["arguments"]) for c in toolcalls.parse(content).calls]


def test_hermes_json_blocks_in_order_with_the_text_around_them_kept_apart():
    content = (
        "First I look.\n<tool_call>\n"
        + json.dumps({"name": "run_command", "arguments": {"command": "ls"}})
        + "\n</tool_call>\nThen I write.<tool_call>"
        + json.dumps({"name": "write_file", "arguments": json.dumps({"path": "a", "content": "b"})})
        + "</tool_call>"
    )
    parsed = toolcalls.parse(content)
    assert [(c["name"], c["arguments"]) for c in parsed.calls] == [
        ("run_command", {"command": "ls"}),
        ("write_file", {"path": "a", "content": "b"}),
    ]
    assert parsed.errors == [] and parsed.content == "First I look.\n\nThen I write."
    assert len({c["id"] for c in parsed.calls}) == 2


def test_llama_parameters_and_missing_arguments():
    assert names_and_arguments('<tool_call>{"name": "f", "parameters": {"x": 1}}</tool_call>') == [("f", {"x": 1})]
    assert names_and_arguments('<tool_call>{"name": "f"}</tool_call>') == [("f", {})]


def test_qwen3_coder_xml_keeps_code_exactly():
    code = "def f(x):\n    if x < 0:\n        return '<no>'\n    return x"
    content = f"<tool_call>\n<function=run_python>\n<parameter=code>\n{code}\n</parameter>\n</function>\n</tool_call>"
    assert names_and_arguments(content) == [("run_python", {"code": code})]
    two = (
        "<tool_call><function=write_file><parameter=path>a.txt</parameter>"
        "<parameter=content>hi</parameter></function></tool_call>"
    )
    assert names_and_arguments(two) == [("write_file", {"path": "a.txt", "content": "hi"})]


def test_what_cannot_be_read_is_an_error_never_a_guess():
    cases = {
        "<tool_call>{not json}</tool_call>": "not JSON",
        '<tool_call>["run_command"]</tool_call>': "must be {",
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>': "must be a JSON object",
        '<tool_call>{"name": "f", "arguments": "{oops"}</tool_call>': "are not JSON",
        '<tool_call>{"name": "f", "arguments": {}}': "not closed",
        "<tool_call><function></tool_call>": "not JSON",
    }
    for content, why in cases.items():
        parsed = toolcalls.parse(content)
        assert parsed.calls == [] and len(parsed.errors) == 1 and why in parsed.errors[0], (content, parsed)
    assert not toolcalls.parse("no calls here, just ```python\nprint(1)\n```")


def test_a_block_nested_past_any_limit_is_an_error_not_a_crash():
    deep = "[" * 50_000 + "]" * 50_000
    got = toolcalls.parse(f'<tool_call>{{"name": "run_python", "arguments": {deep}}}</tool_call>')
    assert got.calls == [] and len(got.errors) == 1 and "not JSON" in got.errors[0]
    got = toolcalls.parse(f'<tool_call>{{"name": "run_python", "arguments": {json.dumps(deep)}}}</tool_call>')
    assert got.calls == [] and len(got.errors) == 1 and "not JSON" in got.errors[0]


def test_a_long_run_of_unclosed_parameter_tags_is_read_in_linear_time():
    """``<parameter=a<parameter=a...`` made the old name pattern scan to the end of the
    text from every start: minutes for a 300 kB reply. Now a name stops at ``<``."""
    started = time.monotonic()
    got = toolcalls.parse("<tool_call><function=f>" + "<parameter=a" * 25_000 + "</function></tool_call>")
    assert time.monotonic() - started < 10, "a liveness bound, 100x what it takes: the old pattern took minutes"
    assert [c["name"] for c in got.calls] == ["f"] and got.calls[0]["arguments"] == {}
    got = toolcalls.parse("<tool_call><function=f<function=g>x</function></tool_call>")
    assert got.calls == [] and got.errors == ["a <function=...> block is malformed"]
