"""`epick bench quality --trace`: a recorded log as the simulator's workload."""

from __future__ import annotations

from decision_logs import workload

from epick.bench.quality import main as quality_main
from epick.bench.quality import run_trace
from epick.decisions import Changes
from epick.decisions.trace import load_trace
from epick.sim.tokens import block_hashes


def sharing(requests) -> list[int]:
    """For each request, how many of its blocks an earlier request already had."""
    seen: set[int] = set()
    out = []
    for r in requests:
        hs = block_hashes(r.prompt, 16, adapter=r.adapter, cache_salt=r.cache_salt)
        out.append(sum(h in seen for h in hs))
        seen.update(hs)
    return out


def test_a_trace_keeps_arrivals_adapters_lengths_and_prefix_sharing(tmp_path, record):
    # max_blocks above the longest prompt: the whole hash chain is in the log.
    record(tmp_path / "d.log", seconds=4.0, max_blocks=4096)
    original = workload(4.0)

    trace = load_trace([tmp_path / "d.log"])

    assert trace.replicas == 8 and trace.max_lora == 3
    assert len(trace.requests) == len(original) == trace.completions
    t0 = original[0].arrival_s
    # Same order, same adapters, prompts as long, outputs as long, arrivals to the ms.
    for got, want in zip(trace.requests, original):
        assert got.adapter == want.adapter
        assert len(got.prompt.encode()) == len(want.prompt.encode())
        assert got.max_tokens == want.max_tokens
        assert abs(got.arrival_s - (want.arrival_s - t0)) < 0.002
    assert sharing(trace.requests) == sharing(original)


def test_blocks_past_the_recorded_cap_are_never_assumed_shared(tmp_path, record):
    record(tmp_path / "d.log", seconds=4.0, max_blocks=8)
    original = workload(4.0)
    trace = load_trace([tmp_path / "d.log"])
    got, want = sharing(trace.requests), sharing(original)
    assert all(g <= min(w, 8) for g, w in zip(got, want))
    assert sum(got) > 0


def test_the_recorded_and_the_candidate_sets_run_side_by_side(tmp_path, record, runtime):
    record(tmp_path / "d.log", seconds=4.0)
    results = run_trace([tmp_path / "d.log"], Changes(weights={"prefix-cache": 0.0}),
                        routers=("round-robin",), runtime=runtime)
    rows = results["workloads"]["trace"]
    assert list(rows) == ["recorded", "candidate", "round-robin"]
    assert rows["recorded"]["hit_rate"][0] > rows["candidate"]["hit_rate"][0]
    assert all(r["throughput_tok_s"][0] > 0 for r in rows.values())


def test_a_bad_candidate_is_refused_with_a_reason(tmp_path, record, capsys):
    record(tmp_path / "d.log", seconds=1.0)
    assert quality_main(["--trace", str(tmp_path / "d.log"), "--weights", "nope=1"]) == 2
    assert "--weights names policy 'nope'" in capsys.readouterr().err
