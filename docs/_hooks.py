"""MkDocs hooks: the pages' generated parts, made from the installed ejkernel at build time.

- ``<!-- ejkernel:catalogue -->``: the op catalogue (signature tables from each op's spec, the
  public function's docstring) and the op x platform support matrix, read from the registry
  with every installed plugin loaded, never written by hand;
- ``<!-- ejkernel:env-table -->``: the environment variables, from ``ejkernel._env.VARIABLES``.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

CATALOGUE = "<!-- ejkernel:catalogue -->"
ENV_TABLE = "<!-- ejkernel:env-table -->"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if CATALOGUE in markdown:
        markdown = markdown.replace(CATALOGUE, catalogue())
    if ENV_TABLE in markdown:
        markdown = markdown.replace(ENV_TABLE, env_table())
    return markdown


def env_table() -> str:
    from ejkernel import _env

    rows = ["| variable | default | meaning |", "|---|---|---|"]
    rows += [f"| `{name}` | {d} | {m} |" for name, (d, m) in _env.VARIABLES.items()]
    return "\n".join(rows)


def _public_function(op: str) -> Any:
    try:
        return getattr(importlib.import_module(f"ejkernel.specs.{op}"), op)
    except (ImportError, AttributeError):
        return None


def _summary(op: str, spec: Any) -> str:
    fn = _public_function(op) or spec.reference
    doc = inspect.getdoc(fn) or ""
    return doc.split("\n\n")[0].replace("\n", " ")


def _arg_rows(spec: Any) -> list[str]:
    rows = ["| argument | kind | default | gradient |", "|---|---|---|---|"]
    for a in spec.args:
        kind = "array" if a.array else "static"
        default = "required" if a.required else f"`{a.default!r}`"
        rows.append(f"| `{a.name}` | {kind} | {default} | {'yes' if a.differentiable else ''} |")
    return rows


def catalogue() -> str:
    from ejkernel.plugins import get_registry, plugin_infos
    from ejkernel.specs import builtin_ops

    registry = get_registry()
    ops, platforms = registry.ops(), registry.platforms()
    builtin = set(builtin_ops())
    out = [
        "## Support matrix",
        "",
        "Backends each platform's implementation serves (`any`: every JAX backend). Generated "
        "from the registry with these plugins installed: "
        + ", ".join(
            f"`{p.name}` ({p.distribution or p.module}, {p.status})" for p in plugin_infos()
        )
        + ". Availability on a given machine: `ejkernel info`.",
        "",
        "| op | " + " | ".join(f"`{p}`" for p in platforms) + " |",
        "|---|" + "---|" * len(platforms),
    ]
    for op in ops:
        cells = []
        for p in platforms:
            impls = [i for i in registry.implementations(op) if i.platform == p]
            cells.append(", ".join("/".join(i.backends) for i in impls) or "—")
        out.append(f"| [`{op}`](#{op}) | " + " | ".join(cells) + " |")
    out += ["", "## Ops", ""]
    for op in ops:
        spec = registry.spec(op)
        impls = registry.implementations(op)
        out += [f"### `{op}` {{#{op}}}", "", _summary(op, spec), ""]
        grad = "forward and backward" if spec.differentiable else "forward only"
        where = ", ".join(
            f"`{i.platform}` ({'/'.join(i.backends)}, priority {i.priority})" for i in impls
        )
        out += [f"{grad.capitalize()}. Implementations: {where or 'none installed'}.", ""]
        if op not in builtin:
            out += [f"Added by a plugin (`{impls[0].plugin if impls else '?'}`).", ""]
        out += [*_arg_rows(spec), ""]
        if op in builtin:
            out += [
                f"::: ejkernel.specs.{op}.{op}",
                "    options:",
                "      show_root_heading: false",
                "      heading_level: 4",
                "",
            ]
    return "\n".join(out)
