"""`epick bench real`'s epick configs: --latency-params reaches the latency policy."""

from types import SimpleNamespace

import pytest

from epick import config
from epick.bench import real


def _fleet():
    return SimpleNamespace(replicas=[SimpleNamespace(address="127.0.0.1:8001"),
                                     SimpleNamespace(address="127.0.0.1:8002")])


def test_latency_params_reach_the_latency_policy_and_no_other(tmp_path):
    path = tmp_path / "c.toml"
    real._epick_config(_fleet(), "epick-latency", path,
                       {"latency": {"work_ktokens": 0.05, "stale_ms": 0, "x": True}})
    cfg = config.load(path)
    params = {p.name: p.params for p in cfg.policies}
    assert params["latency"] == {"work_ktokens": 0.05, "stale_ms": 0, "x": True}
    assert params["prefix-cache"] == {}
    # beside latency, load counts no recent picks (latency counts the prefill ahead)
    assert params["load"] == {"recent_requests": 0.0}


def test_without_params_the_policies_have_their_defaults(tmp_path):
    path = tmp_path / "c.toml"
    real._epick_config(_fleet(), "epick-latency", path, {"latency": {}})
    assert all(p.params == {} for p in config.load(path).policies if p.name != "load")
    real._epick_config(_fleet(), "epick", path, {"latency": {}})
    assert all(p.params == {} for p in config.load(path).policies)
    assert [e.address for e in config.load(path).pool.endpoints] == ["127.0.0.1:8001",
                                                                      "127.0.0.1:8002"]


def test_latency_params_must_be_a_json_object():
    with pytest.raises(SystemExit):
        real.main(["--latency-params", "[1, 2]"])
