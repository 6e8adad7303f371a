"""OpenAI's Files and Batch APIs through the official `openai` client against a real server, a
job resumed across a restart, and `dolmus run-batch` offline."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from server_helpers import RemoteServer

from dolmus.cli import main
from dolmus.server.openai.batch_store import BatchStore

MODEL = "stories260k"
CHAT = "/v1/chat/completions"
DONE = ("completed", "failed", "cancelled", "expired")


def chat_line(custom_id: str, content: str, max_tokens: int = 12, **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": CHAT,
        "body": {**body, "temperature": 0, **extra},
    }


def jsonl(lines: list[Any]) -> bytes:
    return "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()


def wait_done(client: openai.OpenAI, batch_id: str, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in DONE or time.monotonic() > deadline:
            return batch
        time.sleep(0.1)


def read_lines(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines() if x.strip()]


def submit(client: openai.OpenAI, lines: list[Any], endpoint: str = CHAT) -> Any:
    uploaded = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    # --max-waiting 2: batch jobs keep at most one line in the engine, so an interactive request
    # always finds room (the engine has a seat more than that)
    args = (
        "--engine-core",
        "thread",
        "--max-waiting",
        "2",
        "--max-num-seqs",
        "2",
        "--max-body-bytes",
        "262144",
    )
    with RemoteServer(*args, log=log) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def test_batch_answers_as_the_endpoint_and_bad_lines_fail_alone(client: openai.OpenAI) -> None:
    good = [chat_line(f"q{i}", text) for i, text in enumerate(["Hi", "Tell me a story", "The cat"])]
    bad = [
        "not json",
        {**chat_line("wrong-url", "Hi"), "url": "/v1/completions"},
        chat_line("wrong-model", "Hi", model="nope"),
        chat_line("too-long", "Hi", max_tokens=10**6),
        chat_line("streamed", "Hi", stream=True),
    ]
    batch = submit(client, [*good[:2], *bad, good[2]])
    assert batch.status in ("validating", "in_progress", "completed")
    batch = wait_done(client, batch.id)
    assert batch.status == "completed"
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (
        8,
        3,
        5,
    )

    outputs = {line["custom_id"]: line for line in read_lines(client, batch.output_file_id)}
    assert set(outputs) == {"q0", "q1", "q2"}
    for line in good:
        direct = client.chat.completions.create(**line["body"])
        answered = outputs[line["custom_id"]]
        assert answered["error"] is None and answered["response"]["status_code"] == 200
        body = answered["response"]["body"]
        assert body["id"] == answered["response"]["request_id"]
        assert body["choices"][0]["message"]["content"] == direct.choices[0].message.content
        assert body["usage"]["completion_tokens"] == direct.usage.completion_tokens

    errors = {line["custom_id"]: line for line in read_lines(client, batch.error_file_id)}
    assert set(errors) == {None, "wrong-url", "wrong-model", "too-long", "streamed"}
    assert (
        errors[None]["error"]["code"] == "invalid_request"
        and "not valid JSON" in errors[None]["error"]["message"]
    )
    assert (
        errors["wrong-url"]["response"] is None and "url must be" in errors["wrong-url"]["error"]["message"]
    )
    assert errors["wrong-model"]["response"]["status_code"] == 404
    assert errors["too-long"]["response"]["status_code"] == 400
    assert errors["streamed"]["response"]["body"]["error"]["param"] == "stream"

    listed = client.batches.list(limit=100)
    assert batch.id in [b.id for b in listed.data]


def test_completions_batch_and_files_api(client: openai.OpenAI) -> None:
    line = {"custom_id": "c", "method": "POST", "url": "/v1/completions"}
    line["body"] = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 10, "temperature": 0}
    batch = wait_done(client, submit(client, [line], "/v1/completions").id)
    assert batch.status == "completed" and batch.error_file_id is None
    (answered,) = read_lines(client, batch.output_file_id)
    direct = client.completions.create(**line["body"])
    assert answered["response"]["body"]["choices"][0]["text"] == direct.choices[0].text

    source = client.files.retrieve(batch.input_file_id)
    assert source.purpose == "batch" and source.bytes == len(jsonl([line]))
    assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"
    assert client.files.delete(source.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(source.id)


def test_bad_batches_are_refused(client: openai.OpenAI) -> None:
    uploaded = client.files.create(file=("in.jsonl", jsonl([chat_line("a", "Hi")])), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="1h")  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-nope", endpoint=CHAT, completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="custom_id 'a'"):
        client.files.create(
            file=("in.jsonl", jsonl([chat_line("a", "Hi"), chat_line("a", "Yo")])), purpose="batch"
        )
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
    with pytest.raises(openai.BadRequestError, match="at most 50000"):
        client.files.create(file=("in.jsonl", b"{}\n" * 50_001), purpose="batch")
    with pytest.raises(openai.APIStatusError, match="--max-body-bytes") as too_large:
        client.files.create(file=("in.jsonl", b"{}\n" * 100_000), purpose="batch")
    assert too_large.value.status_code == 413
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("in.jsonl", b"{}\n"), purpose="fine-tune")


def test_cancel_stops_the_job(client: openai.OpenAI) -> None:
    lines = [chat_line(f"c{i}", f"Story {i}", max_tokens=200, ignore_eos=True) for i in range(64)]
    batch = submit(client, lines)
    cancelled = client.batches.cancel(batch.id)  # before its task has run a step
    assert cancelled.status in ("cancelling", "cancelled")
    batch = wait_done(client, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at is not None
    counts = batch.request_counts
    assert counts.completed + counts.failed < counts.total == 64
    assert len(read_lines(client, batch.output_file_id)) == counts.completed
    assert client.batches.cancel(batch.id).status == "cancelled"  # a finished job stays as it is


def test_batch_runs_in_the_least_urgent_tier_and_cancel_aborts(
    server: RemoteServer, client: openai.OpenAI
) -> None:
    lines = [chat_line(f"t{i}", f"Story {i}", max_tokens=200, ignore_eos=True) for i in range(64)]
    batch = submit(client, lines)
    deadline = time.monotonic() + 30
    rows: list[dict[str, Any]] = []
    while not rows and time.monotonic() < deadline:
        rows = httpx.get(f"{server.url}/requests").json()["data"]
    assert rows and {r["tier"] for r in rows} == {"batch"}
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    batch = wait_done(client, batch.id)
    assert batch.status == "cancelled" and batch.request_counts.completed < 64
    deadline = time.monotonic() + 30
    while rows and time.monotonic() < deadline:  # the in-flight lines were aborted in the engine
        rows = httpx.get(f"{server.url}/requests").json()["data"]
    assert rows == []


def test_jobs_leave_room_for_interactive_requests(server: RemoteServer, client: openai.OpenAI) -> None:
    jobs = [
        submit(client, [chat_line(f"i{i}", f"Story {i}", max_tokens=120, ignore_eos=True) for i in range(6)])
        for _ in range(2)
    ]
    answered, most = 0, 0
    while any(client.batches.retrieve(b.id).status not in DONE for b in jobs):  # never a 429 meanwhile
        rows = httpx.get(f"{server.url}/requests").json()["data"]
        most = max(most, sum(r["tier"] == "batch" for r in rows))
        client.chat.completions.create(**chat_line("x", "Hi", max_tokens=4)["body"])
        answered += 1
    assert answered >= 1 and most == 1  # one batch line in the engine at a time, over both jobs
    for b in jobs:
        batch = wait_done(client, b.id)
        assert (batch.status, batch.request_counts.completed, batch.request_counts.failed) == (
            "completed",
            6,
            0,
        )


def test_unfinished_job_resumes_after_restart(tmp_path: Path) -> None:
    """Stop the server once the first line is written; the restarted one finishes the rest,
    every custom_id exactly once."""
    batch_dir = tmp_path / "batches"
    args = ("--engine-core", "thread", "--max-num-seqs", "1", "--batch-dir", str(batch_dir))
    lines = [chat_line(f"r{i}", f"Story {i}", max_tokens=160, ignore_eos=True) for i in range(12)]
    with RemoteServer(*args, log=tmp_path / "first.log") as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0)
        batch_id = submit(client, lines).id
        record = json.loads((batch_dir / "batches" / f"{batch_id}.json").read_text())
        output = batch_dir / "files" / record["_output"]
        deadline = time.monotonic() + 60
        while not output.read_text() and time.monotonic() < deadline:
            time.sleep(0.02)
        srv.stop()  # SIGTERM: the job stops where it is
    record = json.loads((batch_dir / "batches" / f"{batch_id}.json").read_text())
    written = len(output.read_text().splitlines())
    assert record["status"] == "in_progress" and 1 <= written < len(lines)

    with RemoteServer(*args, log=tmp_path / "second.log") as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0)
        batch = wait_done(client, batch_id)
        assert batch.status == "completed"
        assert (batch.request_counts.completed, batch.request_counts.failed) == (len(lines), 0)
        answered = [line["custom_id"] for line in read_lines(client, batch.output_file_id)]
    assert sorted(answered) == sorted(line["custom_id"] for line in lines)


def test_run_batch_offline_matches_the_server(tmp_path: Path, client: openai.OpenAI) -> None:
    lines = [chat_line("a", "Hi"), chat_line("b", "The dog"), chat_line("bad", "Hi", model="nope")]
    completion = {"custom_id": "c", "method": "POST", "url": "/v1/completions"}
    completion["body"] = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 10, "temperature": 0}
    lines.append(completion)
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(jsonl(lines))
    assert main(["run-batch", "-i", str(source), "-o", str(out)]) == 0
    answered = [json.loads(x) for x in out.read_text().splitlines()]
    assert [a["custom_id"] for a in answered] == ["a", "b", "bad", "c"]  # input order
    assert answered[2]["response"]["status_code"] == 404
    for line, got in zip(lines[:2], answered[:2]):
        direct = client.chat.completions.create(**line["body"])
        assert (
            got["response"]["body"]["choices"][0]["message"]["content"] == direct.choices[0].message.content
        )
    direct = client.completions.create(**completion["body"])
    assert answered[3]["response"]["body"]["choices"][0]["text"] == direct.choices[0].text


def test_store_drops_a_line_cut_short_by_a_crash(tmp_path: Path) -> None:
    store = BatchStore(tmp_path)
    file_id = store.new_output_file("out.jsonl")
    store.append_lines(file_id, [{"id": "a"}, {"id": "b"}])
    with open(store.data_path(file_id), "a") as f:
        f.write('{"id": "c", "custom_')  # the server died mid-write
    assert store.done_line_ids(file_id) == {"a", "b"}
    store.append_lines(file_id, [{"id": "c"}])
    assert store.done_line_ids(file_id) == {"a", "b", "c"}
    assert store.file(file_id)["bytes"] == len(store.data_path(file_id).read_bytes())
    with pytest.raises(KeyError):
        store.file("../batches")
