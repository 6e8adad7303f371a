"""Incremental detokenization: multi-byte characters, stop strings, hold-back."""

from __future__ import annotations

import pytest

from dolmus.config import DEFAULT_MODEL_DIR
from dolmus.engine.detokenizer import IncrementalDetokenizer
from dolmus.engine.tokenizing import load_tokenizer
from dolmus.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(str(DEFAULT_MODEL_DIR))


def _stream(tok, prompt: str, text: str, params: SamplingParams):
    prompt_ids = tok.encode(prompt)
    ids = tok.encode(prompt + text)[len(prompt_ids) :]
    detok = IncrementalDetokenizer(tok, prompt_ids, params)
    deltas, stop = [], None
    for t in ids:
        stop = detok.add_tokens([t])
        deltas.append(detok.take_delta(stop is not None))
        if stop:
            break
    deltas.append(detok.take_delta(True))
    return deltas, detok, stop, ids


def test_multibyte_characters_never_split(tok):
    text = " héllo wörld, 日本語 and 🙂 too"
    deltas, detok, _, ids = _stream(tok, "Say", text, SamplingParams())
    assert any(len(tok.convert_ids_to_tokens([i])[0]) == 6 for i in ids)  # byte-fallback pieces
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == detok.text == text


def test_stop_string_is_never_emitted(tok):
    text = " The dog ran home. Then it slept."
    params = SamplingParams(stop=["home.", "xyz"])
    deltas, detok, stop, _ = _stream(tok, "Go", text, params)
    assert stop == "home."
    assert "".join(deltas) == detok.text == " The dog ran "
    assert all("home" not in d for d in deltas)


def test_stop_string_included_when_asked(tok):
    params = SamplingParams(stop=["ran"], include_stop_str_in_output=True)
    deltas, detok, stop, _ = _stream(tok, "Go", " The dog ran home.", params)
    assert detok.text == " The dog ran" and "".join(deltas) == detok.text


def test_cost_window_stays_small(tok):
    params = SamplingParams()
    prompt = tok.encode("Once")
    detok = IncrementalDetokenizer(tok, prompt, params)
    ids = tok.encode("Once" + " upon a time there was a cat" * 40)[len(prompt) :]
    detok.add_tokens(ids)
    assert len(detok.ids) < 80  # the decode window is trimmed as text is read
    assert (
        detok.text
        == tok.decode(tok.encode("Once" + " upon a time there was a cat" * 40), skip_special_tokens=True)[4:]
    )


def test_prompt_ending_inside_a_character_does_not_spoil_output_bytes(tok):
    vocab = tok.get_vocab()
    byte = {b: vocab[f"<0x{b:02X}>"] for b in (0xD0, 0x7B, 0x22, 0x6E, 0x61)}
    prompt = [1, vocab["▁Once"], byte[0xD0]]  # ends with the lead byte of a 2-byte character
    output = [byte[0x7B], byte[0x22], byte[0x6E], byte[0x61], vocab["m"]]  # '{"na' as bytes, then 'm'
    detok = IncrementalDetokenizer(tok, prompt, SamplingParams())
    for t in output:
        detok.add_tokens([t])
    assert detok.take_delta(True) == '{"nam' == tok.decode(output)


def test_stray_bytes_never_silence_the_stream(tok):
    """Continuation bytes with no lead byte never form a character: after at most four tokens
    the text so far is streamed (replacement characters included), and a real four-byte
    character split over four byte tokens still comes out whole."""
    vocab = tok.get_vocab()
    stray = [vocab["<0x80>"]] * 12 + [vocab["▁Once"]]
    detok = IncrementalDetokenizer(tok, [1], SamplingParams())
    silent = longest = 0
    for t in stray:
        detok.add_tokens([t])
        silent = 0 if detok.take_delta(False) else silent + 1
        longest = max(longest, silent)
    assert longest <= 3
    assert "\ufffd" in detok.text and detok.text.endswith("Once")
    emoji = [vocab[f"<0x{b:02X}>"] for b in "🙂".encode()]
    detok = IncrementalDetokenizer(tok, [1], SamplingParams())
    deltas = []
    for t in emoji:
        detok.add_tokens([t])
        deltas.append(detok.take_delta(False))
    assert deltas == ["", "", "", "🙂"]


def test_the_stop_token_is_in_the_ids_not_the_text(tok) -> None:
    """A request ended by a stop token (EOS or stop_token_ids) keeps it among its token ids but
    not in its text, even with special tokens shown, unless include_stop_str_in_output (vLLM)."""
    from dolmus import LLM

    llm = LLM(str(DEFAULT_MODEL_DIR), dtype="float32")
    prompt = "Once upon a time"
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    ids = free.outputs[0].token_ids
    stop_id = ids[4]
    for special in (True, False):
        params = SamplingParams(
            temperature=0, max_tokens=12, stop_token_ids=[stop_id], skip_special_tokens=special,
            ignore_eos=True,
        )  # fmt: skip
        out = llm.generate([prompt], params)[0].outputs[0]
        first = ids.index(stop_id)
        assert out.token_ids == ids[: first + 1]
        assert out.text == tok.decode(ids[:first], skip_special_tokens=special)
    shown = SamplingParams(
        temperature=0, max_tokens=12, stop_token_ids=[stop_id], include_stop_str_in_output=True,
        ignore_eos=True,
    )  # fmt: skip
    out = llm.generate([prompt], shown)[0].outputs[0]
    assert out.text == tok.decode(ids[: ids.index(stop_id) + 1], skip_special_tokens=True)


@pytest.mark.parametrize("skip_special", [True, False])
def test_the_rust_decode_shortcut_gives_transformers_text(tok, skip_special: bool) -> None:
    """The detokenizer calls the Rust tokenizer's decode directly where transformers' decode
    only wraps it: random token streams (stray bytes, special tokens) stream the same deltas
    either way."""
    import random

    from dolmus.engine import detokenizer

    assert detokenizer._backend_decoder(tok) is not None  # the shortcut is taken for this tokenizer
    rng = random.Random(3)
    params = SamplingParams(skip_special_tokens=skip_special, stop=["ab"])
    for _ in range(5):
        prompt = [rng.randrange(len(tok)) for _ in range(7)]
        ids = [rng.randrange(len(tok)) for _ in range(120)]
        streams = []
        for shortcut in (True, False):
            detok = IncrementalDetokenizer(tok, prompt, params)
            if not shortcut:
                detok._backend_decode = None
            streams.append([(detok.add_tokens([t]), detok.take_delta(False)) for t in ids])
        assert streams[0] == streams[1]
