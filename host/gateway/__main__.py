"""`python -m epick.gateway --listen 127.0.0.1:8080 --epick 127.0.0.1:9002 --model BASE`

With ``--config epick.toml`` the gateway reads the OpenAI settings (``[openai]``:
``base_model``, ``objectives``, ``model_rewrites``) from the service's own config, so it
translates requests exactly as the service's ext_proc and HTTP front ends do; ``--model``
then overrides the base model.
"""

from __future__ import annotations

import argparse
import logging

from aiohttp import web

from epick.api.openai_request import ConfigError, load_settings
from epick.gateway.proxy import Gateway, make_app


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m epick.gateway", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--listen", default="127.0.0.1:8080")
    ap.add_argument("--epick", default="127.0.0.1:9002", help="the epick Pick API address")
    ap.add_argument("--model", help="the base model name the fleet serves (required "
                                    "unless --config sets openai.base_model)")
    ap.add_argument("--config", help="an epick config file: its [openai] settings")
    args = ap.parse_args(argv)
    try:
        settings = load_settings(args.config) if args.config else None
    except ConfigError as exc:
        ap.error(str(exc))
    base_model = args.model or (settings.base_model if settings else "")
    if not base_model:
        ap.error("--model is required (or --config with openai.base_model set)")
    logging.basicConfig(level=logging.INFO)
    host, port = args.listen.rsplit(":", 1)

    async def app() -> web.Application:
        return make_app(Gateway(args.epick, base_model,
                                objectives=dict(settings.objectives) if settings else None,
                                model_rewrites=(dict(settings.model_rewrites)
                                                if settings else None)))

    web.run_app(app(), host=host, port=int(port), print=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
