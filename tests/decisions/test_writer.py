"""The writer: never in a pick's way, bounded on disk, honest about what it lost."""

from __future__ import annotations

import errno
import io
import os
import threading
import time

import pytest

from epick import abi, telemetry
from epick.decisions import DecisionLog, read_file, replay, schema, segments
from epick.interfaces import PoolView
from epick.runtime import WasmPolicy
from epick.scheduler.policyset import PolicyEntry, PolicySet
from epick.scheduler.scheduler import Scheduler


def dropped(reason: str) -> float:
    return telemetry.REGISTRY.get_sample_value(
        "epick_decision_log_dropped_total", {"reason": reason}) or 0.0


@pytest.fixture
def scheduler(runtime):
    from epick.config import resolve_module

    mod = runtime.compile(resolve_module("load").read_bytes(), name="load")
    box = {"version": 0}

    def view():
        # A new snapshot every 10 picks, as a scraped pool's view changes.
        box["n"] = box.get("n", 0) + 1
        if box["n"] % 10 == 1:
            box["version"] += 1
            box["view"] = PoolView.build(abi.Snapshot(
                version=box["version"], timestamp_ms=1_700_000_000_000 + box["version"],
                endpoints=tuple(abi.EndpointMetrics(address=f"10.0.0.{i}:8000",
                                                    waiting=(i * box["version"]) % 7)
                                for i in range(4))))
        return box["view"]

    s = Scheduler(view, PolicySet.of(PolicyEntry("load", WasmPolicy(mod, name="load"))))
    yield s
    for e in s.policies.entries:
        e.plugin.close()


def picks(s: Scheduler, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        d = s.schedule(abi.Request(request_id=f"r{i}", model="m", seed=i,
                                   prompt="x" * 200))
        s.complete(decision_id=d.decision_id)


class StuckFile(io.BytesIO):
    """A file whose writes block until ``release`` is set (a hung disk)."""

    def __init__(self, release: threading.Event, entered: threading.Event) -> None:
        super().__init__()
        self.release, self.entered = release, entered

    def write(self, b):
        self.entered.set()
        self.release.wait(30)
        return super().write(b)


def test_a_stuck_disk_never_holds_up_a_pick_and_the_drops_are_counted(tmp_path, scheduler):
    release, entered = threading.Event(), threading.Event()
    log = DecisionLog(tmp_path / "d.log", queue=50, flush_interval_s=0.01,
                      opener=lambda p: StuckFile(release, entered))
    log.attach(scheduler).start()
    before = dropped("queue-full")
    try:
        picks(scheduler, 1)
        assert entered.wait(10)  # the writer is now stuck inside write()
        picks(scheduler, 300, start=1)  # 300 picks + 300 completions while it is stuck
        assert not release.is_set()
        assert log.dropped["queue-full"] >= 600 - 50
        assert dropped("queue-full") - before == log.dropped["queue-full"]
    finally:
        release.set()
        log.close()
    assert log.written["decision"] + log.written["completion"] \
        + log.dropped["queue-full"] == 602


class FullDisk(io.FileIO):
    """A real file that refuses writes with ENOSPC while ``full`` is set."""

    full = threading.Event()

    def write(self, b):
        if self.full.is_set():
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().write(b)


def test_a_full_disk_loses_records_not_picks_and_logging_resumes_after(tmp_path, scheduler):
    path = tmp_path / "d.log"
    log = DecisionLog(path, flush_interval_s=0.01, opener=lambda p: FullDisk(p, "wb"))
    log.attach(scheduler).start()
    before = dropped("write-error")
    try:
        picks(scheduler, 20)
        assert log.sync()
        FullDisk.full.set()
        picks(scheduler, 20, start=20)  # every one still gets an endpoint
        assert log.sync()
        assert log.dropped["write-error"] == 40
        assert dropped("write-error") - before == 40
        FullDisk.full.clear()
        picks(scheduler, 20, start=40)
        assert log.sync()
    finally:
        FullDisk.full.clear()
        log.close()
    assert log.written == {"decision": 40, "completion": 40}
    files = segments(path)
    assert len(files) == 2  # the failed file was closed; the next batch started a new one
    first = list(read_file(files[0]))
    assert sum(isinstance(r, schema.DecisionRec) for r in first) == 20
    later = list(read_file(files[1]))
    assert isinstance(later[0], schema.Header) and not later[0].fresh_start
    assert sum(isinstance(r, schema.DecisionRec) for r in later) == 20
    assert any(isinstance(r, schema.Gap) and r.lost == 40 for r in later)
    r = replay([path])
    assert r.lost_records == 40 and r.decisions == 40


def test_files_rotate_by_size_and_the_oldest_go_beyond_the_total(tmp_path, scheduler):
    path = tmp_path / "d.log"
    log = DecisionLog(path, flush_interval_s=0.005, max_file_bytes=4000,
                      max_total_bytes=12_000, embed_modules=False, compress=False)
    log.attach(scheduler).start()
    try:
        for k in range(40):
            picks(scheduler, 10, start=k * 10)
            assert log.sync()
    finally:
        log.close()
    files = segments(path)
    assert 2 <= len(files) <= 5
    assert sum(f.stat().st_size for f in files) <= 12_000 + 4000 + 2000
    assert all(isinstance(next(read_file(f)), schema.Header) for f in files)
    # The newest decisions survived, the oldest were pruned.
    ids = [r.id for f in files for r in read_file(f) if isinstance(r, schema.DecisionRec)]
    assert ids[-1].endswith("-190") and not any(i.endswith("-1") for i in ids)


def test_rotated_files_older_than_max_age_are_deleted(tmp_path, scheduler):
    path = tmp_path / "d.log"
    clock = {"now": time.time()}
    log = DecisionLog(path, flush_interval_s=0.005, rotate_s=60, max_age_s=3600,
                      embed_modules=False, wall_clock=lambda: clock["now"])
    log.attach(scheduler).start()
    try:
        picks(scheduler, 5)
        assert log.sync()
        clock["now"] += 120  # the active file is now older than rotate_s
        picks(scheduler, 5, start=5)
        assert log.sync()
        assert len(segments(path)) == 2
        clock["now"] += 7200  # the rotated file is past max_age_s
        picks(scheduler, 5, start=10)
        assert log.sync()
    finally:
        log.close()
    # Both rotated files (written at real time, now 2 h in the log's past) are gone.
    assert segments(path) == [path]
    ids = [r.id for r in read_file(path) if isinstance(r, schema.DecisionRec)]
    assert [i.rsplit("-", 1)[1] for i in ids] == ["b", "c", "d", "e", "f"]


def test_a_previous_runs_file_is_kept_aside_not_overwritten(tmp_path, scheduler):
    path = tmp_path / "d.log"
    path.write_bytes(schema.MAGIC)
    log = DecisionLog(path, flush_interval_s=0.005).attach(scheduler).start()
    try:
        picks(scheduler, 3)
    finally:
        log.close()
    files = segments(path)
    assert len(files) == 2 and files[0].read_bytes() == schema.MAGIC


def test_only_listed_headers_and_the_chosen_prompt_form_are_recorded(tmp_path, scheduler):
    path = tmp_path / "d.log"
    log = DecisionLog(path, prompt="full", headers=("X-Tenant",), flush_interval_s=0.005)
    log.attach(scheduler).start()
    try:
        scheduler.schedule(abi.Request(model="m", prompt="hello", seed=1,
                                       headers={"x-tenant": "a", "authorization": "secret"}))
    finally:
        log.close()
    d = next(r for r in read_file(path) if isinstance(r, schema.DecisionRec))
    assert d.request.headers == {"x-tenant": "a"}
    assert d.request.prompt == "hello" and d.request.blocks == b""


def test_bad_settings_are_refused_with_the_value(tmp_path):
    with pytest.raises(ValueError, match="prompt 'text': expected hashes, full or none"):
        DecisionLog(tmp_path / "d.log", prompt="text")


def test_live_checkpoints_and_recoveries_are_mirrored_by_the_replay(tmp_path, runtime):
    """A recovery rolls a policy back to its checkpoint; the replay rolls back there too."""
    from epick.config import resolve_module
    from epick.decisions.writer import _FRAME

    mod = runtime.compile(resolve_module("prefix-cache").read_bytes(), name="prefix-cache")
    prefix = WasmPolicy(mod, name="prefix-cache", checkpoint_on_hooks=False)
    view = PoolView.build(abi.Snapshot(version=1, timestamp_ms=1, endpoints=tuple(
        abi.EndpointMetrics(address=f"10.0.0.{i}:8000") for i in range(4))))
    s = Scheduler(lambda: view, PolicySet.of(PolicyEntry("prefix-cache", prefix)))
    path = tmp_path / "d.log"
    log = DecisionLog(path, flush_interval_s=0.005).attach(s).start()

    def ask(i: int, tenant: int) -> None:
        s.schedule(abi.Request(model="m", seed=i, prompt=f"tenant {tenant} " * 40 + str(i)))

    try:
        for i in range(6):
            ask(i, i % 3)
        prefix.checkpoint(force=True)  # what the service's checkpoint task does
        for i in range(6, 12):
            ask(i, 3 + i % 3)  # new tenants: their prefixes are not in the checkpoint
        prefix.recover()  # what a trap does: back to the checkpoint
        for i in range(12, 24):
            ask(i, 3 + i % 3)
    finally:
        log.close()
        prefix.close()
    records = list(read_file(path))
    kinds = [type(r).__name__ for r in records if not isinstance(r, schema.DecisionRec)]
    assert "Checkpoint" in kinds and kinds.count("Recovered") == 1

    r = replay([path], runtime=runtime)
    assert r.live_recoveries == 1 and r.agreement == 1.0
    assert all(d.changed == 0 for d in r.score_deltas)

    # Without the recovery the replay's prefix cache remembers what the live one forgot.
    stripped = tmp_path / "no-recovery.log"
    with open(stripped, "wb") as f:
        f.write(schema.MAGIC)
        for x in records:
            if not isinstance(x, schema.Recovered):
                blob = schema.encoder.encode(x)
                f.write(_FRAME.pack(len(blob)) + blob)
    other = replay([stripped], runtime=runtime)
    assert next(d for d in other.score_deltas if d.policy == "prefix-cache").changed > 0


@pytest.mark.parametrize("policy, stage", [("prefix-cache", "score"),
                                           ("prefix-cache", "pre_request"),
                                           ("lora-affinity", "post_response")])
def test_a_recovery_inside_a_call_is_mirrored_at_that_stage(tmp_path, runtime, policy,
                                                            stage):
    """A timed-out call is retried on a re-created instance (state back to the
    checkpoint); the replay must re-create it at the same point of the same call."""
    from epick.config import resolve_module

    class RecoversOnce(WasmPolicy):
        """The real module; on its 40th call at ``stage`` it re-creates its instance
        first, as a timeout followed by a successful retry does."""

        n = 0

        def _tick(self, what):
            if what == stage:
                RecoversOnce.n += 1
                if RecoversOnce.n == 40:
                    self.recover()

        def score(self, cycle, candidates):
            self._tick("score")
            return super().score(cycle, candidates)

        def pre_request(self, cycle, endpoint):
            self._tick("pre_request")
            super().pre_request(cycle, endpoint)

        def post_response(self, event):
            self._tick("post_response")
            super().post_response(event)

    mod = runtime.compile(resolve_module(policy).read_bytes(), name=policy)
    plugin = RecoversOnce(mod, name=policy, checkpoint_on_hooks=False)
    view = PoolView.build(abi.Snapshot(version=1, timestamp_ms=1, endpoints=tuple(
        abi.EndpointMetrics(address=f"10.0.0.{i}:8000", max_lora=2) for i in range(4))))
    s = Scheduler(lambda: view, PolicySet.of(PolicyEntry(policy, plugin)))
    path = tmp_path / "d.log"
    log = DecisionLog(path, flush_interval_s=0.005).attach(s).start()
    open_ids = []
    try:
        for i in range(80):
            # 7 tenants' prompts and 5 adapters: state (prefix LRUs, LoRA history) that
            # the checkpoint at pick 3 only partly holds.
            d = s.schedule(abi.Request(model="m", seed=i, adapter=f"a{i % 5}",
                                       prompt=f"tenant {i % 7} " * 30 + str(i)))
            open_ids.append(d.decision_id)
            if i == 3:
                plugin.checkpoint(force=True)
            if len(open_ids) > 6:  # requests finish a few picks later
                s.complete(decision_id=open_ids.pop(0))
    finally:
        log.close()
        plugin.close()
    assert RecoversOnce.n >= 40
    assert sum(isinstance(r, schema.Recovered) for r in read_file(path)) == 1

    r = replay([path], runtime=runtime)
    assert r.live_recoveries == 1
    assert r.agreement == 1.0 and r.fallbacks_agreed == r.decisions
    assert all(d.changed == 0 for d in r.score_deltas), r.score_deltas
