"""docs/options.md, the option reference, rendered from the option models of :mod:`ds_lioncub.config`.

Every option's type, default and bounds come from its field, and its meaning from the docstring under it,
so the reference cannot drift from what :func:`~ds_lioncub.config.parse_config` accepts:
tests/unit/test_docs.py fails when the committed file differs from what this renders.

    python -m ds_lioncub.config.reference --write docs/options.md   # after changing an option
    python -m ds_lioncub.config.reference --check docs/options.md   # exit 1 when the file is stale
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import sys
import types
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel, BeforeValidator
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from ds_lioncub.config.options import LionCubConfig
from ds_lioncub.config.strict_types import duration, only_booleans, rate

COMMAND = "python -m ds_lioncub.config.reference --write docs/options.md"

_HEADER = f"""# Option reference

<!-- Generated from the field docstrings of ds_lioncub/config/ by `{COMMAND}`.
     Do not edit by hand: tests/unit/test_docs.py fails when this file is stale. -->

A block is a nested object, e.g. `"momentum_sync": {{"interval": 10}}`; "unset" is an option left out
(or `null` / `None`). How to use the options: [the user guide](user-guide.md).
"""


def _text(doc: str) -> str:
    """A docstring as Markdown: dedented, Sphinx roles as code (``:mod:`x``` -> ```x```)."""
    return re.sub(r":\w+:`~?([^`]+)`", r"`\1`", inspect.cleandoc(doc)).strip()


def _without_none(annotation: Any) -> tuple[Any, bool]:
    """The annotation without ``| None``, and whether None was allowed."""
    if get_origin(annotation) in (Union, types.UnionType):
        args = [arg for arg in get_args(annotation) if arg is not type(None)]
        if len(args) < len(get_args(annotation)):
            return (args[0] if len(args) == 1 else Union[tuple(args)]), True  # noqa: UP007
    return annotation, False


def _validators(annotation: Any, metadata: list[Any]) -> list[Any]:
    found = [item.func for item in metadata if isinstance(item, BeforeValidator)]
    if get_origin(annotation) is Annotated:
        found += [item.func for item in annotation.__metadata__ if isinstance(item, BeforeValidator)]
    return found


def _type_name(annotation: Any, metadata: list[Any]) -> str:
    """What a user writes for this annotation, in words."""
    validators = _validators(annotation, metadata)
    if get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    annotation, _ = _without_none(annotation)
    if get_origin(annotation) is Literal:
        return " / ".join(f"`{json.dumps(value)}`" for value in get_args(annotation))
    if get_origin(annotation) in (Union, types.UnionType):
        return ", or ".join(_type_name(arg, []) for arg in get_args(annotation))
    if get_origin(annotation) is list:
        return f"list of {_type_name(get_args(annotation)[0], [])}s"
    if get_origin(annotation) is tuple:
        names = [_type_name(arg, []) for arg in get_args(annotation)]
        if len(set(names)) == 1:
            return f"{['', 'one', 'two', 'three'][len(names)]} {names[0]}s"
        return "[" + ", ".join(names) + "]"
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return "block"
    if rate in validators:
        return "rate"
    if duration in validators:
        return "duration"
    if annotation is bool or only_booleans in validators:
        return "`true` / `false`"
    return {int: "integer", float: "real", str: "string"}[annotation]


_BOUNDS = (
    (annotated_types.Ge, "ge", ">="),
    (annotated_types.Gt, "gt", ">"),
    (annotated_types.Le, "le", "<="),
    (annotated_types.Lt, "lt", "<"),
)


def _bounds(metadata: list[Any]) -> str:
    shown = [
        f"{sign} {getattr(item, name):g}" for item in metadata for kind, name, sign in _BOUNDS if isinstance(item, kind)
    ]
    return " and ".join(shown)


def field_type(field: FieldInfo) -> str:
    """The field's type in words with its bounds, e.g. ``real >= 0`` or ``integer >= 1024``."""
    annotation, _ = _without_none(field.annotation)
    text = _type_name(annotation, field.metadata)
    bounds = _bounds(field.metadata)
    return f"{text} {bounds}" if bounds else text


def field_default(field: FieldInfo) -> str:
    """The default as JSON (``unset`` for None, ``required`` for none)."""
    default = field.default
    if default is PydanticUndefined:
        return "required"
    if default is None:
        return "unset"
    if isinstance(default, BaseModel):
        default = default.model_dump()
    return f"`{json.dumps(default)}`"


def _block(annotation: Any) -> type[BaseModel] | None:
    annotation, _ = _without_none(annotation)
    return annotation if inspect.isclass(annotation) and issubclass(annotation, BaseModel) else None


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation other than - and _ dropped, spaces as -."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def _render_model(model: type[BaseModel], prefix: str, level: int, out: list[str]) -> None:
    rows = ["| option | type | default |", "|---|---|---|"]
    for name, field in model.model_fields.items():
        title = f"{prefix}{name}"
        rows.append(f"| [`{title}`](#{_anchor(title)}) | {field_type(field)} | {field_default(field)} |")
    out += [*rows, ""]
    for name, field in model.model_fields.items():
        title = f"{prefix}{name}"
        default = field_default(field)
        shown = "required" if default == "required" else f"default {default}"
        out += [f"{'#' * level} `{title}`", "", f"{field_type(field)}; {shown}.", ""]
        out += [_text(field.description or ""), ""]
        block = _block(field.annotation)
        if block is not None:
            out += [_text(block.__doc__ or ""), ""]
            _render_model(block, f"{title}.", level + 1, out)


def render() -> str:
    """The whole of docs/options.md."""
    out = [_HEADER, _text(LionCubConfig.__doc__ or ""), ""]
    _render_model(LionCubConfig, "", 2, out)
    return "\n".join(out).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ds_lioncub.config.reference", description=__doc__.splitlines()[0])
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", metavar="PATH", type=Path, help="write the reference to PATH")
    action.add_argument("--check", metavar="PATH", type=Path, help="exit 1 when PATH differs from the reference")
    args = parser.parse_args(argv)
    text = render()
    if args.write is not None:
        args.write.write_text(text)
    elif args.check is not None:
        if not args.check.is_file() or args.check.read_text() != text:
            print(f"{args.check} is stale; run: {COMMAND}", file=sys.stderr)
            return 1
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
