"""The ``ejkernel`` command: ``ejkernel info``, ``ejkernel cache
{path,list,clear,export,import,ship}``, ``ejkernel tune --shapes FILE --out FILE`` and
``ejkernel build <platform>``."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform as _platform
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _info(args: argparse.Namespace) -> int:
    import jax

    from ejkernel import _env
    from ejkernel._invocation import current_backend, device_fingerprint
    from ejkernel.plugins import get_registry, plugin_infos

    registry = get_registry()
    backend = current_backend()
    print("versions")
    print(f"  python {_platform.python_version()}")
    for dist in ("ejkernel-core", "jax", "jaxlib"):
        print(f"  {dist} {_version(dist)}")
    print("devices")
    for dev in jax.devices():
        print(f"  {dev.platform}:{dev.id} {getattr(dev, 'device_kind', '?')}")
    print(f"  fingerprint {device_fingerprint()}")
    print("plugins")
    infos = plugin_infos()
    if not infos:
        print("  (none found: pip install ejkernel-xla)")
    for info in infos:
        dist = f" [{info.distribution}]" if info.distribution else ""
        error = f": {info.error}" if info.error else ""
        print(f"  {info.name} ({info.module}){dist} {info.status}{error}")
    print(f"ops x platforms on this machine ({backend})")
    platforms = registry.platforms()
    width = max((len(op) for op in registry.ops()), default=10)
    print("  " + "op".ljust(width) + "  " + "  ".join(p.ljust(8) for p in platforms))
    for op in registry.ops():
        cells = []
        for p in platforms:
            impls = [i for i in registry.implementations(op) if i.platform == p]
            if not impls:
                cells.append("-")
            elif not any(i.runs_on(backend) for i in impls):
                cells.append("other-hw")
            else:
                ok = registry.platform(p).check(backend)
                cells.append("yes" if ok is True else "unavail")
        print("  " + op.ljust(width) + "  " + "  ".join(c.ljust(8) for c in cells))
    for p in platforms:
        ok = registry.platform(p).check(backend)
        if ok is not True:
            print(f"  {p} unavailable: {ok}")
    print(f"cache {_env.cache_dir()}")
    print(f"autotune policy {_env.autotune_policy()}")
    _print_shipped()
    return 0


def _print_shipped() -> None:
    from ejkernel import _env
    from ejkernel._shipped import shipped_tables

    tables = shipped_tables()
    off = "" if _env.shipped() else f" (off: {_env.SHIPPED}=0)"
    print(f"shipped tables{off}")
    if not tables:
        print("  (none)")
    for t in tables:
        print(f"  {t.name}: {len(t)} entries ({', '.join(t.device_kinds) or 'no device'})")


def _cache(args: argparse.Namespace) -> int:
    from ejkernel._cache import PersistentCache

    cache = PersistentCache(args.dir) if args.dir else PersistentCache()
    if args.action == "path":
        print(cache.directory)
    elif args.action == "list":
        entries = cache.entries()
        for key, raw in sorted(
            entries.items(), key=lambda kv: json.dumps(kv[1].get("key", {}), sort_keys=True)
        ):
            doc = raw.get("key", {})
            inv = doc.get("invocation", {}).get("kwargs", {})
            shapes = " ".join(
                f"{n}={tuple(v['shape'])}"
                for n, v in inv.items()
                if isinstance(v, dict) and "shape" in v
            )
            grad = " grad" if doc.get("grad") else ""
            print(
                f"{key[:12]}  {doc.get('op', '?')}/{doc.get('platform', '?')}{grad}  {raw.get('source')}  {shapes}  {json.dumps(raw.get('config'), sort_keys=True)}"
            )
        print(f"{len(entries)} entries in {cache.file}")
    elif args.action == "clear":
        print(f"removed {cache.delete()} entries from {cache.file}")
    elif args.action == "ship":
        return _ship(args, cache)
    elif args.action == "export":
        print(f"exported {cache.export(args.file)} entries to {args.file}")
    elif args.action == "import":
        try:
            n = cache.import_(args.file)
        except ValueError as err:
            print(f"ejkernel: {err}", file=sys.stderr)
            return 1
        print(f"imported {n} entries into {cache.file}")
    return 0


def _tune(args: argparse.Namespace) -> int:
    from ejkernel._batch_tune import autotune_recorded
    from ejkernel._records import loads

    try:
        with open(args.shapes) as fh:
            records = loads(fh.read())
    except (OSError, ValueError) as err:
        print(f"ejkernel: cannot read records from {args.shapes}: {err}", file=sys.stderr)
        return 1
    try:
        result = autotune_recorded(
            records,
            platforms=args.platforms,
            grad=True if args.grad else None,
            max_workers=args.max_workers,
            apply=False,
        )
    except ValueError as err:
        print(f"ejkernel: {err}", file=sys.stderr)
        return 1
    for failure in result.failures:
        print(f"  failed: {failure}", file=sys.stderr)
    n = result.export(args.out)
    print(
        f"tuned {len(result)} configs and {len(result.platforms)} platform choices of "
        f"{len(records)} records; wrote {n} entries to {args.out}"
    )
    return 0 if len(result) or len(result.platforms) or not records else 1


def _ship(args: argparse.Namespace, cache: object) -> int:
    from ejkernel._shipped import write_shipped_table

    platforms = args.platform.split(",") if args.platform else None
    try:
        table = write_shipped_table(
            args.sources or [cache], args.out, device=args.device, platforms=platforms
        )
    except ValueError as err:
        print(f"ejkernel: {err}", file=sys.stderr)
        return 1
    kinds = ", ".join(table.device_kinds) or "no device"
    print(f"wrote {len(table)} entries ({kinds}) to {args.out}")
    return 0


def _build(args: argparse.Namespace) -> int:
    from ejkernel import plugins

    registry = plugins.get_registry()
    platform = args.platform.lower()
    pm = plugins._state.pm
    hook = getattr(pm.hook, "ejkernel_build", None) if pm is not None else None
    try:
        report = (
            None
            if hook is None
            else hook(platform=platform, force=args.force, check=args.check, target=args.target)
        )
    except Exception as err:
        print(f"ejkernel: build of {platform} failed: {err}", file=sys.stderr)
        return 1
    if report is None:
        if platform in registry.platforms():
            print(f"{platform}: nothing to build (its kernels need no ahead-of-time step)")
            return 0
        print(
            f"ejkernel: no installed plugin provides platform {platform!r} "
            f"(known: {', '.join(registry.platforms()) or 'none'})",
            file=sys.stderr,
        )
        return 1
    print(report)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status."""
    parser = argparse.ArgumentParser(prog="ejkernel", description="ejkernel: kernels for JAX")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "info", help="versions, devices, plugins and the op x platform matrix"
    ).set_defaults(run=_info)
    cache = sub.add_parser("cache", help="the persistent config cache")
    cache.add_argument(
        "--dir", help="cache folder (default: EJKERNEL_CACHE_DIR or ~/.cache/ejkernel)"
    )
    actions = cache.add_subparsers(dest="action", required=True)
    actions.add_parser("path", help="print the cache folder")
    actions.add_parser("list", help="list cached configs")
    actions.add_parser("clear", help="remove every cached config")
    actions.add_parser("export", help="write every entry to FILE").add_argument("file")
    actions.add_parser("import", help="merge the entries of FILE").add_argument("file")
    ship = actions.add_parser(
        "ship", help="write a shipped table from exports (default: this cache) to --out FILE"
    )
    ship.add_argument("sources", nargs="*", help="export files (ejkernel cache export)")
    ship.add_argument("--out", required=True, help="the table to write")
    ship.add_argument("--device", help="keep entries whose device kind contains this")
    ship.add_argument(
        "--platform", help="keep entries of these platforms (comma-separated; choice: fastest)"
    )
    cache.set_defaults(run=_cache)
    tune = sub.add_parser(
        "tune",
        help="tune recorded invocations on this device and write the configs "
        "(the cache's export format: `ejkernel cache import FILE` merges it)",
    )
    tune.add_argument(
        "--shapes", required=True, metavar="FILE", help="a file of recorded invocations"
    )
    tune.add_argument("--out", required=True, metavar="FILE", help="where to write the configs")
    tune.add_argument(
        "--platforms",
        help="'all' or p1,p2: tune each of these platforms and record the fastest "
        "(default: the platform each call selects)",
    )
    tune.add_argument(
        "--grad", action="store_true", help="tune forward+backward (default: as recorded)"
    )
    tune.add_argument(
        "--max-workers",
        type=int,
        metavar="N",
        help="candidates compiled at once (default min(8, CPUs))",
    )
    tune.set_defaults(run=_tune)
    build = sub.add_parser(
        "build", help="build a platform's native kernels ahead of time (e.g. `ejkernel build cuda`)"
    )
    build.add_argument("platform", help="the platform to build (cuda, ...)")
    build.add_argument("--force", action="store_true", help="rebuild even if a build is cached")
    build.add_argument("--check", action="store_true", help="report the build state only")
    build.add_argument(
        "--target", help="platform-specific target (cuda: compute capability, e.g. 90)"
    )
    build.set_defaults(run=_build)
    args = parser.parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
