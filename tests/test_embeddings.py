"""/v1/embeddings and Ollama's /api/embed against transformers' final hidden states.

A real `dolmus serve` (engine core in its own process) on the tiny random Llama in fp32, with a
16-token step budget so long inputs are embedded in chunks; vectors are checked against
transformers' last hidden state (hidden_states[-1] is after the final norm for Llama),
last-token or mean pooled, normalized, within 1e-4.
"""

from __future__ import annotations

import base64
import threading

import httpx
import numpy as np
import ollama
import openai
import pytest
import torch
from server_helpers import RemoteServer
from transformers import AutoModelForCausalLM, AutoTokenizer

from dolmus.config import EngineConfig
from dolmus.engine.engine import Engine
from dolmus.entrypoints.llm import LLM
from dolmus.pooling_params import PoolingParams
from dolmus.sampling_params import SamplingParams

TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
TEXTS = ["Once upon a time", "there was a little girl named Lily who liked to play", "hi"]
LONG = " ".join(["the cat sat on the mat and looked at the big red ball"] * 6)  # > 16 tokens: chunked
TOL = 1e-4


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    args = ("--model", str(llama_dir), "--dtype", "float32", "--max-num-batched-tokens", "16")
    with RemoteServer(*args, "--chat-template", TEMPLATE, log=log) as srv:
        yield srv


@pytest.fixture(scope="module")
def oai(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference(llama_dir):
    """The oracle: normalized last-token or mean pooling of transformers' final hidden states."""
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)

    def embed(text: str | list[int], pooling: str = "last", normalize: bool = True) -> np.ndarray:
        ids = tokenizer.encode(text) if isinstance(text, str) else text
        with torch.no_grad():
            hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
        vector = hidden[-1] if pooling == "last" else hidden.mean(0)
        if normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        return vector.numpy()

    embed.tokenizer = tokenizer  # type: ignore[attr-defined]
    return embed


def _close(got, want) -> None:
    got = np.asarray(got, dtype=np.float32)
    assert got.shape == want.shape
    assert np.abs(got - want).max() < TOL, np.abs(got - want).max()


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_matches_transformers(oai: openai.OpenAI, reference, pooling: str) -> None:
    # a batch, including a long input the 16-token budget splits into chunks
    r = oai.embeddings.create(model="llama", input=[*TEXTS, LONG], extra_body={"pooling": pooling})
    assert [d.index for d in r.data] == [0, 1, 2, 3]
    for d, text in zip(r.data, [*TEXTS, LONG]):
        _close(d.embedding, reference(text, pooling))
    tokens = sum(len(reference.tokenizer.encode(t)) for t in [*TEXTS, LONG])
    assert r.usage.prompt_tokens == r.usage.total_tokens == tokens
    # one by one (and again: the prefix cache now holds them) gives the same vectors
    for _ in range(2):
        for d, text in zip(r.data, [*TEXTS, LONG]):
            one = oai.embeddings.create(model="llama", input=text, extra_body={"pooling": pooling})
            _close(one.data[0].embedding, np.asarray(d.embedding, dtype=np.float32))


def test_token_ids_dimensions_and_formats(server: RemoteServer, oai: openai.OpenAI, reference) -> None:
    ids = reference.tokenizer.encode(TEXTS[1])
    r = oai.embeddings.create(model="llama", input=[ids, ids[:5], ids[:1]])  # one token: a decode row
    _close(r.data[0].embedding, reference(ids))
    _close(r.data[1].embedding, reference(ids[:5]))
    _close(r.data[2].embedding, reference(ids[:1]))
    r = oai.embeddings.create(model="llama", input=ids)  # one list of ids is one input
    assert len(r.data) == 1
    # dimensions: the first d components, renormalized
    full = reference(TEXTS[0], normalize=False)
    want = full[:8] / np.linalg.norm(full[:8])
    r = oai.embeddings.create(model="llama", input=TEXTS[0], dimensions=8)
    _close(r.data[0].embedding, want)
    # base64 is little-endian float32; float is a list
    for fmt in ("float", "base64"):
        body = {"model": "llama", "input": TEXTS[0], "encoding_format": fmt}
        data = httpx.post(f"{server.base_url}/embeddings", json=body, timeout=60).json()["data"][0]
        vec = data["embedding"]
        if fmt == "base64":
            assert isinstance(vec, str)
            vec = np.frombuffer(base64.b64decode(vec), dtype="<f4")
        else:
            assert isinstance(vec, list)
        _close(vec, reference(TEXTS[0]))
    # unnormalized (a dolmus extra)
    body = {"model": "llama", "input": TEXTS[0], "normalize": False}
    data = httpx.post(f"{server.base_url}/embeddings", json=body, timeout=60).json()["data"][0]
    _close(data["embedding"], full)


def test_bad_input(server: RemoteServer) -> None:
    url = f"{server.base_url}/embeddings"
    bad = [
        ({"input": []}, "input"),
        ({"input": ""}, "input"),
        ({"input": ["a", ""]}, "input"),
        ({"input": [[1, 2], []]}, "input"),
        ({"input": [5000]}, "input"),  # outside the vocabulary
        ({"input": [1] * 1025}, "context"),  # longer than max_model_len (1024)
        ({"input": ["a"] * 2049}, "2048"),
        ({"input": "a", "dimensions": 0}, "dimensions"),
        ({"input": "a", "pooling": "cls"}, "pooling"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "a", "model": "nope"}, "nope"),
    ]
    # nothing is generated, so an input may fill the whole context
    r = httpx.post(url, json={"model": "llama", "input": [7] * 1024}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 1024
    for body, word in bad:
        r = httpx.post(url, json={"model": "llama", **body}, timeout=60)
        assert r.status_code in (400, 404, 422), (body, r.status_code)
        assert word in r.text, (body, r.text)


def test_embeddings_while_chat_streams(oai: openai.OpenAI, reference) -> None:
    def chat_text(during=None) -> str:
        stream = oai.chat.completions.create(
            model="llama",
            messages=[{"role": "user", "content": "Once upon a time"}],
            max_tokens=40,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        parts = []
        for i, chunk in enumerate(stream):
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
            if i == 3 and during is not None:
                during()
        return "".join(parts)

    alone = chat_text()
    got = {}

    def embed_batch() -> None:
        r = oai.embeddings.create(model="llama", input=[LONG, *TEXTS], extra_body={"pooling": "mean"})
        got["data"] = r.data

    worker = None

    def start() -> None:
        nonlocal worker
        worker = threading.Thread(target=embed_batch)
        worker.start()

    assert chat_text(start) == alone
    assert worker is not None
    worker.join(60)
    for d, text in zip(got["data"], [LONG, *TEXTS]):
        _close(d.embedding, reference(text, "mean"))


def test_ollama_embed(server: RemoteServer, reference) -> None:
    client = ollama.Client(host=server.url, timeout=60)
    r = client.embed(model="llama", input=TEXTS)
    assert r.prompt_eval_count == sum(len(reference.tokenizer.encode(t)) for t in TEXTS)
    for vec, text in zip(r.embeddings, TEXTS):
        _close(vec, reference(text))  # Ollama's /api/embed normalizes
    r = client.embed(model="llama", input=TEXTS[0], dimensions=8)
    full = reference(TEXTS[0], normalize=False)
    _close(r.embeddings[0], full[:8] / np.linalg.norm(full[:8]))
    # the legacy endpoint: one prompt, unnormalized, as Ollama's
    r = client.embeddings(model="llama", prompt=TEXTS[1])
    _close(r.embedding, reference(TEXTS[1], normalize=False))
    # too long: cut to the context unless truncate is false
    long_ids_text = " ".join(["word"] * 1100)
    r = httpx.post(f"{server.url}/api/embed", json={"model": "llama", "input": long_ids_text}, timeout=60)
    assert r.status_code == 200 and len(r.json()["embeddings"]) == 1
    body = {"model": "llama", "input": long_ids_text, "truncate": False}
    r = httpx.post(f"{server.url}/api/embed", json=body, timeout=60)
    assert r.status_code == 400 and "context" in r.json()["error"]


def test_engine_chunked_equals_unchunked_with_preemption(llama_dir) -> None:
    """In process: long prompts through 16-token chunks, and with more urgent ones preempting
    the others mid-prompt (resumed from the prefix cache where "last"), pool as one pass does."""
    ids = list(range(3, 200))
    params = {p: SamplingParams(pooling=PoolingParams(pooling=p)) for p in ("last", "mean")}

    def run(**overrides) -> tuple[dict[str, list[float] | None], int]:
        engine = Engine(EngineConfig(model=str(llama_dir), dtype="float32", **overrides))
        out = {}

        def steps(count: int | None) -> None:
            while engine.has_unfinished_requests() and (count is None or count > 0):
                count = None if count is None else count - 1
                for o in engine.step():
                    if o.finished:
                        out[o.request_id] = o.embedding

        try:
            for priority in (1, 0):  # the urgent ones come while the others are mid-prompt
                for i in range(2):
                    for p, sp in params.items():
                        engine.add_request(f"{p}{priority}{i}", ids[i + 3 * priority :], sp, priority)
                steps(2)
            steps(None)
            return out, engine.scheduler.num_preemptions
        finally:
            engine.shutdown()

    whole, _ = run(max_num_batched_tokens=1024)
    llm = LLM(model=str(llama_dir), dtype="float32")  # the Python API: same vectors
    try:
        for p, sp in params.items():
            got = llm.embed([ids, ids[1:]], sp.pooling)
            want = [whole[f"{p}00"], whole[f"{p}01"]]
            assert np.abs(np.asarray(got) - np.asarray(want)).max() < TOL
    finally:
        llm.engine.shutdown()
    chunked, _ = run(max_num_batched_tokens=16)
    # one seat: each urgent request preempts a less urgent one mid-prompt (60: the prompts
    # leave tails past the budget's slack, which a step with budget to spare admits beside)
    tight, preemptions = run(max_num_batched_tokens=60, max_num_seqs=1)
    assert preemptions > 0
    assert len(whole) == 8
    for rid, vec in whole.items():
        assert vec is not None
        assert np.abs(np.asarray(chunked[rid]) - np.asarray(vec)).max() < TOL, rid
        assert np.abs(np.asarray(tight[rid]) - np.asarray(vec)).max() < TOL, rid


def test_engine_speculative_decoding_leaves_embeddings_alone(llama_dir) -> None:
    """Under n-gram drafting, a prompt whose last chunk is one token (what a decode looks like)
    gets no drafts: its vector is its prompt's, next to a generating request that drafts."""
    ids = [5, 6, 7, 8] * 8 + [5]  # 33 tokens: chunks of 16, 16 and 1; the n-gram would match
    spec = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}
    plain = LLM(model=str(llama_dir), dtype="float32", max_num_batched_tokens=16)
    drafted = LLM(model=str(llama_dir), dtype="float32", max_num_batched_tokens=16, speculative_config=spec)
    try:
        generate = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        for pooling in ("last", "mean"):
            want = plain.embed([ids], PoolingParams(pooling))[0]
            outs = drafted.generate([ids, ids], [SamplingParams(pooling=PoolingParams(pooling)), generate])
            assert np.abs(np.asarray(outs[0].embedding) - np.asarray(want)).max() < TOL
            assert outs[1].outputs[0].token_ids == plain.generate([ids], generate)[0].outputs[0].token_ids
        assert drafted.engine.stats().spec_num_draft_tokens > 0
    finally:
        plain.engine.shutdown()
        drafted.engine.shutdown()
