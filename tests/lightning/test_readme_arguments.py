"""The README's ``RoundPipeStrategy`` argument table lists every constructor argument, with
the default the signature has; every docstring of ``num_microbatch`` says the default the
code has."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest
from torch import nn

from roundpipe_lightning import RoundPipeStrategy

README = Path(__file__).parents[2] / "README.md"


def _table() -> dict[str, str]:
    """``{argument: documented default}`` from the README's argument table."""
    text = README.read_text()
    section = text.split("## `RoundPipeStrategy` arguments", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, str] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        for name in re.findall(r"`(\w+)`", cells[0]):
            rows[name] = cells[1]
    return rows


def test_every_argument_is_in_the_table() -> None:
    signature = inspect.signature(RoundPipeStrategy.__init__)
    arguments = [p for p in signature.parameters if p != "self"]
    table = _table()
    assert sorted(table) == sorted(arguments), (
        f"missing from the README: {sorted(set(arguments) - set(table))}; "
        f"not arguments: {sorted(set(table) - set(arguments))}"
    )


def test_documented_literal_defaults_match_the_signature() -> None:
    signature = inspect.signature(RoundPipeStrategy.__init__)
    checked = 0
    for name, documented in _table().items():
        literal = re.fullmatch(r"`([^`]+)`", documented)
        if literal is None:
            continue  # prose ("devices + 1", "`None` (engine: ...)")
        try:
            value = ast.literal_eval(literal.group(1))
        except (ValueError, SyntaxError):
            continue  # an expression such as torch.float32
        assert signature.parameters[name].default == value, name
        checked += 1
    assert checked >= 8


def _argument_doc(obj: object, name: str) -> str:
    """The Google-style ``Args:`` entry of ``name`` in ``obj``'s docstring, on one line."""
    lines = (inspect.getdoc(obj) or "").splitlines()
    for i, line in enumerate(lines):
        if line.lstrip().startswith(f"{name}:"):
            indent = len(line) - len(line.lstrip())
            entry = [line.strip()]
            for more in lines[i + 1 :]:
                if more.strip() and len(more) - len(more.lstrip()) <= indent:
                    break
                entry.append(more.strip())
            return " ".join(entry)
    raise AssertionError(f"{obj!r} documents no {name!r}")


@pytest.mark.cpu_backend  # checks the CPU workers' default against the docstrings
def test_every_num_microbatch_default_says_what_the_code_does() -> None:
    """The default has one source (``default_num_microbatch``): devices + 1 on GPUs, but 1
    or one per worker on CPU workers. Each docstring documenting the argument names that
    source and the CPU rule instead of a bare "devices + 1"."""
    from roundpipe_core import RoundPipe, RoundPipeRunConfig
    from roundpipe_core.planning import planner
    from roundpipe_core.running.host_memory import estimate_host_memory
    from roundpipe_core.verify import compare_plans
    from roundpipe_lightning.fabric import RoundPipeFabricStrategy
    from roundpipe_lightning.session import check_num_microbatch

    for obj in (
        RoundPipeRunConfig,
        estimate_host_memory,
        planner.auto,
        compare_plans,
        RoundPipeStrategy,
    ):
        doc = _argument_doc(obj, "num_microbatch")
        assert "default_num_microbatch" in doc and "CPU workers" in doc, (obj, doc)
    # the Fabric strategy documents it by pointing at RoundPipeStrategy's entry (checked above)
    fabric = " ".join((inspect.getdoc(RoundPipeFabricStrategy) or "").split())
    shared = fabric.split(" are as for :class:`~roundpipe_lightning.RoundPipeStrategy`")
    assert len(shared) == 2 and "``num_microbatch``" in shared[0], fabric
    assert "devices + 1" not in fabric
    with pytest.raises(ValueError, match="1 or one per worker on CPU workers"):
        check_num_microbatch(0)
    # what the code does on CPU workers: one per worker, 1 for a model with buffers
    with_buffers = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    for model, want in ((nn.Sequential(nn.Linear(4, 4)), 2), (with_buffers, 1)):
        rp = RoundPipe(model, devices="cpu:2")
        try:
            assert rp.num_microbatch_for() == want
        finally:
            rp.close()
