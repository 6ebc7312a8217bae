"""The ``sakura`` command: what is installed and what can be hooked.

    sakura plugins       installed plugins, versions, what each provides, load failures
    sakura services      services by spec name, with the providing distribution
    sakura dispatchers   dispatchers by spec name
    sakura adapters      adapters by spec name
    sakura hooks         every hook with its signature and first docstring line
    sakura telemetry F   summary of a telemetry JSON-lines file

Every listing takes ``--json`` for machine-readable output.  ``sakura plugins`` exits with
status 1 when a plugin failed to load or a plugin filter names nothing installed; each
failure is printed once, on stderr.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sakura.plugins import PluginManager

__all__ = ["main"]


def _table(rows: list[list[str]], headers: list[str]) -> str:
    if not rows:
        return "(none)"
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += [
        "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    ]
    return "\n".join(lines)


def hook_signatures() -> list[dict[str, str]]:
    """Every hookspec: kind, name, signature (as documented), first docstring line."""
    from sakura import hookspecs

    out: list[dict[str, str]] = []
    for name, fn in vars(hookspecs.ServiceHooks).items():
        if callable(fn) and hasattr(fn, "sakura_spec"):
            kind = "event" if name.startswith("on_") else "service"
            out.append(
                {
                    "kind": kind,
                    "name": name,
                    "signature": format_signature(fn),
                    "doc": _first_line(fn),
                }
            )
    for name, fn in vars(hookspecs).items():
        if name.startswith("sakura_") and callable(fn) and hasattr(fn, "sakura_spec"):
            out.append(
                {
                    "kind": "plugin",
                    "name": name,
                    "signature": format_signature(fn),
                    "doc": _first_line(fn),
                }
            )
    return out


def format_signature(fn: Any) -> str:
    """``name(arg: Type, ...) -> Ret`` as written in the source (``self`` dropped)."""
    sig = inspect.signature(fn)
    params = []
    for param in sig.parameters.values():
        if param.name == "self":
            continue
        annotation = param.annotation
        text = param.name
        if annotation is not inspect.Parameter.empty:
            text += f": {annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)}"
        params.append(text)
    ret = sig.return_annotation
    if ret is inspect.Signature.empty:
        return f"{fn.__name__}({', '.join(params)})"
    ret_text = ret if isinstance(ret, str) else inspect.formatannotation(ret)
    return f"{fn.__name__}({', '.join(params)}) -> {ret_text}"


def _first_line(fn: Any) -> str:
    doc = inspect.getdoc(fn) or ""
    return doc.split("\n\n")[0].replace("\n", " ")


def _loaded_manager() -> PluginManager:
    """The shared plugin manager with every registry collected.  Load failures are printed
    by the commands themselves (once each), so their warnings are silenced here."""
    from sakura.plugins import PluginLoadWarning, get_plugin_manager

    manager = get_plugin_manager()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PluginLoadWarning)
        manager.plugins()
    return manager


def _report_problems(manager: PluginManager) -> None:
    for failure in manager.failures:
        print(f"FAILED  {failure}", file=sys.stderr)
    for problem in manager.problems:
        print(f"WARNING  {problem}", file=sys.stderr)


def _cmd_plugins(args: argparse.Namespace) -> int:
    manager = _loaded_manager()
    plugins = manager.plugins()
    status = 1 if manager.failures or manager.problems else 0
    if args.json:
        print(
            json.dumps(
                {
                    "plugins": [
                        {
                            "name": p.name,
                            "distribution": p.distribution,
                            "version": p.version,
                            "module": p.module,
                            "provides": p.provides,
                        }
                        for p in plugins
                    ],
                    "disabled": [
                        {
                            "name": s.name,
                            "distribution": s.distribution,
                            "version": s.version,
                            "reason": s.reason,
                            "explanation": s.explain(),
                        }
                        for s in manager.skipped
                    ],
                    "failures": [
                        {"name": f.name, "distribution": f.distribution, "error": repr(f.error)}
                        for f in manager.failures
                    ],
                    "problems": list(manager.problems),
                },
                indent=2,
            )
        )
        return status
    rows = [
        [
            p.name,
            p.distribution or "-",
            p.version or "-",
            "; ".join(f"{k}s: {', '.join(v)}" for k, v in sorted(p.provides.items())) or "-",
        ]
        for p in plugins
    ]
    rows += [
        [s.name, s.distribution or "-", s.version or "-", f"disabled: {s.explain()}"]
        for s in manager.skipped
    ]
    print(_table(rows, ["plugin", "distribution", "version", "provides"]))
    _report_problems(manager)
    return status


def _cmd_registry(kind: str, args: argparse.Namespace) -> int:
    manager = _loaded_manager()
    entries = manager.registry(kind)
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "name": p.name,
                        "class": p.export_name,
                        "distribution": p.distribution,
                        "plugin": p.plugin,
                        "description": p.description,
                    }
                    for p in entries.values()
                ],
                indent=2,
            )
        )
    else:
        rows = [
            [p.name, p.export_name or "-", p.distribution or p.plugin, p.description]
            for p in sorted(entries.values(), key=lambda p: p.name)
        ]
        print(_table(rows, [kind, "class", "provided by", "description"]))
    _report_problems(manager)
    return 0


def package_hook_signatures(manager: PluginManager) -> list[dict[str, str]]:
    """The plugin hooks that installed packages declare themselves (``sakura_add_hookspecs``,
    e.g. sakura-bench's ``sakura_register_workloads``), with where each is declared."""
    from sakura import hookspecs

    out: list[dict[str, str]] = []
    for name in sorted(dir(manager.pm.hook)):
        spec = getattr(getattr(manager.pm.hook, name), "spec", None)
        if spec is None or spec.namespace is hookspecs:
            continue
        namespace = spec.namespace
        declared_in = (
            namespace.__name__ if isinstance(namespace, ModuleType) else namespace.__module__
        )
        out.append(
            {
                "kind": "plugin",
                "name": name,
                "signature": format_signature(spec.function),
                "doc": _first_line(spec.function),
                "declared_in": declared_in,
            }
        )
    return out


def _cmd_hooks(args: argparse.Namespace) -> int:
    manager = _loaded_manager()
    hooks = hook_signatures()
    declared = package_hook_signatures(manager)
    if args.json:
        print(json.dumps(hooks + declared, indent=2))
        return 0
    for kind, title in (
        ("service", "Service hooks"),
        ("event", "Event hooks"),
        ("plugin", "Plugin hooks"),
    ):
        print(f"{title}:")
        for hook in hooks:
            if hook["kind"] == kind:
                print(f"  {hook['signature']}")
                print(f"      {hook['doc']}")
        print()
    if declared:
        print("Plugin hooks declared by installed packages:")
        for hook in declared:
            print(f"  {hook['signature']}    [{hook['declared_in']}]")
            print(f"      {hook['doc']}")
        print()
    _report_problems(manager)
    return 0


def _cmd_telemetry(args: argparse.Namespace) -> int:
    from sakura.telemetry import summarize

    try:
        summary = summarize(args.path)
    except (OSError, ValueError) as exc:
        print(f"sakura telemetry: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sakura", description="Inspect sakura plugins, services and hooks."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (
        ("plugins", "installed plugins and what each provides"),
        ("services", "services available by spec name"),
        ("dispatchers", "dispatchers available by spec name"),
        ("adapters", "framework adapters available by spec name"),
        ("hooks", "every hook with its signature"),
    ):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("--json", action="store_true", help="machine-readable output")
    telemetry = sub.add_parser("telemetry", help="summarise a telemetry JSON-lines file")
    telemetry.add_argument("path")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from sakura.errors import ConfigError

    try:
        return _main(argv)
    except BrokenPipeError:  # `sakura hooks | head`: the reader left; not an error
        sys.stderr.close()
        return 0
    except ConfigError as exc:  # a bad SAKURA_* variable: the message says what is accepted
        print(f"sakura: {exc}", file=sys.stderr)
        return 2


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "plugins":
        return _cmd_plugins(args)
    if args.command in ("services", "dispatchers", "adapters"):
        return _cmd_registry(args.command[:-1], args)
    if args.command == "hooks":
        return _cmd_hooks(args)
    return _cmd_telemetry(args)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
