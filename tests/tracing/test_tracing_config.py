"""``[tracing]``: every key in the example, off by default, bad values named, and a
reload that changes it says a restart is needed."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from epick import config
from epick.service import Service, _tracer

ROOT = Path(__file__).resolve().parents[2]


def test_the_example_documents_every_key_of_the_section():
    text = (ROOT / "examples" / "epick.toml").read_text()
    section = text.split("\n[tracing]", 1)[1].split("\n[", 1)[0]
    for key in config.TracingConfig.__struct_fields__:
        assert f"\n{key} = " in section, key
    assert config.load(ROOT / "examples" / "epick.toml").tracing == config.TracingConfig()


def test_the_runtime_section_documents_breaker_burn_ms():
    text = (ROOT / "examples" / "epick.toml").read_text()
    section = text.split("\n[runtime]", 1)[1].split("\n[", 1)[0]
    for key in config.RuntimeConfig.__struct_fields__:
        assert f"\n{key} = " in section, key


def test_off_by_default_and_then_no_tracer_is_built():
    c = config.loads("version = 1")
    assert c.tracing.enabled is False
    assert _tracer(c) is None


@pytest.mark.parametrize("text, message", [
    ("sample_ratio = 1.5", "Expected `float` <= 1.0 - at `$.tracing.sample_ratio`"),
    ("endpoint = '127.0.0.1:4317'", "at `$.tracing.endpoint`"),
    ("max_queue = 0", "Expected `int` >= 1 - at `$.tracing.max_queue`"),
    ("sampel_ratio = 0.1", "Object contains unknown field `sampel_ratio` - at `$.tracing`"),
])
def test_bad_values_name_the_key(text, message):
    with pytest.raises(config.ConfigError) as info:
        config.loads(f"version = 1\n[tracing]\n{text}", source="epick.toml")
    assert message in str(info.value)


def test_a_reload_that_changes_it_says_a_restart_is_needed(caplog):
    old = config.loads("version = 1")
    new = config.loads("version = 1\n[tracing]\nenabled = true")
    svc = Service.__new__(Service)  # only what _apply_config reads before the pool
    svc.config, svc.config_path = old, "epick.toml"
    try:
        with caplog.at_level(logging.WARNING, logger="epick"):
            svc._apply_config(new, [])
    except AttributeError:
        pass  # the rest of a reload needs a running service; the warning comes first
    assert any("[tracing] changes need a restart" in r.getMessage() for r in caplog.records)
