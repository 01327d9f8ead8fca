"""A stand-in for the trainer's OpenAI-compatible model proxy, which cannot run here.

It replays scripted conversations: the session id in the URL
(``/v1/<session>/chat/completions``) names the script, and the number of assistant
messages already in the request picks the turn. Every request is recorded so tests can
check what the agent sent.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def call(name: str, **arguments) -> dict:
    return {
        "id": f"call_{name}_{time.monotonic_ns()}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }


GREET = "printf '#!/bin/bash\\necho \"Hello, $1!\"\\n' > /app/greet.sh && chmod +x /app/greet.sh"

# The three steps of the published multi-step task, each as one shell command.
MULTI_STEP_SCRIPTS = [
    "printf '#!/bin/bash\\necho hello\\n' > /app/greet.sh && chmod +x /app/greet.sh",
    "printf '#!/bin/bash\\necho \"Hello, $(cat /app/config.txt)!\"\\n' > /app/greet.sh",
    "printf '# greet.sh\\n\\nReads config.txt.\\n\\n```bash\\n./greet.sh\\n```\\n' > /app/README.md",
]

SCRIPTS = {
    "solve": [
        {
            "content": "I'll create the file.",
            "tool_calls": [call("write_file", path="/app/hello.txt", content="Hello, envhub!\n")],
        },
        {"content": "", "tool_calls": [call("run_command", command=GREET)]},
        {"content": "", "tool_calls": [call("run_command", command="/app/greet.sh Ada")]},
        {"content": "Done."},
    ],
    "giveup": [{"content": "I cannot do this task."}],
    "malformed": [
        {
            "content": "",
            "tool_calls": [
                {"id": "x", "type": "function", "function": {"name": "run_command", "arguments": "{not json"}}
            ],
        }
    ],
    "slow": [{"content": "too late", "sleep": 30}],
    # A degenerate generation: arguments nested past any JSON decoder's recursion limit.
    "degenerate": [
        {
            "content": "",
            "tool_calls": [
                {
                    "id": "d",
                    "type": "function",
                    "function": {"name": "run_command", "arguments": "[" * 50_000 + "]" * 50_000},
                }
            ],
        }
    ],
    # Two calls in one reply, then done: SETA counts 2 tool calls, at most 2 in parallel.
    "twocalls": [
        {
            "content": "",
            "tool_calls": [
                call("write_file", path="/app/hello.txt", content="Hello, envhub!\n"),
                call("run_command", command=GREET),
            ],
        },
        {"content": "Done."},
    ],
    # A model served without a tool-call parser: its calls arrive as text in the content.
    "texted": [
        {
            "content": "I'll write the files.\n<tool_call>\n"
            + json.dumps({"name": "write_file", "arguments": {"path": "/app/hello.txt", "content": "Hello, envhub!\n"}})
            + "\n</tool_call>\n<tool_call>\n"
            + json.dumps({"name": "run_command", "arguments": {"command": GREET}})
            + "\n</tool_call>"
        },
        {"content": "Done."},
    ],
    "garbled": [
        {"content": '<tool_call>{"name": "run_command", "arguments": {"command": "ls"</tool_call>'},
        {"content": "Sorry."},
    ],
    "cut": [{"content": "Let me think about this for a very long", "finish_reason": "length"}],
    # The published multi-step task (tests/test_tbench_steps.py): each step, then finish_step.
    "multistep": [
        {"content": "", "tool_calls": [call("run_command", command=MULTI_STEP_SCRIPTS[0])]},
        {"content": "", "tool_calls": [call("finish_step")]},
        {"content": "", "tool_calls": [call("run_command", command=MULTI_STEP_SCRIPTS[1])]},
        {"content": "", "tool_calls": [call("finish_step")]},
        {"content": "", "tool_calls": [call("run_command", command=MULTI_STEP_SCRIPTS[2])]},
        {"content": "", "tool_calls": [call("finish_step")]},
        {"content": "Done."},
    ],
    # The same, stopping after the first step without handing it in.
    "multistop": [
        {"content": "", "tool_calls": [call("run_command", command=MULTI_STEP_SCRIPTS[0])]},
        {"content": "Done."},
    ],
    # plugins_contrib/envhub-arith's task "mix": compute with its python tool, then answer.
    "arith": [
        {"content": "", "tool_calls": [call("python", code="print((7 + 3) * 11 - 4)")]},
        {"content": "", "tool_calls": [call("answer", value=106)]},
        {"content": "Done."},
    ],
}


class Handler(BaseHTTPRequestHandler):
    server: StandIn

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        parts = self.path.strip("/").split("/")  # v1, <session>, chat, completions
        session = parts[1] if len(parts) == 4 else ""
        self.server.requests.append(
            {"session": session, "path": self.path, "body": body, "authorization": self.headers.get("Authorization")}
        )
        script = SCRIPTS.get(session.split("-")[0])
        if script is None:
            self._send(404, {"error": {"message": f"no script for {session!r}"}})
            return
        turn = sum(1 for m in body["messages"] if m["role"] == "assistant")
        reply = dict(script[min(turn, len(script) - 1)])
        if reply.pop("sleep", 0):
            time.sleep(30)
            return
        finish = reply.pop("finish_reason", "tool_calls" if reply.get("tool_calls") else "stop")
        self._send(
            200,
            {
                "id": "chatcmpl-x",
                "object": "chat.completion",
                "model": body.get("model"),
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": finish,
                        "message": {"role": "assistant", **reply},
                    }
                ],
                "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
            },
        )

    def _send(self, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def log_message(self, *args) -> None:
        pass


class StandIn(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.requests: list[dict] = []
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def __enter__(self) -> StandIn:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
        self.server_close()
