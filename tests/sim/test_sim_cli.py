import json
import subprocess
import sys


def test_run_prints_the_summary_of_a_virtual_time_run_as_json():
    out = subprocess.run(
        [sys.executable, "-m", "epick.sim", "run", "--workload", "zero-hit", "--replicas", "2",
         "--qps", "10", "--duration", "3", "--seed", "1"],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary["requests"] > 0
    assert summary["adapter_loads"] == 0
    assert {"ttft_p50_s", "ttft_p99_s", "output_tok_s", "prefix_cache_hit_rate", "cpu_s"} <= set(summary)


def test_a_bad_config_file_is_reported_with_its_name(tmp_path):
    bad = tmp_path / "sim.json"
    bad.write_text('{"max_lora": 3}')
    out = subprocess.run(
        [sys.executable, "-m", "epick.sim", "run", "--config", str(bad), "--duration", "1"],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 2
    assert out.stderr == f"error: {bad}: Object contains unknown field `max_lora`\n"
