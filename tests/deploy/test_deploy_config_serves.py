"""The shipped deploy/kubernetes/epick.toml runs: `epick serve` (in-process) with it —
addresses moved to loopback, the InferencePool source pointed at the Kubernetes API
emulator holding deploy/kubernetes/inferencepool.yaml — answers the probes' health
services on the ext_proc port: `liveness` SERVING at once, `readiness` only once a pod
of the pool is Ready and scraped."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import grpc
import msgspec
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "discovery"))

from epick_service import running  # noqa: E402
from fleet_thread import replicas  # noqa: E402
from kube_emulator import PODS, POOLS, emulator, pod  # noqa: E402

from epick import config as cfg  # noqa: E402

KUBE = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
SERVING = health_pb2.HealthCheckResponse.SERVING


def status(port: int, service: str) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5).status


def test_the_shipped_config_serves_the_probes_and_follows_the_shipped_pool(tmp_path):
    shipped = cfg.load(KUBE / "epick.toml")
    manifest = yaml.safe_load((KUBE / "inferencepool.yaml").read_text())
    with replicas([("127.0.0.2", 0)]) as (address,), emulator() as emu:
        port = int(address.rsplit(":", 1)[1])
        manifest["metadata"]["namespace"] = "default"
        manifest["spec"]["targetPorts"] = [{"number": port}]  # where the sim serves
        emu.create(POOLS, manifest)
        labels = manifest["spec"]["selector"]["matchLabels"]
        emu.create(PODS, pod("vllm-llama-0", labels=labels))
        (source,) = shipped.pool.sources
        config = msgspec.structs.replace(
            shipped,
            server=msgspec.structs.replace(shipped.server, listen="127.0.0.1:0",
                                           metrics_listen="127.0.0.1:0"),
            ext_proc=msgspec.structs.replace(shipped.ext_proc, listen="127.0.0.1:0"),
            admin=msgspec.structs.replace(shipped.admin, listen="127.0.0.1:0"),
            runtime=msgspec.structs.replace(shipped.runtime, cache_dir=str(tmp_path)),
            pool=msgspec.structs.replace(shipped.pool, sources=[msgspec.structs.replace(
                source, api_server=emu.url, namespace="default")]))
        with running(config) as svc:
            port = svc.ext_proc_port
            assert status(port, "liveness") == SERVING
            assert status(port, "readiness") != SERVING  # no Ready pod: no endpoint

            emu.set_ready("vllm-llama-0", "127.0.0.2")
            deadline = time.monotonic() + 10
            while status(port, "readiness") != SERVING:
                assert time.monotonic() < deadline, "readiness never SERVING"
                time.sleep(0.05)
            info = svc.call(lambda: svc.service.pool.view.info)
            assert [dict(i.labels) for i in info] == [{"pool": "vllm-llama"}]
