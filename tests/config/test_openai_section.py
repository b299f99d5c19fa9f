"""[openai]: the OpenAI settings every front end reads, and [ext_proc]'s older keys."""

from pathlib import Path

import pytest

from epick import config

ROOT = Path(__file__).resolve().parents[2]
EXT_PROC_ONLY = """version = 1
[ext_proc]
listen = "127.0.0.1:9004"
base_model = "base"
objectives = { batch = "sheddable" }
model_rewrites = { friendly = "adapter-0" }
"""


def test_the_example_documents_every_key_of_the_section():
    text = (ROOT / "examples" / "epick.toml").read_text()
    section = text.split("[openai]", 1)[1].split("\n[", 1)[0]
    for key in config.OpenAIConfig.__struct_fields__:
        assert f"\n{key} = " in section, key
    assert config.load(ROOT / "examples" / "epick.toml").openai == config.OpenAIConfig()


def test_an_openai_section_is_what_the_front_ends_read():
    c = config.loads("""version = 1
[openai]
base_model = "base"
objectives = { batch = "sheddable" }
model_rewrites = { friendly = "adapter-0" }
[ext_proc]
listen = "127.0.0.1:9004"
""")
    assert c.openai == config.OpenAIConfig(base_model="base", objectives={"batch": "sheddable"},
                                           model_rewrites={"friendly": "adapter-0"})


def test_an_ext_proc_only_config_still_works():
    c = config.loads(EXT_PROC_ONLY)
    assert c.openai == config.OpenAIConfig(base_model="base", objectives={"batch": "sheddable"},
                                           model_rewrites={"friendly": "adapter-0"})
    assert c.ext_proc.base_model == "base"  # the key itself is still read and kept


def test_keys_may_be_split_and_repeated_with_one_value():
    c = config.loads("""version = 1
[openai]
base_model = "base"
[ext_proc]
base_model = "base"
objectives = { batch = "sheddable" }
""")
    assert (c.openai.base_model, c.openai.objectives) == ("base", {"batch": "sheddable"})


@pytest.mark.parametrize(("openai", "ext_proc", "message"), [
    ('base_model = "a"', 'base_model = "b"',
     "openai.base_model ('a') and ext_proc.base_model ('b') disagree: set it once, "
     "under [openai]"),
    ('objectives = { batch = "sheddable" }', 'objectives = { batch = "critical" }',
     "openai.objectives ({'batch': 'sheddable'}) and ext_proc.objectives "
     "({'batch': 'critical'}) disagree"),
    ("model_rewrites = { a = \"b\" }", "model_rewrites = { a = \"c\" }",
     "openai.model_rewrites ({'a': 'b'}) and ext_proc.model_rewrites ({'a': 'c'}) disagree"),
])
def test_a_key_set_to_two_values_is_an_error_naming_both(openai, ext_proc, message):
    with pytest.raises(config.ConfigError) as err:
        config.loads(f"version = 1\n[openai]\n{openai}\n[ext_proc]\n{ext_proc}\n",
                     source="epick.toml")
    assert str(err.value).startswith(f"epick.toml: {message}")


def test_ext_proc_needs_a_base_model_in_either_place():
    with pytest.raises(config.ConfigError, match="openai.base_model is required when "
                                                 "ext_proc.listen is set"):
        config.loads('version = 1\n[ext_proc]\nlisten = "127.0.0.1:9004"\n')
    c = config.loads('version = 1\n[openai]\nbase_model = "m"\n'
                     '[ext_proc]\nlisten = "127.0.0.1:9004"\n')
    assert c.openai.base_model == "m" and c.ext_proc.base_model == ""


@pytest.mark.parametrize(("text", "message"), [
    ('[openai]\nmodel_rewrites = { a = "" }', "openai.model_rewrites: 'a' = '': names must"),
    ('[ext_proc]\nmodel_rewrites = { a = "" }', "ext_proc.model_rewrites: 'a' = '': names"),
    ('[openai]\nobjectives = { a = "urgent" }',
     "Invalid enum value 'urgent' - at `$.openai.objectives[...]`"),
    ('[openai]\nbase_modle = "m"', "Object contains unknown field `base_modle` - at `$.openai`"),
])
def test_bad_openai_values_name_the_key(text, message):
    with pytest.raises(config.ConfigError, match="^epick.toml: ") as err:
        config.loads(f"version = 1\n{text}\n", source="epick.toml")
    assert message in str(err.value)
