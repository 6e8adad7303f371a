import json

import pytest

from dolmus.evaluate.tasks import load_tasks, parse_task, score, wilson


def t(**kw):
    kw.setdefault("prompt", "p")
    return parse_task(kw, "x")


def test_scorers():
    assert score(t(reference="Paris", scorer="exact"), " Paris\n")
    assert not score(t(reference="Paris", scorer="exact"), "Paris.")
    assert score(t(reference="paris", scorer="contains"), "It is Paris.")
    assert score(t(scorer="regex", pattern=r"\bgirl\b"), "a little girl")
    assert not score(t(scorer="regex", pattern=r"^\d+$"), "abc")
    assert score(t(reference="42", scorer="numeric"), "The answer is 42.")
    assert score(t(reference="3.14", scorer="numeric", tolerance=0.01), "3.141")
    assert not score(t(reference="3", scorer="numeric"), "no number")
    schema = {"type": "object", "required": ["a"], "properties": {"a": {"type": "integer"}}}
    assert score(t(scorer="json_schema", schema=schema), '{"a": 1}')
    assert not score(t(scorer="json_schema", schema=schema), '{"a": "x"}')
    assert not score(t(scorer="json_schema", schema=schema), "not json")
    assert score(t(reference="ab", scorer="python", function="operator:contains"), "xaby")
    assert not score(t(reference="zz", scorer="python", function="operator:contains"), "xaby")


def test_wilson():
    lo, hi = wilson(8, 10)
    assert 0.49 < lo < 0.5 and 0.94 < hi < 0.95
    assert wilson(0, 0) == (0.0, 1.0)


def test_bad_line_names_line(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps({"prompt": "a", "reference": "b"}) + "\n" + '{"prompt": "a", "scorer": "nope"}\n')
    with pytest.raises(ValueError, match="line 2: unknown scorer"):
        load_tasks(str(p))
    p.write_text("{not json\n")
    with pytest.raises(ValueError, match="line 1: invalid JSON"):
        load_tasks(str(p))
    with pytest.raises(ValueError, match="needs a 'pattern'"):
        t(scorer="regex")


def test_eval_cli_end_to_end(tmp_path, capsys):
    from dolmus.cli import main

    out = tmp_path / "out"
    rc = main(["eval", "--tasks", "examples/eval/stories.jsonl", "--compare", "@none", "--compare", "@int8"])
    assert rc == 0
    rc = main(["eval", "--tasks", "examples/eval/stories.jsonl", "--compare", "@none", "--out", str(out)])
    assert rc == 0
    assert "| model |" in capsys.readouterr().out
    report = json.loads((out / "eval.json").read_text())
    a, b = report["models"]
    assert len(a["per_task"]) == 6 and 0 <= a["ci95"][0] <= a["accuracy"] <= a["ci95"][1] <= 1
    assert b["agreement"] == 1.0 and b["delta_ll"] == 0.0
    assert [t["ref_logprobs"] for t in a["per_task"]] == [t["ref_logprobs"] for t in b["per_task"]]
    assert a["weight_bytes"] > 0 and (out / "eval.png").stat().st_size > 0
