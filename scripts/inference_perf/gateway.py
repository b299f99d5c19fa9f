"""The reference gateway (gateway/proxy.py) plus ``GET /v1/models``, for inference-perf.

    python scripts/inference_perf/gateway.py --listen HOST:PORT --epick HOST:PORT \
        --model sim-base --adapters adapter-0,adapter-1

inference-perf asks ``/v1/models`` whether every adapter of its LoRA traffic split exists
before it starts; the reference gateway only routes completions. This adds that one route,
answered from the names given here (the simulated fleet's base model and adapters), and
changes nothing else about the gateway.
"""

from __future__ import annotations

import argparse

from aiohttp import web

from epick.gateway.proxy import Gateway, make_app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--listen", required=True)
    ap.add_argument("--epick", required=True, help="the epick Pick API address")
    ap.add_argument("--model", required=True)
    ap.add_argument("--adapters", default="", help="comma-separated adapter names")
    args = ap.parse_args()
    names = [args.model, *(a for a in args.adapters.split(",") if a)]

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list",
                                  "data": [{"id": n, "object": "model"} for n in names]})

    async def app() -> web.Application:  # the Gateway needs a running loop
        app = make_app(Gateway(args.epick, args.model))
        app.router.add_get("/v1/models", models)
        return app

    host, port = args.listen.rsplit(":", 1)
    web.run_app(app(), host=host, port=int(port), print=None)


if __name__ == "__main__":
    main()
