"""inference-perf end to end: real benchmark traffic through epick, against the simulated fleet.

    make inference-perf          # = .venv/bin/python scripts/inference_perf/run.py
    .venv/bin/python scripts/inference_perf/run.py [--only multi-lora] [--duration 40] [--rate 6]

For each workload, for each route below, it starts a fresh simulated fleet
(``python -m epick.sim serve``: 4 replicas, 8 adapters, 2 LoRA slots each). Then it runs
inference-perf (in its own Python 3.12 venv, ``.venv-inference-perf``), and its reports go
to ``results/inference-perf/<workload>/<route>/``.

Workloads (inference-perf's own generators):
  multi-lora      random prompts, with ``load.lora_traffic_split`` over 8 adapters
                  (30/20/15/10/10/5/5/5 %)
  shared-prefix   ``data.type: shared_prefix``: 8 system prompts of 1,500 tokens,
                  25 questions each

Routes:
  gateway-epick        reference gateway (host/gateway/proxy.py) -> Pick -> epick's default
                       policies (load, prefix-cache, lora-affinity, weight 1 each)
  gateway-random       the same, but epick has only `load` at weight 0: every total is 0,
                       so the max picker's seeded tie-break picks uniformly at random (the
                       gateway has no round robin of its own)
  envoy-epick          Envoy (examples/envoy/envoy.yaml) -> ext_proc -> the same default
                       policies
  envoy-round-robin    the same Envoy file with ext_proc disabled: its `replicas` cluster
                       does ROUND_ROBIN over the fleet

Nothing is downloaded at run time. The tokenizer inference-perf counts tokens with is
trained here, by make_tokenizer.py, on the text inference-perf ships. ``summary.md`` and
``summary.json`` hold the headline numbers of every run.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epick.bench.checkout import tests_module

#: The Envoy tests' harness (tests/envoy/envoy_harness.py): the committed example, ports rewritten.
harness = tests_module("envoy", "envoy_harness")
ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
IP_VENV = ROOT / ".venv-inference-perf"
OUT = ROOT / "results" / "inference-perf"
BASE_MODEL = "sim-base"
REPLICAS, ADAPTERS, MAX_LORA = 4, 8, 2
SPLIT = [0.30, 0.20, 0.15, 0.10, 0.10, 0.05, 0.05, 0.05]
ROUTES = ["gateway-epick", "gateway-random", "envoy-epick", "envoy-round-robin"]
DEFAULT_POLICIES = [("load", 1.0), ("prefix-cache", 1.0), ("lora-affinity", 1.0)]
RANDOM_POLICIES = [("load", 0.0)]


def workload(name: str, rate: float, duration: int) -> dict:
    load = {"type": "constant", "stages": [{"rate": rate, "duration": duration}],
            "num_workers": 1, "worker_max_concurrency": 256, "request_timeout": 120}
    if name == "multi-lora":
        data = {"type": "random",
                "input_distribution": {"min": 200, "max": 1200, "mean": 600, "std_dev": 200},
                "output_distribution": {"min": 16, "max": 64, "mean": 32, "std_dev": 8}}
        load["lora_traffic_split"] = [{"name": f"adapter-{i}", "split": s}
                                      for i, s in enumerate(SPLIT)]
    elif name == "shared-prefix":
        data = {"type": "shared_prefix", "shared_prefix": {
            "num_groups": 8, "num_prompts_per_group": 25, "system_prompt_len": 1500,
            "question_len": 50, "output_len": 32, "seed": 7}}
    else:
        raise SystemExit(f"unknown workload {name!r}")
    return {"data": data, "load": load}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(what: str, ok, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if ok():
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"{what} not ready after {timeout_s} s")


@contextmanager
def process(args: list[str], log: Path, **kw) -> Iterator[subprocess.Popen]:
    """A child process, stopped (SIGTERM, then SIGKILL after 10 s) when the block ends."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(args, stdout=kw.pop("stdout", out), stderr=out,
                                stdin=subprocess.DEVNULL, **kw)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


@contextmanager
def sim_fleet(work: Path) -> Iterator[list[str]]:
    args = [PY, "-m", "epick.sim", "serve", "--replicas", str(REPLICAS),
            "--adapters", str(ADAPTERS), "--max-lora", str(MAX_LORA)]
    with process(args, work / "sim.log", stdout=subprocess.PIPE) as proc:
        addresses: list[str] = []
        deadline = time.monotonic() + 30
        buf = b""
        while len(addresses) < REPLICAS:
            left = deadline - time.monotonic()
            if left <= 0 or proc.poll() is not None:
                raise SystemExit(f"the simulated fleet did not start: see {work / 'sim.log'}")
            if select.select([proc.stdout], [], [], left)[0]:
                chunk = os.read(proc.stdout.fileno(), 4096)
                buf += chunk
                *lines, buf = buf.split(b"\n")
                addresses += [ln.split()[1].decode() for ln in lines if ln.startswith(b"READY ")]
        yield addresses


def epick_config(addresses: list[str], policies, *, pick: int, ext_proc: int) -> str:
    lines = ["version = 1", "[server]", f'listen = "127.0.0.1:{pick}"', 'metrics_listen = ""',
             "[admin]", 'listen = ""', "[pool]", "scrape_interval_ms = 50",
             "[ext_proc]", f'listen = "127.0.0.1:{ext_proc}"', f'base_model = "{BASE_MODEL}"']
    for a in addresses:
        lines += ["[[pool.endpoints]]", f'address = "{a}"']
    for name, weight in policies:
        lines += ["[[policies]]", f'name = "{name}"', f'module = "{name}"', f"weight = {weight}"]
    return "\n".join(lines) + "\n"


def serving(port: int) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                        timeout=1)
        except grpc.RpcError:
            return False  # not listening yet
        return resp.status == health_pb2.HealthCheckResponse.SERVING


@contextmanager
def epick(addresses: list[str], policies, work: Path) -> Iterator[tuple[int, int]]:
    pick, ext_proc = free_port(), free_port()
    conf = work / "epick.toml"
    conf.write_text(epick_config(addresses, policies, pick=pick, ext_proc=ext_proc))
    with process([str(ROOT / ".venv" / "bin" / "epick"), "serve", "--config", str(conf)],
                 work / "epick.log"):
        wait_until("epick", lambda: serving(pick))
        yield pick, ext_proc


@contextmanager
def front(route: str, addresses: list[str], work: Path) -> Iterator[str]:
    """The base URL inference-perf talks to, with everything behind it running."""
    with ExitStack() as stack:
        policies = RANDOM_POLICIES if route == "gateway-random" else DEFAULT_POLICIES
        if route.startswith("gateway"):
            pick, _ = stack.enter_context(epick(addresses, policies, work))
            port = free_port()
            stack.enter_context(process(
                [PY, "-m", "epick.gateway", "--listen", f"127.0.0.1:{port}",
                 "--epick", f"127.0.0.1:{pick}", "--model", BASE_MODEL],
                work / "gateway.log"))
            url = f"http://127.0.0.1:{port}"
            wait_until("the gateway", lambda: _get(f"{url}/health"))
            yield url
        else:
            with_epick = route == "envoy-epick"
            ext_proc = (stack.enter_context(epick(addresses, policies, work))[1]
                        if with_epick else free_port())
            envoy = stack.enter_context(harness.Envoy(harness.render(
                harness.EXAMPLE.read_text(), ext_proc_port=ext_proc, replicas=addresses,
                ext_proc=with_epick, access_log=False)))
            yield envoy.url


def _get(url: str) -> bool:
    import urllib.request
    with urllib.request.urlopen(url, timeout=1) as resp:  # noqa: S310 (local)
        return resp.status == 200


def inference_perf(url: str, name: str, rate: float, duration: int, tokenizer: Path,
                   out: Path, work: Path) -> None:
    conf = {
        "api": {"type": "completion", "streaming": True},
        "server": {"type": "vllm", "model_name": BASE_MODEL, "base_url": url,
                   "ignore_eos": True},
        "tokenizer": {"pretrained_model_name_or_path": str(tokenizer)},
        "report": {"request_lifecycle": {"summary": True, "per_stage": False,
                                         "per_request": False, "per_adapter": True},
                   "prometheus": None},
        "storage": {"local_storage": {"path": str(out)}},
        **workload(name, rate, duration),
    }
    path = work / "inference-perf.json"  # JSON is YAML: inference-perf reads it as is
    path.write_text(json.dumps(conf, indent=2))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(work / "inference-perf.log", "ab") as log:
        rc = subprocess.run([str(IP_VENV / "bin" / "inference-perf"), "--config_file", str(path),
                             "--log-level", "WARNING"], stdout=log, stderr=log, env=env,
                            timeout=duration + 600).returncode
    if rc != 0:
        raise SystemExit(f"inference-perf failed ({rc}): see {work / 'inference-perf.log'}")


def headline(report_dir: Path) -> dict:
    """The numbers worth a table, from inference-perf's summary report."""
    doc = json.loads((report_dir / "summary_lifecycle_metrics.json").read_text())
    ok = doc.get("successes", {})
    lat = ok.get("latency", {})
    tput = ok.get("throughput", {})

    def pct(metric: str, p: str) -> float | None:
        v = lat.get(metric, {}).get(p)
        return None if v is None else round(v, 4)

    return {
        "requests_ok": ok.get("count"),
        "requests_failed": doc.get("failures", {}).get("count"),
        "ttft_p50_s": pct("time_to_first_token", "median"),
        "ttft_p90_s": pct("time_to_first_token", "p90"),
        "ttft_p99_s": pct("time_to_first_token", "p99"),
        "latency_p50_s": pct("request_latency", "median"),
        "latency_p90_s": pct("request_latency", "p90"),
        "output_tokens_per_s": round(tput.get("output_tokens_per_sec", 0.0), 1),
        "requests_per_s": round(tput.get("requests_per_sec", 0.0), 2),
    }


def write_summary(new: list[dict], args) -> None:
    """Merge ``new`` into summary.json/.md: a partial run (--only/--route) replaces its own
    rows and keeps the others."""
    path = OUT / "summary.json"
    old = json.loads(path.read_text()) if path.exists() else []
    ran = {(r["workload"], r["route"]) for r in new}
    rows = [r for r in old if (r["workload"], r["route"]) not in ran] + new
    order = {w: i for i, w in enumerate(["multi-lora", "shared-prefix"])}
    rows.sort(key=lambda r: (order.get(r["workload"], 9), ROUTES.index(r["route"])))
    path.write_text(json.dumps(rows, indent=2) + "\n")
    cols = ["workload", "route", "requests_ok", "requests_failed", "ttft_p50_s", "ttft_p90_s",
            "ttft_p99_s", "latency_p50_s", "output_tokens_per_s"]
    lines = [
        "# inference-perf against the simulated fleet",
        "",
        f"`{' '.join(sys.argv)}` (last run) — {REPLICAS} replicas, {ADAPTERS} adapters, max_lora "
        f"{MAX_LORA}, {args.rate} QPS for {args.duration} s per run, streaming completions. "
        "Routes and workloads: see scripts/inference_perf/run.py. Reports: one folder per "
        "run below this one.",
        "",
        "The load is open-loop (a constant arrival rate), so output tokens/s match across "
        "routes by design: routing shows in TTFT and latency. `requests_failed` counts "
        "inference-perf's failures (HTTP errors, timeouts).",
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
    ]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")
    (OUT / "summary.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    global OUT
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["multi-lora", "shared-prefix"], action="append")
    ap.add_argument("--route", choices=ROUTES, action="append")
    ap.add_argument("--rate", type=float, default=6.0, help="requests per second")
    ap.add_argument("--duration", type=int, default=40, help="seconds per run")
    ap.add_argument("--out", type=Path, help="reports folder (default: results/inference-perf)")
    args = ap.parse_args()
    OUT = args.out or OUT
    if not (IP_VENV / "bin" / "inference-perf").exists():
        raise SystemExit("no inference-perf venv: run `make inference-perf-venv` first")

    work_root = Path(tempfile.mkdtemp(prefix="epick-inference-perf-"))
    tokenizer = work_root / "tokenizer"
    subprocess.run([str(IP_VENV / "bin" / "python"),
                    str(ROOT / "scripts" / "inference_perf" / "make_tokenizer.py"),
                    str(tokenizer)], check=True, timeout=300)
    rows = []
    for name in args.only or ["multi-lora", "shared-prefix"]:
        for route in args.route or ROUTES:
            work = work_root / name / route
            work.mkdir(parents=True)
            out = OUT / name / route
            shutil.rmtree(out, ignore_errors=True)
            print(f"== {name} via {route} (logs: {work})", flush=True)
            with sim_fleet(work) as addresses, front(route, addresses, work) as url:
                inference_perf(url, name, args.rate, args.duration, tokenizer, out, work)
            row = {"workload": name, "route": route, **headline(out)}
            print("   ", json.dumps(row), flush=True)
            rows.append(row)
    write_summary(rows, args)
    print(f"summary: {OUT / 'summary.md'}")


if __name__ == "__main__":
    main()
