"""How the service wires sources: a template's kv_events turns the KV subscriber on, and
the merged set (not the stand-in that turned it on) is what it subscribes to."""

from __future__ import annotations

from epick import config as cfg
from epick.pool import EndpointSpec
from epick.service import Service


def test_a_template_with_kv_events_turns_kv_on_without_a_stand_in_endpoint(tmp_path):
    config = cfg.loads(
        'version = 1\n[server]\nlisten = "127.0.0.1:0"\nmetrics_listen = ""\n'
        '[admin]\nlisten = ""\n'
        f'[runtime]\ncache_dir = "{tmp_path}"\n'
        '[[pool.sources]]\nkind = "dns"\nname = "fleet.test"\nport = 8000\n'
        'resolver = "127.0.0.1:1"\n[pool.sources.template]\nkv_events = "tcp://{host}:5557"\n'
        '[kv_events]\ntokenizer = "bytes"\n')
    service = Service(config)
    try:
        assert service.kv is not None
        assert service.kv.subscriber.stats() == {}
        found = config.pool.sources[0].template.spec("10.0.0.7", 8000)
        service._set_membership([found])  # what the runner does with a lookup's answer
        assert list(service.kv.subscriber.stats()) == ["10.0.0.7:8000"]
        assert [s.address for s in service.pool.status()] == ["10.0.0.7:8000"]
        service._set_membership([EndpointSpec(address="10.0.0.8:8000")])
        assert service.kv.subscriber.stats() == {}
    finally:
        service.runtime.close()


def test_without_sources_kv_stays_off():
    service = Service(cfg.loads('version = 1\n[admin]\nlisten = ""\n'))
    try:
        assert service.kv is None
        assert service.sources.endpoints == []
    finally:
        service.runtime.close()
