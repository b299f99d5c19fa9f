"""docs/scoring.md, the normative score tables, agrees with what conformance enforces:
each policy's params block lists exactly the defaults the shipped module declares
(`describe`), and the LoRA tables' tiers and the load defaults are the ones the vector
files derive their expected values from."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from epick.conformance.vectors import VECTORS_DIR

DOC = Path(__file__).resolve().parents[2] / "docs" / "scoring.md"
POLICIES = ["load", "lora-affinity", "prefix-cache", "precise-prefix", "legacy-v1", "latency"]


def doc() -> str:
    return DOC.read_text()


def params_blocks() -> dict[str, dict]:
    """``# NAME: params and defaults`` TOML blocks, by policy name."""
    blocks = {}
    for body in re.findall(r"```toml\n(.*?)```", doc(), re.S):
        head = re.match(r"# ([\w-]+): params and defaults\n", body)
        assert head, f"docs/scoring.md: a TOML block without its heading line:\n{body}"
        blocks[head.group(1)] = tomllib.loads(body)
    return blocks


def section(title: str) -> str:
    text = doc()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def table_scores(text: str) -> dict[str, str]:
    """First column -> score column of the section's first table (rows after the rule)."""
    rows = {}
    for line in text.splitlines():
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip()[1:-1])]
        if len(cells) >= 3 and cells[0] not in ("row", "") and not cells[0].startswith("---"):
            rows[cells[0]] = _plain(cells[2])
    return rows


def vector_tiers(file: str) -> dict[str, str]:
    """``#   ROW  condition  -> SCORE`` header lines of a vector file."""
    rows = {}
    for line in (VECTORS_DIR / file).read_text().splitlines():
        m = re.match(r"#\s+([a-z-]+)\s+.*?->\s*(.+)$", line)
        if m and m.group(1) not in rows:
            rows[m.group(1)] = _plain(m.group(2))
    return rows


def _plain(formula: str) -> str:
    return (formula.replace("\\|", "|").replace("×", "*").replace("−", "-")
            .replace(" for every endpoint", "").replace(" on every endpoint", "").strip())


@pytest.mark.parametrize("name", POLICIES)
def test_the_doc_lists_every_param_with_the_modules_default(shipped, name):
    declared = shipped(name).instantiate({}).describe().params
    assert params_blocks()[name] == declared


def test_the_seed_lora_table_is_the_one_the_vectors_derive_from():
    doc_rows = table_scores(section("lora-affinity, profile \"seed\" (the default)"))
    vec_rows = vector_tiers("lora-seed.toml")
    assert set(doc_rows) == set(vec_rows) == {"base-model", "running", "room", "waiting",
                                              "otherwise"}
    for row, score in vec_rows.items():
        assert doc_rows[row].startswith(score), (row, doc_rows[row], score)
    assert vec_rows["room"] == "0.75" and vec_rows["waiting"].startswith("0.5 *")
    seed = params_blocks()["lora-affinity"]
    assert (seed["score_running"], seed["score_room"], seed["score_waiting_max"],
            seed["score_other"]) == (1.0, 0.75, 0.5, 0.0)


def test_the_upstream_lora_table_is_the_one_the_vectors_derive_from():
    doc_rows = table_scores(section("lora-affinity, profile \"upstream\""))
    vec_rows = vector_tiers("lora-upstream.toml")
    assert doc_rows == vec_rows == {"running": "1.0", "room": "0.8", "waiting": "0.6",
                                    "otherwise": "0.0"}


def test_the_load_defaults_are_the_vectors():
    header = (VECTORS_DIR / "load.toml").read_text()
    m = re.search(r"defaults: wq = wkv = ([\d.]+), ww = ([\d.]+), work_scale = ([\d.]+)", header)
    assert m, "conformance/vectors/load.toml: its defaults line changed"
    load = params_blocks()["load"]
    assert (load["queue_weight"], load["kv_weight"], load["work_weight"], load["work_scale"]) == (
        float(m.group(1)), float(m.group(1)), float(m.group(2)), float(m.group(3)))
