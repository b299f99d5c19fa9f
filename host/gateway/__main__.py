"""`python -m epick.gateway --listen 127.0.0.1:8080 --epick 127.0.0.1:9002 --model BASE`"""

from __future__ import annotations

import argparse
import logging

from aiohttp import web

from epick.gateway.proxy import Gateway, make_app


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m epick.gateway", description=__doc__)
    ap.add_argument("--listen", default="127.0.0.1:8080")
    ap.add_argument("--epick", default="127.0.0.1:9002", help="the epick Pick API address")
    ap.add_argument("--model", required=True, help="the base model name the fleet serves")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    host, port = args.listen.rsplit(":", 1)

    async def app() -> web.Application:
        return make_app(Gateway(args.epick, args.model))

    web.run_app(app(), host=host, port=int(port), print=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
