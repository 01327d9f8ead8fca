"""What the model reads at the start of an AppWorld episode, and its one tool.

The system prompt says who the supervisor is, which apps exist, how to discover and call
their APIs from the Python REPL, and how to finish (``apis.supervisor.complete_task``);
the instruction comes as the user turn. Three variants, chosen per episode as in
AgentEvolver's appworld environment: the full prompt, a shorter one for
``params.simple`` (code is sent raw, without fences), and with ``params.prompt: false``
only the closing part (who the supervisor is).
"""

from __future__ import annotations

from typing import Any

from envhub.plugins.appworld.data import APP_DESCRIPTIONS

TOOL = "appworld"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": TOOL,
            "description": (
                "Run Python code in the AppWorld environment (a persistent REPL where `apis.<app>.<api>(...)` "
                "calls the apps' APIs) and see what it printed. Finish the task with "
                "apis.supervisor.complete_task(...)."
            ),
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string", "description": "Python source to run"}},
                "required": ["code"],
            },
        },
    }
]

_DISCOVERY = """\
# the apps you can use
print(apis.api_docs.show_app_descriptions())
# the APIs of one app, e.g. the supervisor app
print(apis.api_docs.show_api_descriptions(app_name='supervisor'))
# the full specification of one API: its parameters and what it returns
print(apis.api_docs.show_api_doc(app_name='supervisor', api_name='show_account_passwords'))"""

_FINISH = """\
When the task is done, call apis.supervisor.complete_task(). If the task asks for \
information, pass it as the answer, with just the entity or number: \
apis.supervisor.complete_task(answer=10), not answer="ten songs". If you are sure the \
task cannot be done, call apis.supervisor.complete_task(status="fail")."""


def _me(supervisor: dict[str, Any]) -> str:
    return (
        f"My name is {supervisor['first_name']} {supervisor['last_name']}. My personal email is "
        f"{supervisor['email']} and my phone number is {supervisor['phone_number']}."
    )


def _full(supervisor: dict[str, Any]) -> str:
    apps = "\n".join(f"- {name}: {text}" for name, text in APP_DESCRIPTIONS.items())
    return f"""\
I am your supervisor, and you are a highly capable AI assistant whose job is to carry out \
my day-to-day tasks on your own.

You do it by operating apps (Spotify, Venmo, Gmail and others) through their APIs on my \
behalf, in a conversation with a Python REPL: each turn you write Python code, the \
environment runs it and shows you what it printed, and you write the next piece of code \
from that, until the task is done. Variables you define stay defined for later turns.

The apps:
{apps}

Three APIs of the api_docs app tell you everything else:

```python
{_DISCOVERY}
```

Call an API as apis.<app>.<api>(...), e.g. apis.spotify.login(username=..., password=...).

Key instructions:
1. Read an API's specification (apis.api_docs.show_api_doc) before you call it, and \
parse its output as the specification says.
2. My account passwords, addresses, payment cards and other personal details are in the \
supervisor app (apis.supervisor.show_account_passwords(), ...). My friends, family and \
anyone else I mention are the contacts in the phone app.
3. Most apps want an access token: log in with my email (or phone number) and that app's \
password from the supervisor app.
4. APIs that return lists return them in pages: go through every page (page_index) until \
one comes back empty.
5. Write one small piece of code per turn, and check that it works before you make a \
change that cannot be undone.
6. Only the Python standard library is there, and what touches the operating system, \
files or processes is blocked. A file system a task mentions is the file_system app.
7. Take the current date and time from the environment (datetime.now() or the phone \
app), never from what you remember; "yesterday" means from 00:00:00 to 23:59:59.
8. Decide everything yourself: never ask me or anyone else to clarify or confirm.
9. {_FINISH}

Each turn, put your code in one ```python block, or pass it as `code` to the appworld tool.

{_closing(supervisor)}"""


def _simple(supervisor: dict[str, Any]) -> str:
    return f"""\
I am your supervisor, and you are an AI assistant who carries out my tasks on your own by \
writing Python code that calls apps' APIs (apis.<app>.<api>(...)) in a REPL. The \
environment runs each piece of code you write and shows you what it printed.

Three APIs tell you which apps and APIs there are and how to call them:

{_DISCOVERY}

Reply with Python code only, without ``` fences: put any thoughts in comments. My \
passwords and personal details are in the supervisor app; people I mention are contacts \
in the phone app. APIs that return lists return pages: go through all of them. \
{_FINISH}

{_closing(supervisor)}"""


def _closing(supervisor: dict[str, Any]) -> str:
    return f"Now write code to carry out my task, which comes next.\n\n{_me(supervisor)}"


def system_prompt(supervisor: dict[str, Any], *, simple: bool = False, template: bool = True) -> str:
    """The system message of an episode (see the module docstring)."""
    if not template:
        return _closing(supervisor)
    return _simple(supervisor) if simple else _full(supervisor)
