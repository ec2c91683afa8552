"""The command line to a person at an 80-column terminal: a user error (a missing file, bad YAML, a
document or bundle that does not validate) is one `error: ...` line naming the file, exit code 2,
never a traceback; `--help` of every command fits 80 columns without cutting an option name; the
plan and simulation tables fit 80 columns without cutting a cell.

The commands run as a user runs them (the `exitplan` entry point in a subprocess), so a traceback
would show in what they print; the help of every command goes through click's own test runner.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import click
import pytest
import typer
from typer.testing import CliRunner

from exitplan.cli import app

ROOT = Path(__file__).resolve().parents[1]
SERVICE = ROOT / "bench" / "profiles" / "bert-e3-v100.yaml"
BAD_YAML = "apiVersion: exitplan.io/v1alpha1\nkind: EarlyExitService\nmetadata: {name: x\nspec: [\n"


def exitplan(*args: str, columns: int = 80) -> subprocess.CompletedProcess[str]:
    """`exitplan ARGS` as the console script runs it (typer's app in a fresh interpreter)."""
    code = "import sys; from exitplan.cli import app; sys.argv[0] = 'exitplan'; app()"
    env = {**os.environ, "COLUMNS": str(columns), "TERM": "dumb", "NO_COLOR": "1"}
    return subprocess.run([sys.executable, "-P", "-c", code, *args], capture_output=True, text=True, cwd=ROOT, env=env)


def _one_error_line(proc: subprocess.CompletedProcess[str], *words: str) -> str:
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


@pytest.fixture
def bad_yaml(tmp_path: Path) -> Path:
    path = tmp_path / "broken.yaml"
    path.write_text(BAD_YAML)
    return path


@pytest.mark.parametrize("command", ["plan", "simulate", "up"])
def test_a_service_file_that_is_not_yaml_is_one_line(command: str, bad_yaml: Path) -> None:
    line = _one_error_line(exitplan(command, str(bad_yaml)), str(bad_yaml), "not valid YAML", "line 4")
    assert len(line) > 80  # one line, even where the terminal would wrap it


@pytest.mark.parametrize("command", ["plan", "simulate", "up"])
def test_a_missing_or_invalid_service_file_is_one_line(command: str, tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    _one_error_line(exitplan(command, str(missing)), str(missing))
    invalid = tmp_path / "invalid.yaml"
    invalid.write_text(SERVICE.read_text().replace("latencyMs: 100.0", "latencyMs: -1"))
    _one_error_line(exitplan(command, str(invalid)), str(invalid), "slo.latencyMs")


def test_tune_with_a_window_that_is_not_one(bad_yaml: Path, tmp_path: Path) -> None:
    _one_error_line(exitplan("tune", str(bad_yaml)), str(bad_yaml), "npz")
    _one_error_line(exitplan("tune", str(tmp_path / "nope.npz")), str(tmp_path / "nope.npz"))


def test_profile_with_a_bundle_yaml_that_is_not_yaml(bad_yaml: Path, tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "bundle.yaml").write_text(bad_yaml.read_text())
    args = ("profile", str(bundle), "--pool", "cpu", "--out", str(tmp_path / "p.yaml"))
    _one_error_line(exitplan(*args), str(bundle / "bundle.yaml"), "not valid YAML")
    _one_error_line(exitplan("profile", str(tmp_path / "none"), "--pool", "cpu", "--out", "p.yaml"), "none")


def test_plan_with_thresholds_that_are_not_json(tmp_path: Path) -> None:
    thresholds = tmp_path / "t.json"
    thresholds.write_text("{ramp0: ")
    _one_error_line(exitplan("plan", str(SERVICE), "--thresholds", str(thresholds)), str(thresholds), "JSON")


def test_an_error_that_is_not_the_users_still_shows_its_traceback() -> None:
    """Only user errors become one line: a bug keeps its traceback (the wrapper re-raises it)."""
    from exitplan.cli_common import is_user_error, user_errors

    assert is_user_error(FileNotFoundError(2, "No such file", "x.yaml"))
    assert not is_user_error(KeyError("bug"))

    @user_errors
    def broken() -> None:
        raise KeyError("bug")

    with pytest.raises(KeyError):
        broken()


# ------------------------------------------------------------------ 80 columns


def _commands() -> list[tuple[str, ...]]:
    root = typer.main.get_command(app)
    out: list[tuple[str, ...]] = [()]

    def walk(group: click.Command, path: tuple[str, ...]) -> None:
        if hasattr(group, "list_commands"):  # a group (typer's own, or click's)
            ctx = click.Context(group, info_name="exitplan")
            for name in group.list_commands(ctx):
                sub = group.get_command(ctx, name)
                assert sub is not None
                out.append((*path, name))
                walk(sub, (*path, name))

    walk(root, ())
    return out


def _options(path: tuple[str, ...]) -> list[str]:
    cmd: click.Command = typer.main.get_command(app)
    for name in path:
        found = cmd.get_command(click.Context(cmd, info_name="exitplan"), name)
        assert found is not None
        cmd = found
    return [opt for p in cmd.params if not p.param_type_name == "argument" for opt in p.opts + p.secondary_opts]


def test_help_of_every_command_fits_80_columns_and_names_every_option() -> None:
    commands = _commands()
    assert ("plan",) in commands and ("operator", "publish-profile") in commands and len(commands) > 15
    runner = CliRunner()
    for path in commands:
        result = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "80"}, terminal_width=80)
        assert result.exit_code == 0, (path, result.output)
        text = result.output
        assert "…" not in text, (path, text)
        assert max(len(line) for line in text.splitlines()) <= 80, (path, text)
        for option in _options(path):
            assert option in text, (path, option, text)


def test_the_command_list_shows_each_commands_whole_summary_at_80_columns() -> None:
    result = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "80"}, terminal_width=80)
    assert result.exit_code == 0, result.output
    text = result.output
    commands = text[text.index("Commands:") :]
    assert not [line for line in commands.splitlines() if line.endswith("...") or "…" in line], commands  # none cut
    assert max(len(line) for line in text.splitlines()) <= 80, text
    flat = "".join(text.split())  # wrapped lines joined (a line may break after a hyphen)
    group: click.Group = typer.main.get_command(app)  # type: ignore[assignment]
    ctx = click.Context(group, info_name="exitplan")
    names = group.list_commands(ctx)
    assert len(names) > 20
    for name in names:
        cmd = group.get_command(ctx, name)
        assert cmd is not None
        sentence = cmd.get_short_help_str(limit=10_000)  # the first sentence, whole
        assert sentence.endswith(".") and "".join(sentence.split()) in flat, (name, sentence)


def test_help_in_a_real_80_column_terminal() -> None:
    proc = exitplan("router", "--help")
    assert proc.returncode == 0, proc.stderr
    assert "…" not in proc.stdout and max(len(line) for line in proc.stdout.splitlines()) <= 80
    for option in ("--control-token-file", "--accuracy-budget", "--keepalive-timeout-s", "--max-connections"):
        assert option in proc.stdout


@pytest.mark.parametrize(
    "args",
    [
        ("plan", "bench/profiles/bert-e3-hetero.yaml"),
        ("simulate", "bench/profiles/bert-e3-hetero.yaml", "--duration", "3"),
    ],
)
def test_tables_fit_80_columns_without_cutting_a_cell(args: tuple[str, ...], shared_trace: object) -> None:
    proc = exitplan(*args)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "…" not in proc.stdout, proc.stdout
    assert max(len(line) for line in lines) <= 80, proc.stdout
    words = {"replicas", "rebatch", "k80", "p100", "v100"} if args[0] == "plan" else {"naive-ee", "exitplan", "oracle"}
    tokens = {token for line in lines for token in line.split()}
    assert words <= tokens, (words - tokens, proc.stdout)
