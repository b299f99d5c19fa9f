"""µs per scrape to parse real engine pages (tests/pool/fixtures/), side by side.

    epick bench parse-pages [--rounds 15] [--calls 50]

Rows per page: ``parse_page`` (epick's parser: line selection, only the newest LoRA
series handed to prometheus_client) and, for scale, prometheus_client's parser over the
whole page (what reading every line costs). The 400-series page is a real vLLM-CPU page
after 411 distinct adapter lists (host/fleet/capture_pages.py). Numbers, not goals.
"""

from __future__ import annotations

import argparse
import sys

from prometheus_client.parser import text_string_to_metric_families

from epick.bench import checkout
from epick.bench.timing import per_call_us
from epick.pool.parse import parse_page

ENGINES = {"vllm": "vllm", "sglang": "sglang", "trtllm": "trtllm"}


def full_parse(text: str) -> None:
    for family in text_string_to_metric_families(text):
        for _ in family.samples:
            pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="epick bench parse-pages", description=__doc__)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=50)
    args = ap.parse_args(argv)
    print(f"{'page':28} {'lines':>6} {'lora series':>11} {'parse_page µs':>14} "
          f"{'full parse µs':>14} {'ratio':>6}")
    for path in sorted(checkout.path("tests", "pool", "fixtures").glob("*.txt")):
        engine = ENGINES.get(path.name.split("_")[0])
        if engine is None:
            continue
        text = path.read_text()
        page = parse_page(text, engine=engine, url=str(path), previous=None)
        ours, _, _ = per_call_us(lambda: parse_page(text, engine=engine, url="u", previous=None),
                                 args.rounds, args.calls, warmup=5)
        full, _, _ = per_call_us(lambda: full_parse(text), args.rounds, max(1, args.calls // 5),
                                 warmup=2)
        print(f"{path.name:28} {text.count(chr(10)):>6} {page.lora_series:>11} {ours:>14.0f} "
              f"{full:>14.0f} {full / ours:>5.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
