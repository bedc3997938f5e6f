"""The tool-call parser under the three chat APIs: text streams before a call, calls parse
whole or split at any point, bare and fenced calls of known tools count, malformed blocks
fall back to text, and constrained outputs parse once ended."""

from __future__ import annotations

import pytest

from radixserve.api.tool_stream import Call, Text, ToolStream

ARGS = '{"city": "Oslo"}'
CALL = f'{{"name": "get", "arguments": {ARGS}}}'


def run(text: str, step: int, constrained: bool = False, parallel: bool = True):
    parser = ToolStream(frozenset({"get"}), constrained, parallel)
    pieces = []
    for i in range(0, len(text), step):
        pieces += parser.feed(text[i : i + step])
    pieces += parser.finish()
    merged: list = []
    for p in pieces:  # text split across deltas joins up again
        if isinstance(p, Text) and merged and isinstance(merged[-1], Text):
            merged[-1] = Text(merged[-1].text + p.text)
        else:
            merged.append(p)
    return merged


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
@pytest.mark.parametrize(
    "text, expected",
    [
        (f"Let me look.\n<tool_call>\n{CALL}\n</tool_call>\n",
         [Text("Let me look."), Call("get", ARGS)]),
        (CALL, [Call("get", ARGS)]),
        (f"```json\n{CALL}\n```", [Call("get", ARGS)]),
        (f"{CALL}\n{{\"temp\": 3}}", [Call("get", ARGS), Text('{"temp": 3}')]),
        (f"{{\"temp\": 3}}\n{CALL}", [Text('{"temp": 3}'), Call("get", ARGS)]),
        ('{"answer": 3}', [Text('{"answer": 3}')]),  # not a call of a known tool
        ('{"name": "other", "arguments": {}}', [Text('{"name": "other", "arguments": {}}')]),
        ("```python\nprint(1)\n```", [Text("```python\nprint(1)\n```")]),
        ("A <tool_call>{oops}</tool_call> B", [Text("A<tool_call>{oops}</tool_call> B")]),
        (f"<tool_call>{CALL}", [Call("get", ARGS)]),  # no closing tag, but whole
        (f"<tool_call>{CALL[:20]}", [Text(f"<tool_call>{CALL[:20]}")]),  # cut short
        ("a <tool_cal b", [Text("a <tool_cal b")]),
        (f"<tool_call>{CALL}</tool_call> and <tool_call>{CALL}</tool_call> done",
         [Call("get", ARGS), Text("and"), Call("get", ARGS), Text("done")]),
    ],
)  # fmt: skip
def test_auto_outputs_split_into_text_and_calls(text, expected, step):
    assert run(text, step) == expected  # whitespace around calls is dropped


def test_text_before_a_call_streams_before_the_call_ends():
    parser = ToolStream(frozenset({"get"}), False, True)
    assert parser.feed("Checking the weather now ") == [Text("Checking the weather now")]
    assert parser.feed("<tool_call>" + CALL[:10]) == []
    assert parser.feed(CALL[10:] + "</tool_call>") == [Call("get", ARGS)]


def test_constrained_outputs_and_parallel_off():
    assert run(f"[{CALL}, {CALL}]", 3, constrained=True) == [Call("get", ARGS)] * 2
    assert run(f"[{CALL}, {CALL}]", 3, constrained=True, parallel=False) == [Call("get", ARGS)]
    assert run(CALL[:15], 3, constrained=True) == [Text(CALL[:15])]
    two = f"<tool_call>{CALL}</tool_call><tool_call>{CALL}</tool_call>"
    assert run(two, 4, parallel=False) == [Call("get", ARGS)]
