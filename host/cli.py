"""The ``epick`` command line: one entry point, one sub-command per job.

    epick serve --config FILE [--listen HOST:PORT]     run the Pick service
    epick check-config FILE                            validate a config as serve would, exit 0 or say why
    epick conformance MODULE.wasm [...]                check a policy against the score tables
    epick bench pick [--grpc] [...]                    decision latency / throughput
    epick bench quality [--quick] [...]                routing quality on a simulated fleet
    epick demo [--duration S]                          a simulated fleet, epick, a gateway, load
    epick replay LOG [--policy NAME=FILE.wasm]...      a decision log through changed policies
"""

from __future__ import annotations

import argparse
import logging
import sys

import msgspec

__all__ = ["main"]


def _serve(args: argparse.Namespace) -> int:
    import signal
    from pathlib import Path

    import anyio

    from epick.config import ConfigError, load
    from epick.service import ListenError, Service

    try:
        config = load(args.config)
    except ConfigError as exc:
        print(f"epick: {exc}", file=sys.stderr)
        return 2
    if args.listen:
        config = msgspec.structs.replace(
            config, server=msgspec.structs.replace(config.server, listen=args.listen))

    async def main() -> None:
        try:
            service = Service(config, config_path=Path(args.config).resolve())
            await service.load_policies()  # compiles off the loop; a bad policy exits 2
        except ConfigError as exc:
            print(f"epick: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
        async with anyio.create_task_group() as tg:
            await tg.start(service.run)
            host = config.server.listen.rsplit(":", 1)[0]
            print(f"epick: serving Pick on {host}:{service.port}", flush=True)
            if service.metrics_port:
                mhost = config.server.metrics_listen.rsplit(":", 1)[0]
                print(f"epick: metrics on http://{mhost}:{service.metrics_port}/metrics",
                      flush=True)
            if service.admin_port:
                ahost = config.admin.listen.rsplit(":", 1)[0]
                print(f"epick: admin on {ahost}:{service.admin_port}", flush=True)
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    tg.cancel_scope.cancel()
                    break

    try:
        anyio.run(main, backend="asyncio")
    except BaseException as exc:  # a task group wraps what it raises in a group
        listen = _find(exc, ListenError)
        if listen is None:
            raise
        print(f"epick: {listen}", file=sys.stderr)
        return 2
    return 0


def _find(exc: BaseException, kind: type[BaseException]) -> BaseException | None:
    """The first ``kind`` in ``exc`` or the exception groups nested in it."""
    if isinstance(exc, kind):
        return exc
    for inner in getattr(exc, "exceptions", ()):
        found = _find(inner, kind)
        if found is not None:
            return found
    return None


def _check_config(args: argparse.Namespace) -> int:
    from epick.config import ConfigError, load, resolve_module

    try:
        config = load(args.file)
    except ConfigError as exc:
        print(f"{exc}", file=sys.stderr)
        return 1
    from pathlib import Path

    base = Path(args.file).resolve().parent
    for i, pc in enumerate(config.policies):
        path = resolve_module(pc.module, base=base)
        if not path.is_file():
            print(f"{args.file}: policy {pc.name!r} module {pc.module!r}: no such file {path} "
                  f"- at `$.policies[{i}].module`", file=sys.stderr)
            return 1
    refused = _vet_policies(config, Path(args.file).resolve())
    if refused is not None:
        print(refused, file=sys.stderr)
        return 1
    print(f"{args.file}: ok (version {config.version}, {len(config.pool.endpoints)} endpoints, "
          f"{len(config.policies)} policies)")
    return 0


def _vet_policies(config, config_path) -> str | None:
    """Each config policy through serve's own load checks — its module read, compiled and
    validated, ``init`` run with its params in the sandbox, the smoke run — so that
    check-config and serve give one verdict. Serve's message when one is refused, else
    None. Nothing goes live and no port is bound."""
    from epick.config import ConfigError, resolve_module
    from epick.policy_manager import PolicyManager, PolicyRejected, read_module
    from epick.runtime import Runtime
    from epick.service import _limits

    source = str(config_path)  # serve names the resolved config path
    runtime = Runtime(limits=_limits(config), cache_dir=_cache_dir(config))
    try:
        manager = PolicyManager(runtime, None)  # vetting reads no scheduler
        for pc in config.policies:
            path = resolve_module(pc.module, base=config_path.parent)
            try:
                wasm = read_module(path)
            except PolicyRejected as exc:
                return str(ConfigError(source, f"policy {pc.name!r}: cannot read module "
                                               f"{path}: {exc.reason}"))
            try:
                manager.vet(pc.name, wasm, dict(pc.params), source=str(path), gate=False)
            except PolicyRejected as exc:
                return str(ConfigError(source, str(exc)))
    finally:
        runtime.close()
    return None


def _cache_dir(config):
    from pathlib import Path

    rc = config.runtime
    return Path(rc.cache_dir).expanduser() if rc.cache_dir else Path.home() / ".cache" / "epick"


def _conformance(argv: list[str]) -> int:
    from epick.conformance.cli import main as conformance_main

    return conformance_main(argv)


def _bench(argv: list[str]) -> int:
    from epick.bench.cli import main as bench_main

    return bench_main(argv)


def _demo(argv: list[str]) -> int:
    from epick.demo import main as demo_main

    return demo_main(argv)


def _replay(argv: list[str]) -> int:
    from epick.decisions.cli import main as replay_main

    return replay_main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Sub-commands with their own parsers get their arguments untouched.
    passthrough = {"conformance": _conformance, "bench": _bench, "demo": _demo,
                   "replay": _replay}
    if argv and argv[0] in passthrough:
        return passthrough[argv[0]](argv[1:])

    parser = argparse.ArgumentParser(prog="epick", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log-level", default="INFO",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the Pick service")
    serve.add_argument("--config", required=True, help="the TOML config file")
    serve.add_argument("--listen", help="HOST:PORT for the Pick API (overrides [server] listen)")
    check = sub.add_parser("check-config", help="validate a config file")
    check.add_argument("file")
    for name in passthrough:
        sub.add_parser(name, help=f"see `epick {name} --help`")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        return _serve(args)
    return _check_config(args)


if __name__ == "__main__":
    raise SystemExit(main())
