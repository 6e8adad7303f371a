"""`dolmus chat`: a terminal chat, like `ollama run`, over the OpenAI-compatible HTTP API.

The chat is a plain HTTP client of POST /v1/chat/completions (stream=true), so it talks to
any OpenAI-compatible server the same way. Without --url it starts a private `dolmus serve`
on a loopback port and talks to that: one code path, and the model runs in its own process,
so Ctrl+C can stop an answer (the server aborts a request whose client disconnects) without
ever touching the engine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import httpx

PROMPT = ">>> "
CONTINUATION = "... "
BLOCK = '"""'
INTERRUPT_HINT = "Use Ctrl+D or /bye to exit."
LOCAL_STARTUP_TIMEOUT_S = 600.0  # a large GGUF on a CPU can take minutes to load

HELP = f"""\
Commands:
  /set temperature|top_p|top_k|max_tokens|seed VALUE   a sampling setting ("default": the server's)
  /set system TEXT     the system prompt (/set system alone removes it)
  /show                settings, model and server
  /clear               forget the conversation (the system prompt stays)
  /save FILE           write the conversation as JSON
  /load FILE           read a conversation written by /save
  /help                this text
  /bye, /exit          quit (also Ctrl+D at the prompt)
A line {BLOCK} starts a multi-line message that ends with another {BLOCK} line.
Ctrl+C stops an answer (what arrived stays in the conversation)."""


class ChatError(Exception):
    """A request that failed, carrying the server's own message for the user."""


@dataclass(frozen=True)
class _Setting:
    parse: Callable[[str], Any]
    valid: Callable[[Any], bool]
    expected: str


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(text)
    return value


# The server checks these too; checking here first gives the error before a round trip.
SETTINGS: dict[str, _Setting] = {
    "temperature": _Setting(_finite, lambda v: v >= 0, "a number >= 0"),
    "top_p": _Setting(_finite, lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "top_k": _Setting(int, lambda v: v >= -1, "an integer >= 0 (0 or -1: off)"),
    "max_tokens": _Setting(int, lambda v: v >= 1, "an integer >= 1"),
    "seed": _Setting(int, lambda v: True, "an integer"),
}


def parse_setting(name: str, text: str) -> Any:
    """The value of `/set NAME TEXT`, or None for "default"; ValueError says what is expected."""
    spec = SETTINGS.get(name)
    if spec is None:
        raise ValueError(f"unknown setting {name!r}: one of {', '.join([*SETTINGS, 'system'])}")
    if text == "default":
        return None
    try:
        value = spec.parse(text)
    except ValueError:
        value = None
    if value is None or not spec.valid(value):
        raise ValueError(f"{name} must be {spec.expected}, got {text!r}")
    return value


class ChatClient:
    """Streaming chat completions from one OpenAI-compatible server."""

    def __init__(self, url: str, api_key: str | None = None) -> None:
        self.url = url.rstrip("/").removesuffix("/v1")  # accept both http://host:port and .../v1
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # No read timeout: a long prompt on a slow model may take minutes before its first token.
        timeout = httpx.Timeout(None, connect=10.0)
        self._http = httpx.Client(base_url=f"{self.url}/v1", headers=headers, timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def first_model(self) -> tuple[str, int | None]:
        """The first model GET /v1/models lists, and its context length where the server says it."""
        with self._request("GET", "/models") as response:
            try:
                first = json.loads(response.read())["data"][0]
                return str(first["id"]), first.get("max_model_len")
            except (ValueError, LookupError, TypeError, AttributeError):
                raise ChatError(f"{self.url}/v1/models lists no model; name one with --model-name") from None

    def stream(
        self, model: str | None, messages: list[dict[str, str]], options: dict[str, Any]
    ) -> Iterator[str]:
        """The answer's text as it arrives. Closing the iterator early closes the connection,
        which is how a server learns to stop generating."""
        body = {"messages": messages, "stream": True, **options}
        if model is not None:
            body["model"] = model
        with self._request("POST", "/chat/completions", json=body) as response:
            for line in response.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    return
                try:
                    event = json.loads(data)
                except ValueError:
                    raise ChatError(f"unreadable event from the server: {data[:200]}") from None
                if not isinstance(event, dict):
                    continue
                if "error" in event:  # a failure after the stream began
                    raise ChatError(_error_message(event))
                for choice in event.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        yield text

    @contextlib.contextmanager
    def _request(self, method: str, path: str, **kwargs: Any) -> Iterator[httpx.Response]:
        try:
            with self._http.stream(method, path, **kwargs) as response:
                if response.status_code >= 400:
                    response.read()
                    raise ChatError(f"server answered {response.status_code}: {_error_message(response)}")
                yield response
        except httpx.ConnectError as exc:
            raise ChatError(f"cannot connect to {self.url}: {exc}") from None
        except httpx.HTTPError as exc:
            raise ChatError(f"request to {self.url} failed: {exc or type(exc).__name__}") from None


def _error_message(source: httpx.Response | dict[str, Any]) -> str:
    """OpenAI's `{"error": {"message"}}`, FastAPI's `{"detail"}`, or the body as it came."""
    body: Any = source
    if isinstance(source, httpx.Response):
        try:
            body = source.json()
        except ValueError:
            return source.text.strip()[:500] or source.reason_phrase
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if error or body.get("detail"):
            return str(error or body["detail"])
    return json.dumps(body)[:500]


class ChatSession:
    """The conversation and its settings, and the read-send-print loop of the terminal."""

    def __init__(
        self,
        client: ChatClient,
        model: str | None,
        system: str | None = None,
        context_len: int | None = None,
        server_note: str = "",
        out: TextIO | None = None,
        err: TextIO | None = None,
        read_line: Callable[[str], str] = input,
    ) -> None:
        self.client = client
        self.model = model
        self.system = system or None
        self.context_len = context_len
        self.server_note = server_note
        self.options: dict[str, Any] = {}
        self.history: list[dict[str, str]] = []
        self.out, self.err, self.read_line = out or sys.stdout, err or sys.stderr, read_line

    def messages(self) -> list[dict[str, str]]:
        """What a request sends: the system prompt (as set now) and every turn so far."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        return [*system, *self.history]

    def run(self) -> int:
        """Until /bye or Ctrl+D; Ctrl+C at the prompt only says how to leave, as ollama does,
        so a Ctrl+C that lands just after an answer ended does not end the session."""
        while True:
            try:
                entry = self._read_entry()
                if entry is None:
                    continue
                is_command, text = entry
                if not is_command:
                    self.ask(text)
                elif not self.command(text):
                    return 0
            except EOFError:
                self.out.write("\n")
                return 0
            except KeyboardInterrupt:
                self.out.write(f"\n{INTERRUPT_HINT}\n")

    def _read_entry(self) -> tuple[bool, str] | None:
        """(is it a command, its text) for the next entry, or None for nothing to do."""
        line = self.read_line(PROMPT)
        stripped = line.strip()
        if stripped.startswith(BLOCK):
            text = self._read_block(stripped[len(BLOCK) :])
            return (False, text) if text and text.strip() else None
        if not stripped:
            return None
        return (stripped.startswith("/"), stripped if stripped.startswith("/") else line)

    def _read_block(self, first: str) -> str | None:
        """A multi-line message: from after an opening `\"\"\"` to before the closing one."""
        if first.endswith(BLOCK):
            return first[: -len(BLOCK)]
        lines = [first] if first else []
        while True:
            try:
                line = self.read_line(CONTINUATION)
            except KeyboardInterrupt:  # drop the block, not the session
                self.out.write("\n")
                return None
            if line.rstrip().endswith(BLOCK):
                last = line.rstrip()[: -len(BLOCK)]
                if last:
                    lines.append(last)
                return "\n".join(lines)
            lines.append(line)

    def ask(self, text: str) -> None:
        """Send `text` with the whole conversation and print the answer as it streams.

        Whatever part of the answer arrived (all of it, or what came before Ctrl+C or an
        error) stays in the conversation; a turn with no answer at all is dropped, so the
        history never holds a question the model did not see answered."""
        self.history.append({"role": "user", "content": text})
        parts: list[str] = []
        tail = ""  # the end of the answer as printed, which leaves out its leading whitespace
        error: ChatError | None = None
        try:
            with contextlib.closing(self.client.stream(self.model, self.messages(), self.options)) as stream:
                for delta in stream:
                    parts.append(delta)
                    delta = delta if tail else delta.lstrip()
                    tail = (tail + delta)[-1:]
                    self.out.write(delta)
                    self.out.flush()
        except KeyboardInterrupt:
            pass  # leaving the `with` closed the stream, which aborts the request
        except ChatError as exc:
            error = exc
        answer = "".join(parts)
        if answer:
            self.history.append({"role": "assistant", "content": answer})
        else:
            self.history.pop()
        if tail:  # a blank line after the answer
            self.out.write("\n" if tail == "\n" else "\n\n")
        if error is not None:
            self._error(str(error))
            if "context length" in str(error):
                self.err.write("(/clear forgets the conversation)\n")
        self.out.flush()

    def command(self, line: str) -> bool:
        """Run one /command; False when the session should end. Mistakes only print an error."""
        name, _, rest = line.partition(" ")
        rest = rest.strip()
        if name in ("/bye", "/exit"):
            return False
        handlers: dict[str, Callable[[str], None]] = {
            "/set": self._set,
            "/show": lambda _: self._show(),
            "/clear": lambda _: self._clear(),
            "/save": self._save,
            "/load": self._load,
            "/help": lambda _: self._print(HELP),
            "/?": lambda _: self._print(HELP),
        }
        handler = handlers.get(name)
        if handler is None:
            self._error(f"unknown command {name}; /help lists the commands")
        else:
            try:
                handler(rest)
            except ValueError as exc:
                self._error(str(exc))
        return True

    def _set(self, rest: str) -> None:
        name, _, value = rest.partition(" ")
        if name == "parameter":  # ollama's spelling: /set parameter temperature 0.7
            name, _, value = value.strip().partition(" ")
        value = value.strip()
        if name == "system":
            self.system = value or None
            self._print(f"system prompt {'set' if value else 'removed'}")
            return
        if not name or not value:
            raise ValueError("usage: /set NAME VALUE (/help lists the names)")
        parsed = parse_setting(name, value)
        if parsed is None:
            self.options.pop(name, None)
        else:
            self.options[name] = parsed
        self._print(f"{name} = {'default' if parsed is None else parsed}")

    def _show(self) -> None:
        context = f" ({self.context_len} tokens of context)" if self.context_len else ""
        lines = [
            f"model: {self.model or '(the server default)'}{context}",
            f"server: {self.client.url}{self.server_note}",
            f"system: {self.system if self.system else '(none)'}",
            *(f"{name}: {self.options.get(name, 'default')}" for name in SETTINGS),
            f"history: {len(self.history)} messages",
        ]
        self._print("\n".join(lines))

    def _clear(self) -> None:
        self.history.clear()
        self._print("conversation cleared")

    def _save(self, path: str) -> None:
        """The messages as a request would send them, so the file also works as a request body."""
        if not path:
            raise ValueError("usage: /save FILE")
        data = {"model": self.model, "options": self.options, "messages": self.messages()}
        try:
            Path(path).expanduser().write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
        except OSError as exc:
            raise ValueError(f"cannot write {path}: {exc.strerror or exc}") from None
        self._print(f"saved {len(self.history)} messages to {path}")

    def _load(self, path: str) -> None:
        if not path:
            raise ValueError("usage: /load FILE")
        try:
            data = json.loads(Path(path).expanduser().read_text())
        except OSError as exc:
            raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not JSON: {exc}") from None
        raw = data.get("messages") if isinstance(data, dict) else data
        options = (data.get("options") or {}) if isinstance(data, dict) else {}
        if not isinstance(raw, list) or not isinstance(options, dict):
            raise ValueError(f"{path}: expected {{'messages': [...], 'options': {{...}}}} as /save writes")
        system = None
        history = []
        for i, m in enumerate(raw):
            if not (isinstance(m, dict) and isinstance(m.get("content"), str)):
                raise ValueError(f"{path}: message {i} needs a string 'content'")
            if m.get("role") == "system" and i == 0:
                system = m["content"]
            elif m.get("role") in ("user", "assistant"):
                history.append({"role": m["role"], "content": m["content"]})
            else:
                raise ValueError(f"{path}: message {i} has role {m.get('role')!r}")
        parsed = {k: parse_setting(k, json.dumps(v)) for k, v in options.items() if v is not None}
        self.system, self.history, self.options = system, history, parsed
        self._print(f"loaded {len(history)} messages from {path}")

    def _print(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def _error(self, text: str) -> None:
        self.out.flush()
        self.err.write(f"error: {text}\n")
        self.err.flush()


def add_chat_args(parser: argparse.ArgumentParser) -> None:
    """The chat's own flags; every other flag of `dolmus chat` is an engine flag for the
    private server (see `engine_argv`)."""
    g = parser.add_argument_group("chat")
    g.add_argument(
        "--url", default=None, help="an OpenAI-compatible server (default: start a private one on --model)"
    )
    g.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY' (or DOLMUS_API_KEY)")
    g.add_argument("--model-name", default=None, help="the model to ask for (default: the server's first)")
    g.add_argument("--system", default=None, help="system prompt (/set system changes it)")


def engine_argv(argv: list[str]) -> list[str]:
    """The engine flags of a `dolmus chat ...` command line, to pass on to `dolmus serve` as
    the user wrote them (values such as --tier-specs JSON need no re-serialising)."""
    own = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_chat_args(own)
    args = list(argv)
    if args and args[0] == "chat":
        args = args[1:]
    return own.parse_known_args(args)[1]


def _raise_exit(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def _local_server(flags: list[str], model: str | None) -> Iterator[str]:
    """A private `dolmus serve` on a free loopback port for the session; yields its URL.

    The server runs in its own session (Ctrl+C here must not reach it) and without an API key;
    SIGTERM and SIGHUP (a closed terminal) end the chat through this block so it stops too."""
    from dolmus.bench.spawn import ServerProcess

    print(f"loading {model or 'the built-in model'}...", file=sys.stderr, flush=True)
    fd, log_name = tempfile.mkstemp(prefix="dolmus-chat-", suffix=".log")
    os.close(fd)
    log = Path(log_name)
    previous = {s: signal.signal(s, _raise_exit) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        try:
            server = ServerProcess(
                *flags,
                env={"DOLMUS_API_KEY": ""},
                log=log,
                startup_timeout=LOCAL_STARTUP_TIMEOUT_S,
                new_session=True,
            )
        except RuntimeError as exc:
            tail = log.read_text(errors="replace").strip().splitlines()[-15:]
            raise ChatError("\n".join([str(exc), *tail])) from None
        try:
            yield server.url
        finally:
            server.stop()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        log.unlink(missing_ok=True)


def run_chat(args: argparse.Namespace) -> int:
    """`dolmus chat`: 0 after /bye or Ctrl+D, 1 when the server cannot be reached or started,
    2 for a bad command line. Needs `args.argv` (set by dolmus.cli.main) to forward engine flags."""
    flags = engine_argv(args.argv)
    if args.url and flags:
        print(
            f"error: {' '.join(flags)}: engine flags start a private server; they do not go with --url",
            file=sys.stderr,
        )
        return 2
    api_key = args.api_key or os.environ.get("DOLMUS_API_KEY") or None
    if sys.stdin.isatty():
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401  (line editing and history for input())
    try:
        with contextlib.ExitStack() as stack:
            url = args.url or stack.enter_context(_local_server(flags, args.model))
            client = ChatClient(url, api_key)
            stack.callback(client.close)
            model, context_len = args.model_name, None
            if model is None:
                model, context_len = client.first_model()
            note = "" if args.url else " (private, stops on exit)"
            print(f"{model} at {client.url}. /help for commands, /bye to exit.", file=sys.stderr)
            return ChatSession(client, model, args.system, context_len, note).run()
    except ChatError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # while loading
        print(file=sys.stderr)
        return 130
