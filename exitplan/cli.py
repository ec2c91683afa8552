"""The `exitplan` command line: one entry point, one module per command (`exitplan/cmd_*.py`).

Command modules import their heavy dependencies inside the command body, so `--help` stays fast.
"""

from __future__ import annotations

import typer

from exitplan import __version__

app = typer.Typer(
    name="exitplan",
    help="Plan, serve and operate early-exit models (E3, Apparate, Arlo, EE-LLM, DensePipe).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


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
    app.command("prepare-decoder")(cmd_generate.prepare_command)
    app.command("generate")(cmd_generate.command)
    app.command("generate-server")(cmd_generate.server_command)
    app.command("generate-stage")(cmd_generate.stage_command)
    app.command("generate-plan")(cmd_generate.plan_command)


_register()
