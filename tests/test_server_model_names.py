"""Served model names: a short default name (folder name, GGUF file stem),
the --model path still accepted, and a clear 404 for any other name."""

from __future__ import annotations

import shutil

import httpx
import openai
import pytest
from server_helpers import RemoteServer

from dolmus.cli import main
from dolmus.config import DEFAULT_MODEL_DIR
from dolmus.server.model_names import BUILT_IN_NAME, ModelNames, short_name

SHORT = "tiny-stories.F32"


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory):
    """stories260k as a GGUF in a folder of its own."""
    root = tmp_path_factory.mktemp("names")
    src = root / "tiny-stories"
    shutil.copytree(DEFAULT_MODEL_DIR, src, ignore=shutil.ignore_patterns("__init__.py", "__pycache__"))
    out = root / "weights" / f"{SHORT}.gguf"
    out.parent.mkdir()
    assert main(["convert", str(src), "--to", "gguf", "--out", str(out), "--type", "f32"]) == 0
    return out


def test_default_names(llama_dir, gguf_file) -> None:
    assert short_name(str(gguf_file)) == SHORT  # the stem, not general.name ("tiny-stories")
    assert short_name(str(llama_dir)) == llama_dir.name
    assert short_name(f"{llama_dir}/") == llama_dir.name
    assert ModelNames.for_model(None).served == BUILT_IN_NAME
    assert ModelNames.for_model(str(DEFAULT_MODEL_DIR)).served == BUILT_IN_NAME

    names = ModelNames.for_model(str(gguf_file))
    assert names.served == SHORT and names.accepts(str(gguf_file)) and names.accepts(str(gguf_file.resolve()))
    assert not names.accepts("other")
    given = ModelNames.for_model(str(llama_dir), "custom")
    assert given.served == "custom" and given.accepts(str(llama_dir)) and not given.accepts(llama_dir.name)


def test_short_name_path_alias_and_unknown_name_through_openai(gguf_file, tmp_path) -> None:
    with RemoteServer("--model", str(gguf_file), "--max-model-len", "256", log=tmp_path / "log") as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == [SHORT]
        assert httpx.get(f"{srv.url}/info").json()["model"] == SHORT
        kwargs = dict(prompt="Once upon a time", max_tokens=8, temperature=0)
        by_name = client.completions.create(model=SHORT, **kwargs)
        by_path = client.completions.create(model=str(gguf_file), **kwargs)
        assert by_name.model == by_path.model == SHORT
        assert by_name.choices[0].text == by_path.choices[0].text and by_name.usage.completion_tokens == 8
        chat = client.chat.completions.create(
            model=str(gguf_file), messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
        )
        assert chat.model == SHORT and chat.usage.completion_tokens == 4

        with pytest.raises(openai.NotFoundError) as info:
            client.completions.create(model="no-such-model", **kwargs)
        assert info.value.code == "model_not_found"
        assert SHORT in info.value.message and "no-such-model" in info.value.message
        raw = httpx.post(
            f"{srv.url}/v1/chat/completions",
            json={"model": "no-such-model", "messages": [{"role": "user", "content": "Hi"}]},
        )
        assert raw.status_code == 404
        assert raw.json() == {
            "error": {
                "message": f"model 'no-such-model' is not served here; this server serves '{SHORT}'",
                "type": "invalid_request_error",
                "param": "model",
                "code": "model_not_found",
            }
        }
