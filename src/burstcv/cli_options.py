"""Turn the run parameters into command-line options, as the trigger form turns them into fields.

Help, type and bounds come from ``run_fields`` and a value is checked against the form's own
JSON schema, so the two cannot disagree. A command receives only the values given on the
command line; ``RunParams`` fills in the rest, so each default stays written once.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Annotated, Any, TypeVar

import typer
from jsonschema.validators import validator_for

from burstcv.params import RunField, describe_default, describe_values, run_fields
from burstcv.settings import get_settings

F = TypeVar("F", bound=Callable[..., Any])

GIVEN = "given"  # the parameter of a command that receives the run options it was given
_CONTEXT = "_run_options_context"  # the Typer context the wrapper asks where values came from
EMPTY_WORDS = ("none", "off", "")  # what leaves a field that may be empty (JSON null) empty
AUTO_WORDS = ("auto", "")  # what leaves a field whose empty means auto on auto


# An option's Python type by JSON type (a list is given as comma-separated text).
_PYTHON_TYPES: dict[str, type] = {
    "string": str,
    "integer": int,
    "number": float,
    "boolean": bool,
    "array": str,
}


def value_parser(spec: RunField) -> Callable[[Any], Any]:
    """Return the parser of a field's option: text to a value the field's schema accepts.

    Lists are comma-separated; a field that may be empty takes ``none`` (``auto``, if auto).
    """
    kind = spec.value_type

    def parse(raw: Any) -> Any:
        value = raw
        if isinstance(raw, str):
            text = raw.strip()
            try:
                empty_words = AUTO_WORDS if spec.auto else EMPTY_WORDS
                if spec.nullable and text.lower() in empty_words:
                    value = None
                elif kind == "array":
                    value = [item.strip() for item in text.split(",") if item.strip()]
                else:  # a boolean option has no parser
                    value = _PYTHON_TYPES[kind](text)
            except ValueError:
                raise typer.BadParameter(f"{raw!r} is not {describe_values(spec)}") from None
        # The deployment's bounds are read when the command runs, as the form's when it is built.
        schema = spec.deployment_schema(get_settings()) if spec.maximum_from else spec.schema
        error = next(iter(validator_for(schema)(schema).iter_errors(value)), None)
        if error is not None:
            raise typer.BadParameter(f"{error.message} (allowed: {describe_values(spec)})")
        return value

    return parse


def option_parameter(spec: RunField) -> inspect.Parameter:
    """Return the keyword parameter that Typer turns into the field's option."""
    flag = "--" + spec.name.replace("_", "-")
    kind = spec.value_type
    declared = f"{flag}/--no-{flag[2:]}" if kind == "boolean" else flag
    help_text = spec.description
    if kind != "boolean":  # in parentheses: Typer's help reads [brackets] as markup
        allowed = describe_values(spec).replace("; or empty (auto)", "; or 'auto'")
        allowed = allowed.replace("; or empty", "; or 'none' to leave it empty")
        help_text += f" ({allowed}" + (", comma-separated)" if kind == "array" else ")")
    option = typer.Option(
        declared,
        help=help_text,
        parser=None if kind == "boolean" else value_parser(spec),
        # A deployment's default is named, not read: the settings are read when it runs.
        show_default=describe_default(spec).strip("`") if spec.default_from or spec.auto else True,
    )
    python_type: Any = _PYTHON_TYPES[kind]
    if spec.default is None:
        python_type = python_type | None
    default = ",".join(spec.default) if isinstance(spec.default, list) else spec.default
    return inspect.Parameter(
        spec.name,
        inspect.Parameter.KEYWORD_ONLY,
        default=default,
        annotation=Annotated[python_type, option],
    )


def run_options(names: Iterable[str]) -> Callable[[F], F]:
    """Add an option per named run parameter to a command, handing it those given as ``given``.

    The command declares a keyword-only ``given: dict[str, Any]``, ready for ``RunParams.resolve``.
    """
    specs = run_fields()
    chosen = [specs[name] for name in names]

    def decorate(command: F) -> F:
        signature = inspect.signature(command, eval_str=True)
        own = [p for p in signature.parameters.values() if p.name != GIVEN]
        if len(own) == len(signature.parameters):
            raise TypeError(f"{command.__name__} needs a {GIVEN!r} parameter for run options")
        context = inspect.Parameter(
            _CONTEXT, inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context
        )
        parameters = [*own, context, *(option_parameter(spec) for spec in chosen)]

        @functools.wraps(command)
        def wrapper(**values: Any) -> Any:
            ctx: typer.Context = values.pop(_CONTEXT)
            given: dict[str, Any] = {}
            for spec in chosen:
                value = values.pop(spec.name)
                source = ctx.get_parameter_source(spec.name)
                if source is not None and source.name != "DEFAULT":
                    given[spec.name] = value
            return command(**values, **{GIVEN: given})

        wrapper.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
        wrapper.__annotations__ = {p.name: p.annotation for p in parameters}
        return wrapper  # type: ignore[return-value]

    return decorate
