"""The `[[pool.sources]]` examples in the README and examples/epick.toml decode."""

from __future__ import annotations

import re
from pathlib import Path

from epick import config as cfg

ROOT = Path(__file__).resolve().parents[2]


def test_the_readme_dns_example_is_a_valid_config():
    text = (ROOT / "README.md").read_text()
    block = next(b for b in re.findall(r"```\n(.*?)```", text, re.S) if "[[pool.sources]]" in b)
    config = cfg.loads("version = 1\n" + block, source="README.md")
    (source,) = config.pool.sources
    assert (source.name, source.port, source.resolver) == (
        "vllm.fleet.svc.cluster.local", 8000, "10.96.0.10:53")


def test_the_commented_example_in_epick_toml_is_a_valid_config():
    lines = (ROOT / "examples" / "epick.toml").read_text().splitlines()
    start = lines.index("# [[pool.sources]]")
    block = []
    for line in lines[start:]:
        if not line.startswith("#"):
            break
        block.append(line[2:].removeprefix("# "))
    config = cfg.loads("version = 1\n" + "\n".join(block) + '\n[kv_events]\ntokenizer = "bytes"\n',
                       source="examples/epick.toml")
    (source,) = config.pool.sources
    assert source.template.spec("10.0.0.1", 8000).kv_events == "tcp://10.0.0.1:5557"


def test_the_commented_inference_pool_example_in_epick_toml_is_a_valid_config():
    lines = (ROOT / "examples" / "epick.toml").read_text().splitlines()
    start = [i for i, line in enumerate(lines) if line == "# [[pool.sources]]"][1]
    block = []
    for line in lines[start:]:
        if not line.startswith("#"):
            break
        block.append(line[2:])
    config = cfg.loads("version = 1\n" + "\n".join(block), source="examples/epick.toml")
    (source,) = config.pool.sources
    assert (source.describe(), source.watch_timeout_s, source.template.labels) == (
        "inference-pool:-/vllm-llama", 300, {"pool": "vllm-llama"})


def test_the_inference_pool_example_in_the_docs_is_a_valid_config():
    text = (ROOT / "docs" / "discovery.md").read_text()
    block = next(b for b in re.findall(r"```toml\n(.*?)```", text, re.S)
                 if 'kind = "inference-pool"' in b)
    config = cfg.loads("version = 1\n" + block, source="docs/discovery.md")
    (source,) = config.pool.sources
    assert source.name == "vllm-llama"
