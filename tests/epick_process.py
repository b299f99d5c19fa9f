"""`epick serve` as a separate process, for the active-active tests (KV events).

    e = EpickProcess(config_path)   # waits for "serving Pick on", reads the metrics URL
    endpoint, kv = e.pick(pb.PickRequest(..., explain=True))   # kv: {address: (blocks, matched)}
    settle([a, b])                  # until both applied the same KV-event frames
    e.stop()                        # SIGTERM, then SIGKILL, by its PID

The config must set ``metrics_listen`` (``settle`` reads ``epick_kv_frames_total``).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.request

import grpc

from epick.api.gen.epick.v1 import picker_pb2 as pb
from epick.api.gen.epick.v1 import picker_pb2_grpc

__all__ = ["EpickProcess", "settle", "stop_process", "until_counts"]

KvCounts = dict[str, tuple[int, int]]


class EpickProcess:
    def __init__(self, config: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "epick.cli", "serve", "--config",
                                      config], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.channel: grpc.Channel | None = None
        self.target = self._line("epick: serving Pick on").rsplit(" ", 1)[1]
        self.metrics_url = self._line("epick: metrics on").split()[-1]
        self.channel = grpc.insecure_channel(self.target)
        self.picker = picker_pb2_grpc.EndpointPickerStub(self.channel)

    def _line(self, starts: str) -> str:
        line = self.proc.stdout.readline().strip()
        if not line.startswith(starts):
            self.stop()
            raise AssertionError(f"epick serve: expected {starts!r}, got {line!r}; "
                                 f"{self.proc.stderr.read()[-3000:]}")
        return line

    def pick(self, request: pb.PickRequest) -> tuple[str, KvCounts]:
        """The picked endpoint and, per candidate, (prefix_blocks, prefix_matched)."""
        resp = self.picker.Pick(request, timeout=30)
        kv = {c.endpoint: (c.prefix_blocks, c.prefix_matched)
              for c in resp.explanation.candidates if c.HasField("prefix_matched")}
        return resp.endpoint, kv

    def frames(self) -> dict[str, float]:
        """``epick_kv_frames_total`` per endpoint: the KV-event frames it has applied."""
        text = urllib.request.urlopen(self.metrics_url, timeout=10).read().decode()
        return {line.split('"')[1]: float(line.rsplit(" ", 1)[1])
                for line in text.splitlines() if line.startswith("epick_kv_frames_total{")}

    def stop(self) -> None:
        stop_process(self.proc)
        if self.channel is not None:
            self.channel.close()


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM, and SIGKILL if it has not exited 30 s later."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def settle(epicks: list[EpickProcess], timeout_s: float = 60.0) -> None:
    """Until every epick has applied the same frames from every endpoint: a pick must not
    race an event still on its way to one of them (a real-vLLM run where it did agreed on
    82 of 84 counts)."""
    deadline = time.monotonic() + timeout_s
    while True:
        seen = [e.frames() for e in epicks]
        if seen[0] and all(x == seen[0] for x in seen):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"the epicks' KV frames never agreed: {seen}")
        time.sleep(0.02)


def until_counts(epick: EpickProcess, probe: pb.PickRequest, endpoints: int,
                 timeout_s: float = 120.0) -> None:
    """Until it answers with every endpoint's KV counts (subscribed, replay done). The
    probe should be shorter than a block, so that asking leaves no prefix state."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            _, kv = epick.pick(probe)
            if len(kv) == endpoints and all(m >= 0 for _, m in kv.values()):
                return
        except grpc.RpcError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"{epick.target}: no KV counts after {timeout_s:.0f} s")
        time.sleep(0.1)
