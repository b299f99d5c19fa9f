"""``python -m epick.bench.floor serve --config F``: ``epick serve`` with scheduling stubbed.

The serving path's floor for ``epick bench pick --grpc``: the same process, config,
servicer, validation, telemetry and gRPC server, but ``Scheduler.schedule`` returns one
constant decision. Pick ÷ no-op on this server is what a Pick costs beyond the no-op
before any scheduling — the part of the ratio that no work in the scheduler or the
policies can remove. A benchmark harness only: never a way to serve.
"""

from __future__ import annotations

import sys

from epick.scheduler import scheduler


def _constant(self, request, *, explain=False, subset=None, pin=""):
    return scheduler.Decision(decision_id="floor", endpoint="10.9.0.0:8000",
                              fallbacks=["10.9.0.1:8000"], snapshot_version=1, skipped=[])


def main(argv: list[str] | None = None) -> int:
    from epick.cli import main as cli_main

    scheduler.Scheduler.schedule = _constant
    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
