"""interfaces/view.py: what a pool publishes, built once per change."""

from __future__ import annotations

import msgspec
import pytest

from epick import abi
from epick.interfaces import EndpointInfo, PoolView


def snap(n: int, version: int = 7) -> abi.Snapshot:
    return abi.Snapshot(version=version, timestamp_ms=1_700_000_000_000, endpoints=tuple(
        abi.EndpointMetrics(address=f"10.0.0.{i}:8000", waiting=i) for i in range(n)))


def test_build_encodes_the_snapshot_once_as_set_snapshot_receives_it():
    s = snap(3)
    view = PoolView.build(s)
    assert msgspec.msgpack.decode(view.encoded, type=abi.Snapshot) == s
    assert view.snapshot is s and view.version == 7


def test_build_without_info_makes_every_endpoint_fresh_and_unrestricted():
    view = PoolView.build(snap(3))
    assert view.info == (EndpointInfo(),) * 3
    assert view.fresh == (0, 1, 2)
    assert view.addresses == ("10.0.0.0:8000", "10.0.0.1:8000", "10.0.0.2:8000")
    assert not view.restricted and not view.any_sleeping


def test_build_precomputes_fresh_restricted_and_sleeping_from_the_info():
    info = [EndpointInfo(fresh=False), EndpointInfo(models=frozenset({"m"})),
            EndpointInfo(sleeping=True)]
    view = PoolView.build(snap(3), info)
    assert view.fresh == (1, 2)
    assert view.restricted and view.any_sleeping
    adapters_only = PoolView.build(snap(1), [EndpointInfo(adapters=frozenset({"a"}))])
    assert adapters_only.restricted and not adapters_only.any_sleeping


def test_build_refuses_info_that_does_not_match_the_endpoints_and_says_both_counts():
    with pytest.raises(ValueError, match="2 EndpointInfo for 3 endpoints"):
        PoolView.build(snap(3), [EndpointInfo(), EndpointInfo()])


def test_an_empty_pool_builds():
    view = PoolView.build(snap(0))
    assert view.fresh == () and view.addresses == () and view.info == ()


def test_the_view_is_read_only_and_its_serving_cache_is_not_part_of_equality():
    a, b = PoolView.build(snap(2)), PoolView.build(snap(2))
    with pytest.raises(AttributeError):
        a.fresh = ()  # type: ignore[misc]
    a.serving[("m", "")] = (0,)
    assert a == b
