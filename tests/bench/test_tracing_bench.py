"""`epick bench tracing` runs its four setups (and --in-process its three tracers) and
prints the table (tiny runs)."""

from epick.bench import tracing as bench


def test_a_tiny_run_measures_every_setup_in_every_round():
    setups, which = bench.measure(endpoints=2, seconds=0.2, rounds=2, settle_s=0.1)
    assert [s.name for s in setups] == ["off", "off (A/A)", "0.01 sampled", "1 sampled"]
    assert [s.ratio for s in setups] == [None, None, 0.01, 1.0]
    assert which == "rotel (blackhole)"  # rotel is a dev dependency
    for s in setups:
        assert len(s.rounds_us) == 2 and all(len(r) > 0 for r in s.rounds_us), s.name
    assert "[tracing]" not in setups[0].config(1)
    assert "sample_ratio = 0.01" in setups[2].config(1)


def test_in_process_times_the_three_tracers(capsys):
    assert bench.main(["--in-process", "--endpoints", "2", "--rounds", "3",
                       "--block", "20"]) == 0
    out = capsys.readouterr().out
    assert "answer_pick in process" in out
    for name in ("off", "0.01 sampled", "1 sampled"):
        assert f"\n{name} " in out
