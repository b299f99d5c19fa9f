"""PolicyManager without a service: one path to live, one record of what is live."""

from __future__ import annotations

import pytest

from epick import abi
from epick.config import resolve_module
from epick.interfaces import PoolView
from epick.policy_manager import PolicyManager, PolicyRejected, PolicySpec
from epick.runtime import Limits, Runtime
from epick.scheduler.policyset import UnknownPolicyError
from epick.scheduler.scheduler import Scheduler

LOAD = resolve_module("load").read_bytes()
LORA = resolve_module("lora-affinity").read_bytes()
PREFIX = resolve_module("prefix-cache").read_bytes()


@pytest.fixture(scope="module")
def runtime():
    with Runtime(Limits(budget_ms=500.0)) as rt:
        yield rt


@pytest.fixture
def manager(runtime):
    eps = tuple(abi.EndpointMetrics(address=f"10.0.0.{i}:8000") for i in range(3))
    view = PoolView.build(abi.Snapshot(version=1, timestamp_ms=1, endpoints=eps))
    m = PolicyManager(runtime, Scheduler(lambda: view), require_conformance=False)
    yield m
    for e in m.scheduler.policies.entries:
        e.plugin.close()


def one_record(m: PolicyManager) -> list[str]:
    """The live names, after checking the set and the record agree."""
    names = m.names()
    assert list(m.active) == names
    for e in m.scheduler.policies.entries:
        assert m.active[e.name].module.sha256 == e.plugin.module.sha256
    return names


def test_the_config_goes_live_through_typed_specs(manager):
    kept = manager.replace_all([PolicySpec("load", LOAD, weight=2.0),
                                PolicySpec("lora", LORA, shadow=True, source="lora.wasm")])
    assert kept == [] and one_record(manager) == ["load", "lora"]
    assert manager.scheduler.policies.get("load").weight == 2.0
    assert manager.scheduler.policies.shadows[0].name == "lora"
    assert {n: a.origin for n, a in manager.active.items()} == {"load": "config",
                                                                "lora": "config"}
    assert manager.scheduler.schedule(abi.Request(model="m", seed=1)).endpoint


def test_an_admin_load_stays_across_a_config_reload_and_is_named(manager):
    manager.replace_all([PolicySpec("load", LOAD)])
    manager.activate("lora", LORA, source="admin", gate=False)
    assert manager.active["lora"].origin == "admin" and manager.runtime_loaded == {"lora"}
    kept = manager.replace_all([PolicySpec("load", LOAD, weight=3.0)], changed={"load"})
    assert kept == ["lora"] and one_record(manager) == ["load", "lora"]
    assert manager.scheduler.policies.get("load").weight == 3.0


def test_an_unchanged_config_entry_keeps_its_instance(manager):
    manager.replace_all([PolicySpec("prefix", PREFIX)])
    before = manager.scheduler.policies.get("prefix").plugin
    manager.replace_all([PolicySpec("prefix", PREFIX)], changed=set())
    assert manager.scheduler.policies.get("prefix").plugin is before


def test_a_refused_module_changes_nothing_and_names_the_policy(manager):
    manager.replace_all([PolicySpec("load", LOAD)])
    before = manager.scheduler.policies
    with pytest.raises(PolicyRejected, match=r"policy 'bad' rejected: "):
        manager.replace_all([PolicySpec("load", LOAD), PolicySpec("bad", b"\0asm junk")])
    with pytest.raises(PolicyRejected, match=r"policy 'bad2' rejected: "):
        manager.activate("bad2", b"not wasm", gate=False)
    assert manager.scheduler.policies is before and one_record(manager) == ["load"]


def test_a_hot_swap_replaces_in_place_keeps_the_weight_and_closes_the_old(manager):
    manager.replace_all([PolicySpec("a", LOAD, weight=4.0), PolicySpec("b", PREFIX)])
    old = manager.scheduler.policies.get("a").plugin
    manager.activate("a", LORA, source="policies/a.wasm", gate=False)
    assert one_record(manager) == ["a", "b"]
    entry = manager.scheduler.policies.get("a")
    assert entry.weight == 4.0 and entry.plugin is not old
    assert manager.active["a"].origin == "policy_dir"
    assert old.closed


def test_remove_frees_the_policy_and_an_unknown_name_is_refused(manager):
    manager.replace_all([PolicySpec("a", LOAD), PolicySpec("b", PREFIX)])
    gone = manager.scheduler.policies.get("a").plugin
    manager.remove("a")
    assert one_record(manager) == ["b"] and gone.closed
    with pytest.raises(UnknownPolicyError, match="no policy named 'zz'"):
        manager.remove("zz")
    assert one_record(manager) == ["b"]


def test_a_bad_weight_is_refused_before_anything_is_vetted(manager):
    with pytest.raises(PolicyRejected, match=r"weight must be a finite number >= 0, got -1"):
        manager.activate("a", LOAD, weight=-1.0, gate=False)
    assert one_record(manager) == []


def test_an_async_hot_swap_imports_the_state_off_the_loop(manager, monkeypatch):
    import threading

    import anyio

    import epick.policy_manager as pm

    manager.activate("prefix", PREFIX, source="admin", gate=False)
    old = manager.scheduler.policies.get("prefix").plugin
    manager.scheduler.schedule(abi.Request(model="m", seed=1, prompt="x" * 4096))
    state = old.export_state()
    assert state
    imports: list[threading.Thread] = []
    real_import = pm._import

    def spy(name, plugin, blob):
        imports.append(threading.current_thread())
        real_import(name, plugin, blob)

    monkeypatch.setattr(pm, "_import", spy)

    async def swap():
        await manager.activate_async("prefix", PREFIX, source="admin", gate=False)
        return threading.current_thread()

    loop_thread = anyio.run(swap)
    new = manager.scheduler.policies.get("prefix").plugin
    assert new is not old and new.export_state() == state
    assert len(imports) == 1 and imports[0] is not loop_thread  # once, on a worker


def test_checkpoint_each_skips_a_plugin_swapped_out_meanwhile(manager):
    import anyio

    manager.replace_all([PolicySpec("load", LOAD), PolicySpec("prefix", PREFIX)])
    load, prefix = (e.plugin for e in manager.scheduler.policies.entries)
    calls: list[str] = []

    async def checkpoint_while_prefix_leaves():
        async with anyio.create_task_group() as tg:
            tg.start_soon(manager.checkpoint_each)
            await anyio.sleep(0)  # the first policy's turn is done: remove the second
            manager.remove("prefix")

    load.checkpoint = lambda: calls.append("load")
    prefix.checkpoint = lambda: calls.append("prefix")
    anyio.run(checkpoint_while_prefix_leaves)
    assert calls == ["load"] and one_record(manager) == ["load"]
