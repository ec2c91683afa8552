"""What every `exitplan` command shares: a user error ends the command with one line, `error: <what, naming
the file>`, on stderr and exit code 2, never a traceback (`user_errors` wraps every command; `fail` for a
command's own checks), and `table` makes rich tables that fold a cell rather than cut it (80 columns).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

import typer

if TYPE_CHECKING:
    from rich.table import Table

    from exitplan.planner.traces import LengthMode

USER_ERRORS = {
    "yaml": "YAMLError",
    "json": "JSONDecodeError",
    "pydantic": "ValidationError",
    "exitplan.api": "SpecError",
    "exitplan.api.bundle": "BundleError",
    "exitplan.planner.errors": "PlannerError",
    "exitplan.planner.traces": "TraceError",
    "exitplan.planner.tuning.feedback": "WindowError",
    "exitplan.localrun.service_setup": "ServiceFileError",
    "exitplan.prepare.profile": "ProfileError",
    "exitplan.prepare.user_data": "DataError",
    "exitplan.prepare.onnx_graph": "GraphError",
}
"""Exceptions that mean the user's input is wrong (module -> class). An exception can only be one of
them when its module was imported, so they are looked up in sys.modules (nothing heavy is imported)."""


def one_line(text: object) -> str:
    return " ".join(str(text).split())


def fail(message: object, code: int = 2) -> NoReturn:
    """End the command: `error: <message>` as one line on stderr, exit `code` (2: the input is wrong)."""
    typer.echo(f"error: {one_line(message)}", err=True)
    raise typer.Exit(code)


def is_user_error(err: BaseException) -> bool:
    if isinstance(err, (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)):
        return True
    for module, name in USER_ERRORS.items():
        cls = getattr(sys.modules.get(module), name, None)
        if isinstance(cls, type) and isinstance(err, cls):
            return True
    return False


def describe(err: BaseException) -> str:
    """A user error in one line that names the file where the error knows it."""
    from exitplan.api import validation_problems, yaml_problem

    if isinstance(err, OSError) and err.filename:
        return f"{err.filename}: {err.strerror or err}"
    yaml_error = sys.modules["yaml"].YAMLError if "yaml" in sys.modules else ()
    if isinstance(err, yaml_error):
        mark = getattr(err, "problem_mark", None)
        source = f"{mark.name}: " if mark is not None and not str(mark.name).startswith("<") else ""
        return f"{source}not valid YAML: {yaml_problem(err)}"
    pydantic = sys.modules.get("pydantic")
    if pydantic is not None and isinstance(err, pydantic.ValidationError):
        return f"invalid {err.title}: {validation_problems(err)}"
    return one_line(err)


def user_errors(command: Callable[..., Any]) -> Callable[..., Any]:
    """`command` with its user errors turned into one `error: ...` line and exit code 2."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except Exception as err:  # only user errors are caught; the rest is raised again
            if not is_user_error(err):
                raise
            fail(describe(err))

    return run


def table(*columns: str, title: str | None = None, right: bool = True) -> Table:
    """A rich Table for a terminal of 80 columns: no vertical rules, and a cell or header that does not
    fit folds onto a second line instead of ending in '…'. `right`: numbers' alignment (the first
    column stays left)."""
    from rich import box
    from rich.table import Table

    out = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for i, name in enumerate(columns):  # the first column names the rows: never folded
        out.add_column(name, justify="right" if right and i else "left", overflow="fold", no_wrap=not i)
    return out


def positive_ints(text: str | None, option: str) -> list[int] | None:
    """A comma-separated option of positive integers (None when empty); anything else is a one-line error."""
    if text is None or not text.strip():
        return None
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as err:
        raise typer.BadParameter(f"{option} takes comma-separated integers, got {text!r}") from err
    if not values or min(values) < 1:
        raise typer.BadParameter(f"{option} takes positive integers, got {text!r}")
    return values


def length_mode(value: str) -> LengthMode:
    """--length-mode: how a trace's lengths are fitted to the model (scale or clip); else a one-line error."""
    if value == "scale":
        return "scale"
    if value == "clip":
        return "clip"
    raise typer.BadParameter(f"--length-mode takes scale or clip, not {value!r}")
