"""`dolmus chat` driven through a pseudo-terminal, as a person types, against a real server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pexpect
import pytest
from server_helpers import RemoteServer

from dolmus.bench.spawn import free_port

PROMPT = ">>> "
KEY = "sekret"
# stories260k is a base model: a plain "role: content" template makes it answer.
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


@pytest.fixture(scope="module")
def server():
    with RemoteServer("--chat-template", TEMPLATE, "--api-key", KEY) as s:
        yield s


def spawn_chat(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> pexpect.spawn:
    # A wide terminal keeps readline from wrapping lines; TERM=dumb keeps escape codes out.
    base = {k: v for k, v in os.environ.items() if k != "DOLMUS_API_KEY"}
    return pexpect.spawn(
        sys.executable,
        ["-m", "dolmus.cli", "chat", *args],
        env={**base, "TERM": "dumb", "HF_HUB_OFFLINE": "1", **(env or {})},
        encoding="utf-8",
        timeout=timeout,
        dimensions=(50, 500),
    )


def until_prompt(child: pexpect.spawn) -> str:
    """What the chat printed after the echoed input line, up to its next prompt."""
    child.expect_exact(PROMPT)
    lines = child.before.replace("\r", "").split("\n")
    return "\n".join(lines[1:]).strip()


def send(child: pexpect.spawn, line: str) -> str:
    child.sendline(line)
    return until_prompt(child)


def bye(child: pexpect.spawn) -> int:
    child.sendline("/bye")
    child.expect(pexpect.EOF)
    child.close()
    return child.exitstatus


def prompt_tokens(server: RemoteServer) -> float:
    return server.metrics()["dolmus:prompt_tokens_total"]


def test_conversation_streams_keeps_history_and_settings(server, tmp_path):
    child = spawn_chat("--url", server.url, env={"DOLMUS_API_KEY": KEY})
    until_prompt(child)
    assert send(child, "/set temperature 0.0") == "temperature = 0.0"
    assert send(child, "/set max_tokens 20") == "max_tokens = 20"
    shown = send(child, "/show")
    assert "model: stories260k" in shown and server.url in shown
    assert "temperature: 0.0" in shown and "max_tokens: 20" in shown and "top_p: default" in shown

    # Every turn sends the whole conversation: the same question costs more prompt tokens
    # the second time.
    before = prompt_tokens(server)
    first = send(child, "hello")
    after_first = prompt_tokens(server)
    assert first
    send(child, "hello")
    after_second = prompt_tokens(server)
    assert after_second - after_first > after_first - before > 0

    # Greedy: the same question on a fresh conversation gives the same answer.
    assert send(child, "/clear") == "conversation cleared"
    assert send(child, "hello") == first

    # A multi-line message between two """ lines is one message.
    child.sendline('"""')
    child.expect_exact("... ")
    child.sendline("line one")
    child.expect_exact("... ")
    child.sendline('line two"""')
    assert until_prompt(child)

    path = tmp_path / "chat.json"
    assert send(child, f"/save {path}") == f"saved 4 messages to {path}"
    saved = json.loads(path.read_text())
    assert [m["role"] for m in saved["messages"]] == ["user", "assistant", "user", "assistant"]
    assert saved["messages"][0]["content"] == "hello"
    assert saved["messages"][1]["content"].strip() == first
    assert saved["messages"][2]["content"] == "line one\nline two"
    assert saved["options"] == {"temperature": 0.0, "max_tokens": 20}

    send(child, "/clear")
    assert "history: 0 messages" in send(child, "/show")
    assert send(child, f"/load {path}") == f"loaded 4 messages from {path}"
    assert "history: 4 messages" in send(child, "/show")
    assert bye(child) == 0


def test_mistakes_and_server_errors_keep_the_session(server):
    child = spawn_chat("--url", f"{server.url}/v1", "--api-key", KEY)
    until_prompt(child)
    assert "error: temperature must be a number >= 0, got '-1'" in send(child, "/set temperature -1")
    assert "error: unknown setting 'temprature'" in send(child, "/set temprature 1")
    assert "error: unknown command /frobnicate" in send(child, "/frobnicate")
    assert "error: cannot read" in send(child, "/load /nonexistent/chat.json")
    # Accepted here, refused by the server (400): its message is shown.
    send(child, "/set max_tokens 2000")
    answer = send(child, "hi")
    assert "error: server answered 400" in answer and "maximum context length is 512" in answer
    assert "history: 0 messages" in send(child, "/show")  # an unanswered turn is not kept
    send(child, "/set max_tokens 10")
    assert send(child, "hi") and not send(child, "hi").startswith("error")
    # Ctrl+C at the prompt says how to leave; Ctrl+D leaves.
    child.sendintr()
    child.expect_exact("Use Ctrl+D or /bye to exit.")
    child.expect_exact(PROMPT)
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_ctrl_c_stops_the_answer_and_the_server_aborts_it(server):
    def aborted() -> float:
        return server.metrics()['dolmus:request_success_total{finished_reason="abort"}']

    child = spawn_chat("--url", server.url, "--api-key", KEY)
    until_prompt(child)
    send(child, "/set temperature 0")
    before = aborted()
    child.sendline("Tell me a story")  # greedy, this runs on to the end of the 512-token context
    child.expect_exact("Tell me a story\r\n")
    child.expect(r"\w")  # the answer is streaming
    child.sendintr()
    child.expect_exact(PROMPT)
    deadline = time.monotonic() + 30  # the abort is counted once the server sees the disconnect
    while aborted() == before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert aborted() == before + 1
    assert "history: 2 messages" in send(child, "/show")  # the partial answer stays
    send(child, "/set max_tokens 10")
    assert not send(child, "and then?").startswith("error")
    assert bye(child) == 0


def test_unreachable_server(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    child = spawn_chat("--url", url, "--model-name", "m")
    until_prompt(child)
    assert f"error: cannot connect to {url}" in send(child, "hi")
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0

    run = [sys.executable, "-m", "dolmus.cli", "chat", "--url", url]
    done = subprocess.run(run, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=60)
    assert done.returncode == 1 and "cannot connect" in done.stderr
    done = subprocess.run([*run, "--model", "x"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "do not go with --url" in done.stderr


def test_local_model_with_engine_flags():
    child = spawn_chat("--max-model-len", "256", timeout=180)
    child.expect_exact("loading the built-in model...")
    until_prompt(child)
    shown = send(child, "/show")
    assert "(256 tokens of context)" in shown and "(private, stops on exit)" in shown
    url = shown.split("server: ")[1].split()[0]
    # Ctrl+C stops the answer, not the private server (it runs outside the terminal's group).
    child.sendline("Tell me a story")
    child.expect_exact("Tell me a story\r\n")
    child.expect(r"\w")
    child.sendintr()
    child.sendline("/set max_tokens 5")
    child.expect_exact("max_tokens = 5")
    until_prompt(child)
    answer = send(child, "hello")
    assert answer and "error" not in answer
    assert bye(child) == 0
    with pytest.raises(httpx.ConnectError):  # the private server stopped with the chat
        httpx.get(f"{url}/health", timeout=5)
