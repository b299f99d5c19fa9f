"""The InferencePool source (``kind = "inference-pool"``) against a Kubernetes API
emulator (kmock), not a real cluster: objects shaped like the API's (InferencePool v1,
Pod v1), created, patched and deleted over HTTP; the source watches them through a relay
the tests can break (tests/discovery/kube_emulator.py)."""

from __future__ import annotations

import logging
import time

import anyio
import msgspec
import pytest
from kube_emulator import PODS, POOLS, emulator, pod, pool

from epick import telemetry
from epick.pool.k8s import InferencePoolSource, InferencePoolSourceConfig
from epick.pool.k8s_objects import InvalidObject, parse_pod, parse_pool

VLLM = {"app": "vllm"}


class Watcher:
    """Runs one source on this event loop; records every set it publishes."""

    def __init__(self, emu, **config) -> None:
        config.setdefault("name", "fleet")
        config.setdefault("min_retry_s", 0.05)
        config.setdefault("max_retry_s", 0.2)
        self.config = msgspec.convert({"api_server": emu.url, **config},
                                      InferencePoolSourceConfig)
        self.source = InferencePoolSource(self.config)
        self.sets: list[list[str]] = []

    def publish(self, specs) -> None:
        self.sets.append([s.address for s in specs])

    @property
    def now(self) -> set[str]:
        return set(self.sets[-1]) if self.sets else set()

    async def until(self, want: set[str], timeout: float = 5.0) -> float:
        t0 = time.monotonic()
        with anyio.fail_after(timeout):
            while self.now != want:
                await anyio.sleep(0.005)
        return time.monotonic() - t0


async def call(fn, *args, **kw):
    """The emulator's writes block (urllib): off the loop the source runs on."""
    return await anyio.to_thread.run_sync(lambda: fn(*args, **kw))


def errors(source: str, reason: str) -> float:
    return telemetry.REGISTRY.get_sample_value(
        "epick_discovery_errors_total", {"source": source, "reason": reason}) or 0.0


async def test_pods_added_made_ready_and_removed_change_membership_at_every_target_port():
    with emulator() as emu:
        emu.create(POOLS, pool("fleet", labels=VLLM, ports=[8000, 8001]))
        emu.create(PODS, pod("vllm-a", labels=VLLM, ip="10.0.0.1", ready=True))
        emu.create(PODS, pod("web", labels={"app": "web"}, ip="10.0.0.9", ready=True))
        w = Watcher(emu, template={"engine": "sglang", "labels": {"pool": "fleet"},
                                   "metrics_url": "http://{host}:9100/metrics?rank={port}"})
        async with anyio.create_task_group() as tg:
            await tg.start(w.source.run, w.publish)
            await w.until({"10.0.0.1:8000", "10.0.0.1:8001"})

            await call(emu.create, PODS, pod("vllm-b", labels=VLLM))  # Pending, no IP
            await anyio.sleep(0.2)
            assert w.now == {"10.0.0.1:8000", "10.0.0.1:8001"}
            await call(emu.set_ready, "vllm-b", "10.0.0.2", ready=False)  # Running, not Ready
            await anyio.sleep(0.2)
            assert w.now == {"10.0.0.1:8000", "10.0.0.1:8001"}
            await call(emu.set_ready, "vllm-b", "10.0.0.2")
            await w.until({"10.0.0.1:8000", "10.0.0.1:8001", "10.0.0.2:8000",
                           "10.0.0.2:8001"}, timeout=1.0)  # within 1 s of the event

            await call(emu.set_ready, "vllm-a", "10.0.0.1", ready=False)
            await w.until({"10.0.0.2:8000", "10.0.0.2:8001"}, timeout=1.0)
            await call(emu.set_ready, "vllm-a", "10.0.0.1")
            await w.until({"10.0.0.1:8000", "10.0.0.1:8001", "10.0.0.2:8000",
                           "10.0.0.2:8001"}, timeout=1.0)
            await call(emu.delete, PODS, "vllm-b")
            await w.until({"10.0.0.1:8000", "10.0.0.1:8001"}, timeout=1.0)
            # A pod relabelled out of the selector leaves.
            await call(emu.patch, PODS, "vllm-a", {"metadata": {"labels": {"app": "old"}}})
            await w.until(set(), timeout=1.0)
            tg.cancel_scope.cancel()
        # The template made every endpoint: engine, labels, {host}/{port} filled in.
        w.source.pods = {"p": parse_pod(pod("p", labels=VLLM, ip="10.0.0.7", ready=True))}
        spec = w.source.endpoints()[1]
        assert (spec.address, spec.engine, spec.labels, spec.metrics_url) == (
            "10.0.0.7:8001", "sglang", {"pool": "fleet"}, "http://10.0.0.7:9100/metrics?rank=8001")


async def test_a_pod_being_deleted_leaves_before_it_is_gone():
    with emulator() as emu:
        emu.create(POOLS, pool("fleet", labels=VLLM, ports=[8000]))
        held = pod("vllm-a", labels=VLLM, ip="10.0.0.1", ready=True)
        held["metadata"]["finalizers"] = ["example.com/drain"]
        emu.create(PODS, held)
        w = Watcher(emu)
        async with anyio.create_task_group() as tg:
            await tg.start(w.source.run, w.publish)
            await w.until({"10.0.0.1:8000"})
            await call(emu.delete, PODS, "vllm-a")  # sets deletionTimestamp only
            await w.until(set(), timeout=1.0)
            tg.cancel_scope.cancel()


async def test_a_broken_watch_is_followed_by_a_resync_that_finds_what_it_missed(caplog):
    with emulator() as emu:
        emu.create(POOLS, pool("fleet", labels=VLLM, ports=[8000]))
        emu.create(PODS, pod("vllm-a", labels=VLLM, ip="10.0.0.1", ready=True))
        emu.create(PODS, pod("vllm-b", labels=VLLM, ip="10.0.0.2", ready=True))
        w = Watcher(emu)
        name = w.config.describe()
        before = errors(name, "network")
        async with anyio.create_task_group() as tg:
            await tg.start(w.source.run, w.publish)
            await w.until({"10.0.0.1:8000", "10.0.0.2:8000"})
            published = len(w.sets)

            await call(emu.break_watches)
            # Changed while epick cannot hear: only a resync can find these.
            await call(emu.delete, PODS, "vllm-a")
            await call(emu.create, PODS, pod("vllm-c", labels=VLLM, ip="10.0.0.3", ready=True))
            with anyio.fail_after(3):  # the re-lists fail (refused) a few times
                while w.source.failures < 3:
                    await anyio.sleep(0.01)
            assert w.now == {"10.0.0.1:8000", "10.0.0.2:8000"}, "the last set is kept"
            assert len(w.sets) == published
            assert errors(name, "network") > before

            await call(emu.resume)
            await w.until({"10.0.0.2:8000", "10.0.0.3:8000"}, timeout=2.0)
            assert w.source.failures == 0
            # and the new watch is live again
            await call(emu.set_ready, "vllm-b", "10.0.0.2", ready=False)
            await w.until({"10.0.0.3:8000"}, timeout=1.0)
            tg.cancel_scope.cancel()
        warnings = [r for r in caplog.records if r.name == "epick.pool.k8s"
                    and r.levelno == logging.WARNING]
        assert len(warnings) == 1, "the first failure warns; the repeats do not"
        assert "keeping the last 2 endpoints" in warnings[0].getMessage()


async def test_a_410_gone_watch_is_followed_by_a_resync():
    with emulator() as emu:
        emu.create(POOLS, pool("fleet", labels=VLLM, ports=[8000]))
        emu.create(PODS, pod("vllm-a", labels=VLLM, ip="10.0.0.1", ready=True))
        w = Watcher(emu)
        before = errors(w.config.describe(), "api")
        async with anyio.create_task_group() as tg:
            await tg.start(w.source.run, w.publish)
            await w.until({"10.0.0.1:8000"})
            emu.expire_next_watch("pods")
            await call(emu.break_watches)  # the re-watch after this gets the 410
            await call(emu.resume)
            with anyio.fail_after(3):
                while errors(w.config.describe(), "api") == before:
                    await anyio.sleep(0.01)
            await call(emu.create, PODS, pod("vllm-b", labels=VLLM, ip="10.0.0.2", ready=True))
            await w.until({"10.0.0.1:8000", "10.0.0.2:8000"}, timeout=2.0)
            assert w.now == {"10.0.0.1:8000", "10.0.0.2:8000"}
            tg.cancel_scope.cancel()
        assert emu._gone == []


async def test_a_malformed_pool_is_an_error_naming_the_field_and_the_last_set_is_kept(caplog):
    with emulator() as emu:
        emu.create(POOLS, pool("fleet", labels=VLLM, ports=[8000]))
        emu.create(PODS, pod("vllm-a", labels=VLLM, ip="10.0.0.1", ready=True))
        w = Watcher(emu)
        name = w.config.describe()
        before = errors(name, "invalid")
        async with anyio.create_task_group() as tg:
            await tg.start(w.source.run, w.publish)
            await w.until({"10.0.0.1:8000"})
            await call(emu.patch, POOLS, "fleet", {"spec": {"targetPorts": []}})
            with anyio.fail_after(2):
                while errors(name, "invalid") == before:
                    await anyio.sleep(0.01)
            await anyio.sleep(0.3)
            assert w.now == {"10.0.0.1:8000"}
            text = " ".join(r.getMessage() for r in caplog.records if r.name == "epick.pool.k8s")
            assert "InferencePool default/fleet: spec.targetPorts must list 1 to 8 ports" in text
            assert "keeping the last 1 endpoints" in text

            # Fixed (with two ports now): followed at once.
            await call(emu.patch, POOLS, "fleet", {"spec": {"targetPorts": [
                {"number": 8000}, {"number": 8002}]}})
            await w.until({"10.0.0.1:8000", "10.0.0.1:8002"}, timeout=2.0)
            tg.cancel_scope.cancel()


async def test_a_malformed_pod_is_logged_and_kept_as_last_seen(caplog):
    with emulator() as emu:
        emu.create(POOLS, pool("fleet", labels=VLLM, ports=[8000]))
        emu.create(PODS, pod("vllm-a", labels=VLLM, ip="10.0.0.1", ready=True))
        w = Watcher(emu)
        before = errors(w.config.describe(), "invalid")
        async with anyio.create_task_group() as tg:
            await tg.start(w.source.run, w.publish)
            await w.until({"10.0.0.1:8000"})
            await call(emu.patch, PODS, "vllm-a", {"status": {"podIP": "10.0.0.x"}})
            with anyio.fail_after(3):
                while errors(w.config.describe(), "invalid") == before:
                    await anyio.sleep(0.01)
            assert w.now == {"10.0.0.1:8000"}
            # A resync (the watch broken) reads the bad pod again: still kept.
            await call(emu.break_watches)
            await call(emu.resume)
            with anyio.fail_after(3):
                while errors(w.config.describe(), "invalid") < before + 2:
                    await anyio.sleep(0.01)
            assert w.now == {"10.0.0.1:8000"}
            assert any("Pod vllm-a: status.podIP '10.0.0.x' is not an IP address" in
                       r.getMessage() for r in caplog.records)
            await call(emu.create, PODS, pod("vllm-b", labels=VLLM, ip="10.0.0.2", ready=True))
            await w.until({"10.0.0.1:8000", "10.0.0.2:8000"}, timeout=1.0)
            tg.cancel_scope.cancel()


async def test_the_pools_selector_changing_reselects_the_pods():
    with emulator() as emu:
        emu.create(POOLS, pool("fleet", labels=VLLM, ports=[8000]))
        emu.create(POOLS, pool("other", labels={"app": "x"}, ports=[7000]))
        emu.create(PODS, pod("vllm-a", labels=VLLM, ip="10.0.0.1", ready=True))
        emu.create(PODS, pod("v2-a", labels={"app": "vllm-v2"}, ip="10.0.0.5", ready=True))
        w = Watcher(emu)
        async with anyio.create_task_group() as tg:
            await tg.start(w.source.run, w.publish)
            await w.until({"10.0.0.1:8000"})
            await call(emu.patch, POOLS, "fleet",
                       {"spec": {"selector": {"matchLabels": {"app": "vllm-v2"}}}})
            await w.until({"10.0.0.5:8000"}, timeout=1.0)
            tg.cancel_scope.cancel()


async def test_a_missing_pool_is_an_error_until_it_is_created():
    with emulator() as emu:
        emu.create(PODS, pod("vllm-a", labels=VLLM, ip="10.0.0.1", ready=True))
        w = Watcher(emu, name="later")
        before = errors(w.config.describe(), "not-found")
        async with anyio.create_task_group() as tg:
            await tg.start(w.source.run, w.publish)  # started after the first attempt
            assert w.now == set() and w.source.failures >= 1
            assert errors(w.config.describe(), "not-found") > before
            await call(emu.create, POOLS, pool("later", labels=VLLM, ports=[8000]))
            await w.until({"10.0.0.1:8000"}, timeout=2.0)
            tg.cancel_scope.cancel()


@pytest.mark.parametrize("change, message", [
    ({"selector": {}}, "spec.selector.matchLabels must be a non-empty map"),
    ({"selector": {"matchLabels": {"app": "a b"}}}, "matchLabels.app value 'a b'"),
    ({"targetPorts": [{"number": 0}]}, "spec.targetPorts[0].number must be a port"),
    ({"targetPorts": [{"number": 80}, {"number": 80}]}, "targetPorts[1].number 80 is listed"),
    ({"targetPorts": [{"number": p} for p in range(1, 10)]}, "must list 1 to 8 ports"),
])
def test_pool_objects_are_read_as_upstreams_v1_or_refused_by_field(change, message):
    obj = pool("fleet", labels=VLLM, ports=[8000, 8001, 8002])
    spec = parse_pool(obj, "default/fleet")
    assert (spec.match_labels, spec.ports, spec.label_selector) == (
        (("app", "vllm"),), (8000, 8001, 8002), "app=vllm")
    obj["spec"].update(change)
    with pytest.raises(InvalidObject, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_pool(obj, "default/fleet")


def test_config_errors_name_the_source():
    def convert(**kw):
        return msgspec.convert({"name": "fleet", **kw}, InferencePoolSourceConfig)

    with pytest.raises(ValueError, match="set api_server or kubeconfig, not both"):
        convert(api_server="http://127.0.0.1:1", kubeconfig="~/.kube/config")
    with pytest.raises(ValueError, match="is not an http"):
        convert(api_server="127.0.0.1:8001")
    with pytest.raises(msgspec.ValidationError, match="namespace"):
        convert(namespace="Not_A_Label")
    assert convert(namespace="llm").describe() == "inference-pool:llm/fleet"


async def test_a_kubeconfig_and_its_context_lead_to_the_cluster(tmp_path):
    with emulator() as emu:
        emu.create(POOLS, pool("fleet", labels=VLLM, ports=[8000], namespace="llm"))
        emu.create(PODS, pod("vllm-a", labels=VLLM, ip="10.0.0.1", ready=True, namespace="llm"))
        emu.create(PODS, pod("vllm-b", labels=VLLM, ip="10.0.0.2", ready=True))  # default ns
        kubeconfig = tmp_path / "config"
        kubeconfig.write_text(f"""
apiVersion: v1
kind: Config
current-context: elsewhere
clusters:
  - name: emulated
    cluster: {{server: "{emu.url}"}}
  - name: nowhere
    cluster: {{server: "http://127.0.0.1:1"}}
users:
  - name: tester
    user: {{token: not-checked-by-the-emulator}}
contexts:
  - name: emulated
    context: {{cluster: emulated, user: tester, namespace: llm}}
  - name: elsewhere
    context: {{cluster: nowhere, user: tester}}
""")
        # No namespace: the context's (llm), as kubectl takes it.
        w = Watcher(emu, api_server="", kubeconfig=str(kubeconfig), context="emulated")
        async with anyio.create_task_group() as tg:
            await tg.start(w.source.run, w.publish)
            await w.until({"10.0.0.1:8000"})
            tg.cancel_scope.cancel()
        assert "Bearer not-checked-by-the-emulator" in emu.authorizations()
