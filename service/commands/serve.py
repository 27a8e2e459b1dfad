"""``orthornn serve``: its parser (one flag per setting, generated from ``Settings``) and
the command, thin over ``server.launch``. Torch-free; the server's modules are imported
only when the command runs."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported when a command runs (the serve extra may be missing)
    from pydantic import BaseModel

    from ..settings import Settings

#: settings with no flag: a secret must not appear in a process list or shell history
ENV_ONLY = {"admin_token": "ORTHORNN_ADMIN_TOKEN",
            "labels_token": "ORTHORNN_LABELS_TOKEN",
            "session_store_password": "ORTHORNN_SESSION_STORE_PASSWORD"}
#: settings with no flag and no variable of their own: derived from another (--repo, --capture)
DERIVED = {"repository_uri", "capture_uri"}


def _flag_type(annotation: Any) -> Any:
    """argparse's type (or "bool") for a Settings field's annotation."""
    import typing

    if annotation is bool:
        return "bool"
    if typing.get_origin(annotation) is typing.Literal:
        return str
    if annotation in (int, float):
        return annotation
    return str  # str, Path, comma-separated lists (the field's validator splits them)


def add_settings_flags(parser: argparse.ArgumentParser, settings_class: type[BaseModel]
                       ) -> None:
    """One flag per Settings field, generated from the field (name, type, choices,
    description, default): the settings are the one list. A flag left out keeps the
    ORTHORNN_* variable or the field's default."""
    import typing

    from pydantic_core import PydanticUndefined

    for name, field in settings_class.model_fields.items():
        if name in ENV_ONLY or name in DERIVED:
            continue
        flag = "--" + name.replace("_", "-")
        env = f"ORTHORNN_{name.upper()}"
        if field.default is PydanticUndefined and field.default_factory is None:
            default = "required"
        else:
            value = field.get_default(call_default_factory=True)
            default = ("none" if value in ([], None) else
                       str(value).lower() if isinstance(value, bool) else str(value))
        text = f"{field.description or name} (default: {default}; {env})"
        kind = _flag_type(field.annotation)
        if kind == "bool":
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction,
                                default=None, help=text)
            continue
        choices = typing.get_args(field.annotation) \
            if typing.get_origin(field.annotation) is typing.Literal else None
        parser.add_argument(flag, dest=name, type=kind, choices=choices, default=None,
                            help=text)


def add_serve_parser(sub: Any) -> None:
    serve = sub.add_parser(
        "serve", help="serve a model repository over HTTP (/predict, Open Inference Protocol)",
        description="orthornn serve --repo REPO [--host H --port P ...]. Every flag can also "
                    "be set as an ORTHORNN_* environment variable (ORTHORNN_MAX_BATCH_SIZE=16); "
                    "a flag beats the variable. The repository API token is only an "
                    "environment variable (ORTHORNN_ADMIN_TOKEN), so it never shows in a "
                    "process list.")
    try:
        from ..settings import Settings
    except ModuleNotFoundError as missing:  # no serve extra: `orthornn serve` says which
        serve.add_argument("ignored", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)

        def needs_extra(args: argparse.Namespace, missing: Exception = missing) -> int:
            raise missing
        serve.set_defaults(run=needs_extra)
    else:
        add_settings_flags(serve, Settings)
        serve.set_defaults(run=run_serve)


def settings_from_args(args: argparse.Namespace) -> Settings:
    from pydantic import ValidationError

    from ..settings import Settings

    values = {name: getattr(args, name) for name in Settings.model_fields
              if name not in ENV_ONLY and name not in DERIVED}
    try:
        return Settings(**{k: v for k, v in values.items() if v is not None})
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        hint = " (--repo or ORTHORNN_REPO)" if where == "repo" else ""
        raise ValueError(f"{where}{hint}: {first['msg']}") from None


def run_serve(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    from ..server.launch import serve

    return serve(settings)
