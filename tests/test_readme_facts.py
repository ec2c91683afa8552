"""Figures and names the README states that the code decides: they must say what the code does (issue
30: the README said the re-tuning ran every 20 s where `--tune-seconds` defaults to 2, and the dev-cluster
section listed old columns)."""

from __future__ import annotations

import re
from pathlib import Path

import typer
import yaml
from typer import _click as click

from exitplan.cli import app

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def option_default(command: str, option: str) -> object:
    group = typer.main.get_command(app)
    cmd = group.get_command(click.Context(group, info_name="exitplan"), command)  # type: ignore[attr-defined]
    assert cmd is not None
    (param,) = [p for p in cmd.params if option in p.opts]
    return param.default


def test_the_retuning_period_the_readme_states_is_the_default():
    stated = re.findall(r"re-tunes the exit\s+thresholds every ([\d.]+) s \(`--tune-seconds`\)", README)
    assert stated, "the README no longer states the re-tuning period of exitplan up"
    assert {float(s) for s in stated} == {float(option_default("up", "--tune-seconds"))}


def test_the_dev_cluster_section_lists_the_columns_kubectl_shows():
    crd = yaml.safe_load((ROOT / "crds" / "earlyexitservices.yaml").read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v.get("served")]
    shown = [c["name"].upper() for c in version["additionalPrinterColumns"] if not c.get("priority")]
    wide = [c["name"].upper() for c in version["additionalPrinterColumns"] if c.get("priority")]
    listed = re.search(r"`kubectl get ees` shows (NAME, [^`]*?) \(`-o wide` adds\s+(.*?)[;)]", README, re.S)
    assert listed, "the dev-cluster section no longer lists kubectl's columns"
    names = [n.strip() for n in re.split(r",| and ", listed.group(1).replace("\n", " ")) if n.strip()]
    assert names == ["NAME", *shown]
    added = [n.strip() for n in re.split(r",| and ", listed.group(2).replace("\n", " ")) if n.strip()]
    assert added == wide
