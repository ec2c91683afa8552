"""The `exitplan` command line: one entry point, one module per command (`exitplan/cmd_*.py`), registered
here; what every command shares (one-line user errors with exit code 2, tables) is in `cli_common.py`.

Command modules import their heavy dependencies inside the command body, so `--help` stays fast; help is
plain text wrapped to the terminal (at most 80 columns, option names never cut).
"""

from __future__ import annotations

import typer
from typer import _click as click  # the click typer runs on (it vendors its own)
from typer.core import TyperGroup

from exitplan import (
    __version__,
    cmd_apply,
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
from exitplan.cli_common import user_errors


class SummaryGroup(TyperGroup):
    """A command group whose `--help` lists each command's whole first sentence, wrapped under the
    others' at the terminal's width, rather than cut with "..." to fit one line."""

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = []
        for name in self.list_commands(ctx):
            cmd = self.get_command(ctx, name)
            if cmd is not None and not cmd.hidden:
                rows.append((name, cmd.get_short_help_str(limit=10_000)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


app = typer.Typer(
    cls=SummaryGroup,
    name="exitplan",
    help="Plan, serve and operate early-exit models (E3, Apparate, Arlo, EE-LLM, DensePipe).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
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
    app.command("apply")(cmd_apply.command)
    app.command("storage-init")(cmd_bundle.storage_init)
    app.add_typer(cmd_bundle.app, name="bundle")
    app.command("prepare-decoder")(cmd_generate.prepare_command)
    app.command("generate")(cmd_generate.command)
    app.command("generate-server")(cmd_generate.server_command)
    app.command("generate-stage")(cmd_generate.stage_command)
    app.command("generate-plan")(cmd_generate.plan_command)
    for typer_app in (app, cmd_operator.app):
        for info in typer_app.registered_commands:
            if info.callback is not None:
                info.callback = user_errors(info.callback)
    group = cmd_operator.app.registered_callback
    if group is not None and group.callback is not None:
        group.callback = user_errors(group.callback)


_register()
