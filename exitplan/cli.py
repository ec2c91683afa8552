"""The `exitplan` command line: one entry point, one module per command (`exitplan/cmd_*.py`).

Command modules import their heavy dependencies inside the command body, so `--help` stays fast.

What every command shares lives here too: a user error (a file missing or not valid YAML, a document
or bundle that does not validate, a trace or window that cannot be read) ends the command with one
line, `error: <what, naming the file>`, on stderr and exit code 2, never a traceback (`user_errors`
wraps every command; `fail` for a command's own checks); help is plain text wrapped to the terminal
(at most 80 columns, option names never cut), and `table` makes rich tables that fold a cell rather
than cut it.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, NoReturn

import typer

from exitplan import __version__

app = typer.Typer(
    name="exitplan",
    help="Plan, serve and operate early-exit models (E3, Apparate, Arlo, EE-LLM, DensePipe).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

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
    "exitplan.prepare.graph_cuts": "GraphError",
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


def table(*columns: str, title: str | None = None, right: bool = True) -> Any:
    """A rich Table for a terminal of 80 columns: no vertical rules, and a cell or header that does not
    fit folds onto a second line instead of ending in '…'. `right`: numbers' alignment (the first
    column stays left)."""
    from rich import box
    from rich.table import Table

    out = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for i, name in enumerate(columns):  # the first column names the rows: never folded
        out.add_column(name, justify="right" if right and i else "left", overflow="fold", no_wrap=not i)
    return out


def _version(value: bool) -> None:
    if value:
        typer.echo(__version__)
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """exitplan: early-exit inference that pays off."""


def _register() -> None:
    # One line per command; each module holds `command` (and sometimes more sub-commands).
    from exitplan import (
        cmd_bench,
        cmd_bundle,
        cmd_check,
        cmd_demo,
        cmd_dev_cluster,
        cmd_generate,
        cmd_operator,
        cmd_plan,
        cmd_prepare,
        cmd_profile,
        cmd_router,
        cmd_simulate,
        cmd_tune,
        cmd_up,
        cmd_version,
        cmd_worker,
    )

    app.command("version", help=cmd_version.command.__doc__)(cmd_version.command)
    app.command("worker")(cmd_worker.command)
    app.command("router")(cmd_router.command)
    app.command("up")(cmd_up.command)
    app.command("demo")(cmd_demo.command)
    app.command("bench")(cmd_bench.command)
    app.command("prepare")(cmd_prepare.command)
    app.command("profile")(cmd_profile.command)
    app.command("check")(cmd_check.command)
    app.command("tune")(cmd_tune.command)
    app.command("plan")(cmd_plan.command)
    app.command("simulate")(cmd_simulate.command)
    app.add_typer(cmd_operator.app, name="operator")
    app.command("dev-cluster")(cmd_dev_cluster.command)
    app.command("storage-init")(cmd_bundle.storage_init)
    app.add_typer(cmd_bundle.app, name="bundle")
    app.command("prepare-decoder")(cmd_generate.prepare_command)
    app.command("generate")(cmd_generate.command)
    app.command("generate-server")(cmd_generate.server_command)
    app.command("generate-stage")(cmd_generate.stage_command)
    app.command("generate-plan")(cmd_generate.plan_command)
    for typer_app in (app, cmd_operator.app):
        for info in typer_app.registered_commands:
            info.callback = user_errors(info.callback)
    if cmd_operator.app.registered_callback is not None:
        info = cmd_operator.app.registered_callback
        info.callback = user_errors(info.callback)


_register()
