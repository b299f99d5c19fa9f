"""The source registry and runner (epick.pool.sources) and the `[[pool.sources]]` config,
with a test kind whose set the test controls."""

from __future__ import annotations

import anyio
import msgspec
import pytest

from epick import config as cfg
from epick.pool import EndpointSpec, Sources, kinds
from epick.pool.sources import SourceConfig, merge, register


class ManualConfig(SourceConfig, frozen=True, kw_only=True, tag="manual-test"):
    name: str

    def describe(self) -> str:
        return f"manual:{self.name}"


class ManualSource:
    """Publishes whatever the test puts in ``SETS[name]`` when ``poke()`` is called."""

    SETS: dict[str, list[str]] = {}
    RUNNING: dict[str, ManualSource] = {}

    def __init__(self, config: ManualConfig) -> None:
        self.config = config
        self.publish = None

    async def run(self, publish, *, task_status=anyio.TASK_STATUS_IGNORED):
        self.publish = publish
        self.RUNNING[self.config.name] = self
        self.poke()
        task_status.started()
        try:
            await anyio.sleep_forever()
        finally:
            del self.RUNNING[self.config.name]

    def poke(self) -> None:
        self.publish([EndpointSpec(address=a, labels={"by": self.config.name})
                      for a in self.SETS.get(self.config.name, [])])


register(ManualConfig, ManualSource)


def spec(address: str, **kw) -> EndpointSpec:
    return EndpointSpec(address=address, **kw)


def test_merge_keeps_static_first_and_the_first_finder_of_an_address():
    static = [spec("10.0.0.1:80", labels={"from": "static"})]
    a = [spec("10.0.0.1:80", labels={"from": "a"}), spec("10.0.0.2:80", labels={"from": "a"})]
    b = [spec("10.0.0.2:80", labels={"from": "b"}), spec("10.0.0.3:80", labels={"from": "b"})]
    merged = merge(static, [("a", a), ("b", b)])
    assert [(s.address, s.labels["from"]) for s in merged] == [
        ("10.0.0.1:80", "static"), ("10.0.0.2:80", "a"), ("10.0.0.3:80", "b")]


def test_the_built_in_kinds_are_registered():
    assert {"dns", "static"} <= set(kinds())


async def test_runner_applies_changes_and_reload_stops_removed_sources_and_starts_new_ones():
    applied: list[list[str]] = []
    ManualSource.SETS.update(one=["10.0.0.2:80"], two=["10.0.0.3:80"])
    runner = Sources([spec("10.0.0.1:80")], [ManualConfig(name="one")],
                     lambda specs: applied.append([s.address for s in specs]))
    async with anyio.create_task_group() as tg:
        await tg.start(runner.run)
        assert applied[-1] == ["10.0.0.1:80", "10.0.0.2:80"]
        ManualSource.SETS["one"] = ["10.0.0.2:80", "10.0.0.4:80"]
        ManualSource.RUNNING["one"].poke()
        assert applied[-1] == ["10.0.0.1:80", "10.0.0.2:80", "10.0.0.4:80"]
        count = len(applied)
        ManualSource.RUNNING["one"].poke()  # the same set: nothing applied
        assert len(applied) == count
        kept = ManualSource.RUNNING["one"]

        # Reload: static list changed, "one" unchanged (keeps running), "two" added.
        runner.update([spec("10.0.0.9:80")], [ManualConfig(name="one"), ManualConfig(name="two")])
        with anyio.fail_after(5):
            while "two" not in ManualSource.RUNNING:
                await anyio.sleep(0.01)
        assert ManualSource.RUNNING["one"] is kept
        assert applied[-1] == ["10.0.0.9:80", "10.0.0.2:80", "10.0.0.4:80", "10.0.0.3:80"]

        # Reload without "one": its task stops and its endpoints leave.
        runner.update([spec("10.0.0.9:80")], [ManualConfig(name="two")])
        with anyio.fail_after(5):
            while "one" in ManualSource.RUNNING:
                await anyio.sleep(0.01)
        assert applied[-1] == ["10.0.0.9:80", "10.0.0.3:80"]
        kept.poke()  # a stopped source's late report changes nothing
        assert applied[-1] == ["10.0.0.9:80", "10.0.0.3:80"]
        tg.cancel_scope.cancel()
    assert ManualSource.RUNNING == {}


def source_config(text: str) -> cfg.Config:
    return cfg.loads("version = 1\n" + text, source="epick.toml")


def test_dns_table_decodes_with_its_keys_and_template():
    config = source_config('[[pool.sources]]\nkind = "dns"\nname = "fleet.test"\nport = 8000\n'
                           'resolver = "127.0.0.1:5353"\n[pool.sources.template]\n'
                           'engine = "sglang"\nlabels = { zone = "a" }\n')
    (source,) = config.pool.sources
    assert (source.name, source.port, source.resolver_address()) == (
        "fleet.test", 8000, ("127.0.0.1", 5353))
    assert (source.min_ttl_s, source.max_ttl_s) == (1.0, 30.0)
    made = source.template.spec("10.1.2.3", 8000)
    assert (made.address, made.engine, made.labels, made.url) == (
        "10.1.2.3:8000", "sglang", {"zone": "a"}, "http://10.1.2.3:8000/metrics")
    assert source.template.spec("fd00::7", 9).address == "[fd00::7]:9"
    for text, address in (("10.0.0.1", ("10.0.0.1", 53)), ("[fd00::a]:5353", ("fd00::a", 5353))):
        assert msgspec.structs.replace(source, resolver=text).resolver_address() == address


def test_template_placeholders_fill_host_and_port():
    config = source_config('[[pool.sources]]\nkind = "dns"\nname = "f.test"\nport = 80\n'
                           '[pool.sources.template]\nkv_events = "tcp://{host}:5557"\n'
                           'metrics_url = "http://{host}:9100/metrics"\n'
                           '[kv_events]\ntokenizer = "bytes"\n')
    made = config.pool.sources[0].template.spec("10.0.0.5", 80)
    assert (made.kv_events, made.url) == ("tcp://10.0.0.5:5557", "http://10.0.0.5:9100/metrics")


@pytest.mark.parametrize("text, needle", [
    ('[[pool.sources]]\nname = "x.test"\n', "missing required field `kind`"),
    ('[[pool.sources]]\nkind = "consul"\nname = "x"\n', "Invalid value 'consul'"),
    ('[[pool.sources]]\nkind = "dns"\nname = "x"\nport = 70000\n', "pool.sources[0].port"),
    ('[[pool.sources]]\nkind = "dns"\nname = "x"\nresolvr = "1.1.1.1"\n', "resolvr"),
    ('[[pool.sources]]\nkind = "dns"\nname = "x"\nresolver = "a b:53"\n', "resolver"),
    ('[[pool.sources]]\nkind = "dns"\nname = "x"\nresolver = "dns.local:53"\n',
     "resolver 'dns.local:53' is not an IP address"),
    ('[[pool.sources]]\nkind = "dns"\nname = "x"\nresolver = "10.0.0.1:0"\n',
     "has an invalid port"),
    ('[[pool.sources]]\nkind = "dns"\nname = "x"\nmin_ttl_s = 9\nmax_ttl_s = 2\n',
     "min_ttl_s 9.0 is above max_ttl_s 2.0"),
    ('[[pool.sources]]\nkind = "dns"\nname = "x"\n[[pool.sources]]\nkind = "dns"\nname = "x"\n',
     "dns:x is listed twice"),
    ('[[pool.sources]]\nkind = "dns"\nname = "x"\nport = 1\n[pool.sources.template]\n'
     'kv_events = "discover"\n', "kv_events.tokenizer is required"),
])
def test_bad_source_tables_name_the_file_and_the_key(text, needle):
    with pytest.raises(cfg.ConfigError) as err:
        source_config(text)
    assert "epick.toml" in str(err.value) and needle in str(err.value), str(err.value)
