"""The README's ``RoundPipeStrategy`` argument table lists every constructor argument, with
the default the signature has."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

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
