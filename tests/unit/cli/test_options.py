"""The options `plan` and `deploy` share are declared once (`ServingOptions`) and reach each
command as one typed object, with the flags, help and defaults Typer shows for each."""

from __future__ import annotations

import dataclasses
import re

import pytest
import typer
from typer.testing import CliRunner

from llmopt.cli.main import app
from llmopt.cli.options import ServingOptions, with_serving_options

SHARED = [
    "--gpu",
    "--gpus",
    "--cpu",
    "--threads",
    "--params",
    "--input-len",
    "--output-len",
    "--concurrency",
    "--rate",
    "--ttft-ms",
    "--tpot-ms",
    "--max-model-len",
    "--precision",
    "--kv-dtype",
    "--gpu-memory-utilization",
    "--tp",
]


def _flags(command: str) -> list[str]:
    r = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200"}, color=False)
    assert r.exit_code == 0, r.output
    return re.findall(r"^│ [ *]*(--[a-z0-9-]+)", r.output, flags=re.M)


def test_plan_and_deploy_show_the_shared_options_in_one_order():
    plan, deploy = _flags("plan"), _flags("deploy")
    assert [f for f in plan if f in SHARED] == SHARED
    assert [f for f in deploy if f in SHARED] == SHARED
    assert plan[: len(SHARED) + 1] == ["--target", *SHARED]
    assert set(plan) - set(SHARED) == {
        "--target",
        "--pp",
        "--static-shapes",
        "--check",
        "--json",
        "--help",
    }
    assert set(deploy) - set(SHARED) == {
        "--out",
        "--target",
        "--image",
        "--no-validate",
        "--json",
        "--help",
    }


def test_a_decorated_command_gets_one_typed_object():
    got = {}
    demo = typer.Typer()

    @demo.command()
    @with_serving_options
    def show(name: str, serving: ServingOptions, last: bool = False) -> None:
        got.update(name=name, serving=serving, last=last)

    args = ["x", "--gpu", "H100", "--gpus", "2", "--input-len", "64", "--rate", "1.5", "--last"]
    r = CliRunner().invoke(demo, args)
    assert r.exit_code == 0, r.output
    want = dataclasses.replace(ServingOptions(), gpu="H100", gpus=2, input_len=64, rate=1.5)
    assert got == {"name": "x", "serving": want, "last": True}
    wl = got["serving"].workload(static_shapes=True)
    assert (wl.input_len, wl.output_len, wl.request_rate, wl.static_shapes) == (64, 256, 1.5, True)
    assert got["serving"].target("cpu").device == "cuda"  # --gpu wins over --target
    r = CliRunner().invoke(demo, ["x", "--gpus", "lots"], env={"COLUMNS": "200"})
    assert r.exit_code == 2 and "Invalid value for '--gpus'" in r.output  # Typer checks types


def test_a_command_without_the_serving_parameter_is_refused():
    def plain(name: str) -> None: ...

    with pytest.raises(TypeError, match="serving"):
        with_serving_options(plain)
