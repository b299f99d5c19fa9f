"""fleet/build_model.py: what can be checked without torch (it runs in .venv-vllm)."""

from __future__ import annotations

import pytest


@pytest.fixture
def build_model(monkeypatch):
    # Importing it sets HF offline defaults in os.environ: keep them inside this test.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    from epick.fleet import build_model

    return build_model


def test_the_builder_makes_the_adapters_the_fleet_serves(build_model):
    from epick.fleet import fleet

    assert build_model.ADAPTERS == fleet.ADAPTERS


def test_the_tokenizer_corpus_is_local_fixed_and_sorted(build_model):
    a, b = build_model._corpus(), build_model._corpus()
    assert a == b and 0 < len(a) <= 200 and all(isinstance(t, str) and t for t in a)


def test_the_chat_template_renders_roles_and_the_generation_prompt(build_model):
    import jinja2

    out = jinja2.Template(build_model.CHAT_TEMPLATE).render(
        bos_token="<s>", messages=[{"role": "user", "content": "hi"}],
        add_generation_prompt=True)
    assert out == "<s><|user|>\nhi\n<|assistant|>\n"


def test_a_wrong_argument_count_prints_usage_and_exits_2(build_model, capsys):
    assert build_model.main([]) == 2
    assert "usage: build_model.py OUT_DIR" in capsys.readouterr().err
