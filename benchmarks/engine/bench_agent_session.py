"""A replayed multi-round agent session through the chat API with tools, drafts on against off.

Method. One session, as a coding agent runs it: tools ``read_file`` and ``run_command``
(OpenAI ``tools``, ``tool_choice: auto`` unless said), files edited in the "whole file" format
(the file written back in a code block, which the harness saves), and rounds, each editing
one of radixserve's own source files (``--edits``: ``path:old:new``; a path named again is
edited again, from what the model last wrote of it). A round is:

1. the user asks for the rename of ``old`` to ``new`` in ``path``;
2. **measured**: the model's ``read_file`` call (``tool_choice`` naming it: a call shaped like
   the ones before it), whose result is the file's text (its real content; in a later round
   on the same path, what the model wrote last);
3. **measured**: asked to (a user message, as the harness of a "whole file" edit format
   sends), the model writes the file back, whole, in a code block (most of it the tool
   result it just read);
4. the agent checks the work: a ``run_command`` call for ``git diff`` (scripted, as the
   harness would make it) whose result is the real unified diff between what the file held
   and what the model wrote (code quoted back, as command output does);
5. **measured**: the model's next message (at most ``--reply-tokens`` tokens); a call it
   makes, there or in 3., gets the harness's answer (a file read returns the file).

Every measured message goes into the history as the model wrote it (tool-call ids are the
session's own). So every turn repeats earlier text: the file read back, the written file
read again, the diff quoting both, the history of every earlier round resent (the prefix
cache serves it). One server per draft setting (``draft_ab.SYSTEMS``) runs the whole session,
each round on every setting in a rotated order; greedy, no repetition penalty, 1 stream, the
server timing each request (``draft_ab.Server.chat``). The figure per setting is the measured
turns' decode tokens over their decode seconds; ``ratios`` divide by ``none``'s. Also the
draft counters per source and whether every setting wrote the same messages (they must: the
histories are then the same too).

Prints one JSON line. Small scope (a few minutes on 2 cores):
``python -m benchmarks.engine.bench_agent_session --rounds 2 --systems none,all``.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import re
import signal
import sys
from pathlib import Path

from benchmarks.common import cpu_model
from benchmarks.engine.draft_ab import (
    Server,
    Tally,
    add_systems_arg,
    ratios,
    rotated,
    start_servers,
)

ROOT = Path(__file__).resolve().parents[2]
EDITS = (
    "radixserve/cache/tree_node.py:lock_ref:lock_count",
    "radixserve/cache/tree_node.py:namespace:tenant_key",
    "radixserve/engine/policy.py:ordered:ranked",
)
SYSTEM_PROMPT = (
    "You are a coding agent working in a Python repository. Use the tools to read and check files."
)
WRITE_ASK = ("Reply with the whole updated file in one code block, nothing else: the harness "
             "saves it.")  # fmt: skip


def tool(name: str, description: str, **props: str) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "required": list(props),
                       "properties": {k: {"type": "string", "description": v}
                                      for k, v in props.items()}}}}  # fmt: skip


TOOLS = [
    tool("read_file", "Read a file of the repository.", path="the file's path"),
    tool("run_command", "Run a shell command in the repository.", command="the command"),
]


class Session:
    """The history of one session on one server, and what its measured turns wrote."""

    def __init__(self, server: Server, args: argparse.Namespace):
        self.server, self.args = server, args
        self.messages: list[dict] = [{"role": "system", "content": SYSTEM_PROMPT}]
        self.files: dict[str, str] = {}  # what the model last wrote, by path
        self.written: list[str] = []  # every measured message, as JSON
        self.tally = Tally()
        self.calls = 0

    def scripted_call(self, name: str, arguments: dict, result: str) -> None:
        self.calls += 1
        call_id = f"call_{self.calls}"
        self.messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": name, "arguments": json.dumps(arguments)}}]})  # fmt: skip
        self.messages.append({"role": "tool", "tool_call_id": call_id, "content": result})

    def measured(self, max_tokens: int, tool_choice: object) -> dict:
        message, t = self.server.chat(self.messages, max_tokens, tools=TOOLS,
                                      tool_choice=tool_choice)  # fmt: skip
        self.tally.add(t)
        kept = {"role": "assistant", "content": message.get("content")}
        calls = []
        for call in message.get("tool_calls") or []:  # ids of the session's own: the
            self.calls += 1  # server draws random ones, which would differ per setting
            calls.append({"id": f"call_{self.calls}", "type": "function",
                          "function": call["function"]})  # fmt: skip
        if calls:
            kept["tool_calls"] = calls
        self.messages.append(kept)
        self.written.append(json.dumps(kept, sort_keys=True))
        return kept

    def round(self, path: str, old: str, new: str) -> None:
        before = self.files.get(path) or (ROOT / path).read_text()
        self.messages.append({"role": "user", "content": f"Rename `{old}` to `{new}` everywhere "
                              f"in `{path}`."})  # fmt: skip
        read = {"type": "function", "function": {"name": "read_file"}}
        call = self.measured(self.args.reply_tokens, read)
        for c in call.get("tool_calls") or []:  # the harness reads the file the task names
            self.messages.append({"role": "tool", "tool_call_id": c["id"], "content": before})
        if not call.get("tool_calls"):
            self.scripted_call("read_file", {"path": path}, before)
        self.messages.append({"role": "user", "content": WRITE_ASK})
        after = written_content(self.answer(self.measured(self.args.write_tokens, "auto"), before))
        self.files[path] = after
        diff = "".join(difflib.unified_diff(before.splitlines(True), after.splitlines(True),
                                            f"a/{path}", f"b/{path}"))  # fmt: skip
        self.scripted_call("run_command", {"command": f"git diff -- {path}"}, diff or "(no diff)")
        self.answer(self.measured(self.args.reply_tokens, "auto"), after)

    def answer(self, message: dict, content: str) -> dict:
        """Answer the calls ``message`` makes as the harness would (a file read returns
        ``content``, the file of this round; a command returns nothing)."""
        for c in message.get("tool_calls") or []:
            result = content if c["function"]["name"] == "read_file" else "(no output)"
            self.messages.append({"role": "tool", "tool_call_id": c["id"], "content": result})
        return message


def written_content(message: dict) -> str:
    """The file the model wrote: the first code block of its text ('' without one)."""
    block = re.search(r"```[a-z]*\n(.*?)(?:```|\Z)", message.get("content") or "", re.S)
    return block.group(1) if block else ""


def run(args: argparse.Namespace) -> dict:
    names = args.systems.split(",")
    edits = [e.split(":") for e in args.edits][: args.rounds]
    with contextlib.ExitStack() as stack:
        servers = start_servers(stack, names, args.model, args.threads, args.context_length)
        sessions = {n: Session(servers[n], args) for n in names}
        for k, (path, old, new) in enumerate(edits):
            for name in rotated(names, k):
                sessions[name].round(path, old, new)
            print(f"agent_session: round {k + 1}/{len(edits)}", file=sys.stderr, flush=True)
    same = len({tuple(s.written) for s in sessions.values()}) == 1
    rates = {n: s.tally.rate for n, s in sessions.items()}
    return {"rounds": len(edits), "edits": args.edits[: len(edits)],
            "systems": {n: s.tally.summary() for n, s in sessions.items()},
            "ratios": ratios(rates), "same_outputs": same,
            "writes_parsed": all(s.files.values() for s in sessions.values())}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--edits", nargs="+", default=list(EDITS), help="path:old:new ...")
    parser.add_argument("--rounds", type=int, default=len(EDITS), help="the first N edits")
    parser.add_argument("--write-tokens", type=int, default=3072,
                        help="most tokens of a file written back")  # fmt: skip
    parser.add_argument("--reply-tokens", type=int, default=128,
                        help="most tokens of the message after the diff")  # fmt: skip
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context-length", type=int, default=16384)
    add_systems_arg(parser)
    args = parser.parse_args()
    for e in args.edits:
        if len(e.split(":")) != 3 or not (ROOT / e.split(":")[0]).is_file():
            parser.error(f"--edits: {e!r} is not path:old:new with a file of the repository")
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stop the servers on the way out
    result = run(args)
    print(json.dumps({"bench": "agent_session", "model": args.model, "threads": args.threads,
                      "cpu": cpu_model(), **result}))  # fmt: skip


if __name__ == "__main__":
    main()
