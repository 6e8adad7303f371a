"""Every config field has one CLI flag with the same choices and default (dolmus/config/ is the source)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from dolmus.cli import build_parser
from dolmus.config import EngineConfig
from dolmus.config.server import ServerConfig
from dolmus.engine_args import engine_config_from_args


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


@pytest.mark.parametrize(
    "command,classes", [("serve", (EngineConfig, ServerConfig)), ("generate", (EngineConfig,))]
)
def test_each_field_has_one_flag_with_its_choices_and_default(command, classes):
    actions = [a for a in _subparser(command)._actions if a.option_strings]
    for cls in classes:
        defaults = cls()
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            matching = [a for a in actions if a.dest == f.name]
            assert len(matching) == 1, f"{cls.__name__}.{f.name}: {len(matching)} flags"
            action = matching[0]
            assert flag in action.option_strings, (f.name, action.option_strings)
            assert action.default == getattr(defaults, f.name), f.name
            choices = f.metadata.get("choices")
            if choices is not None:
                assert list(action.choices) == [c for c in choices if c is not None], f.name


@pytest.mark.parametrize("value", ["int8", "int4", "w8a8", "fp8"])
def test_every_quantization_parses(value):
    args = _subparser("serve").parse_args(["--quantization", value])
    assert engine_config_from_args(args).quantization == value


def test_flag_outside_its_choices_is_refused():
    with pytest.raises(SystemExit):
        _subparser("serve").parse_args(["--kv-cache-dtype", "int3"])
