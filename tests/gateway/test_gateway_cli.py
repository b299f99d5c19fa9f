"""``python -m epick.gateway``: the OpenAI settings from a config file's [openai]."""

from __future__ import annotations

import asyncio

import pytest

from epick.api.openai_request import OpenAIConfig
from epick.gateway import __main__ as cli


def gateway_of(monkeypatch, argv):
    """The Gateway ``main(argv)`` would serve (the server itself is not started)."""
    made = {}
    monkeypatch.setattr(cli.web, "run_app", lambda app, **kw: made.setdefault("app", app))
    assert cli.main(argv) == 0

    async def build():
        app = await made["app"]
        [gateway] = {r.handler.__self__ for r in app.router.routes()
                     if hasattr(r.handler, "__self__")}
        await gateway.close()
        return gateway

    return asyncio.run(build())


def test_the_config_files_openai_settings_are_the_gateways(monkeypatch, tmp_path):
    path = tmp_path / "epick.toml"
    path.write_text('version = 1\n[openai]\nbase_model = "base"\n'
                    'objectives = { batch = "sheddable" }\n'
                    '[ext_proc]\nmodel_rewrites = { friendly = "adapter-0" }\n')
    gateway = gateway_of(monkeypatch, ["--config", str(path)])
    assert gateway.openai == OpenAIConfig(base_model="base", objectives={"batch": "sheddable"},
                                          model_rewrites={"friendly": "adapter-0"})
    # --model overrides the file's base model; the rest of the file still applies.
    gateway = gateway_of(monkeypatch, ["--config", str(path), "--model", "other"])
    assert (gateway.openai.base_model, gateway.openai.objectives) == (
        "other", {"batch": "sheddable"})


def test_model_alone_still_works(monkeypatch):
    assert gateway_of(monkeypatch, ["--model", "base"]).openai == OpenAIConfig(base_model="base")


@pytest.mark.parametrize(("text", "message"), [
    (None, "--model is required (or --config with openai.base_model set)"),
    ("version = 1\n", "--model is required (or --config with openai.base_model set)"),
    ("version = 1\n[openai]\nbase_modle = 'x'\n",
     "epick.toml: Object contains unknown field `base_modle` - at `$.openai`"),
])
def test_a_missing_model_or_a_bad_file_is_a_usage_error_naming_it(tmp_path, capsys, text,
                                                                   message):
    argv = []
    if text is not None:
        (tmp_path / "epick.toml").write_text(text)
        argv = ["--config", str(tmp_path / "epick.toml")]
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
