"""`python -m epick.gateway --listen 127.0.0.1:8080 --epick 127.0.0.1:9002 --model BASE`"""

from __future__ import annotations

import argparse
import logging

import uvicorn

from epick.gateway.proxy import Gateway, make_app


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m epick.gateway", description=__doc__)
    ap.add_argument("--listen", default="127.0.0.1:8080")
    ap.add_argument("--epick", default="127.0.0.1:9002", help="the epick Pick API address")
    ap.add_argument("--model", required=True, help="the base model name the fleet serves")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    host, port = args.listen.rsplit(":", 1)
    uvicorn.run(make_app(Gateway(args.epick, args.model)), host=host, port=int(port),
                log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
