"""The house's floor plan: which part of the packages may import which.

The contract is the table in ``docs/architecture.md`` ("Import direction"); this test
reads the same table from here, checks the doc spells it the same way, and walks every
import of both packages -- module level, inside functions and under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.host_only

ROOT = Path(__file__).resolve().parents[2]

#: roundpipe_core's parts, lowest first. A module may import modules of its own part
#: or of a lower one, never of a higher one.
CORE_LAYERS: list[tuple[str, set[str]]] = [
    ("foundation", {"kinds", "context", "batch", "loss"}),
    ("planning", {"planning"}),
    ("config", {"config"}),
    ("running", {"running"}),
    ("stepping", {"stepping"}),
    (
        "engine",
        {
            "checks",
            "plan_choice",
            "autograd",
            "base",
            "model",
            "amp",
            "optim",
            "timer",
            "simulate",
        },
    ),
    (
        "integrations",
        {
            "autosplit",
            "verify",
            "presets",
            "distributed",
            "checkpoint_file",
        },
    ),
    ("package", {"__init__"}),
]

#: Inside the planning wing, which planning modules each may import (lower first).
PLANNING = {
    "layout": set(),
    "plan": {"layout"},
    "partition": set(),
    "schedule": {"plan"},
    "profile": {"plan"},
    "simulate": {"plan", "profile", "schedule"},
    "search": {"partition", "plan", "profile", "schedule", "simulate"},
    "planner": {"plan", "profile", "search", "simulate"},
}


def _modules(package: str) -> dict[str, Path]:
    base = ROOT / package
    out = {}
    for path in sorted(base.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = {**_modules("roundpipe_core"), **_modules("roundpipe_lightning")}


def _from_base(module: str, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` in ``module`` imports from."""
    if not node.level:
        return node.module or ""
    here = module.split(".")[: None if MODULES[module].name == "__init__.py" else -1]
    here = here[: len(here) - node.level + 1]
    return ".".join(here + ([node.module] if node.module else []))


def _imports(module: str) -> list[tuple[str, int]]:
    """Every module of the two packages that ``module`` imports, with the line."""
    found = []
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(module, node)
            targets = [f"{base}.{a.name}" for a in node.names]
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != module:
                found.append((target, node.lineno))
    return found


def _part(module: str) -> str:
    """The top-level name of a core module: ``roundpipe_core.running.devices.cpu`` ->
    ``running``; the package itself -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _layer(module: str) -> int:
    part = _part(module)
    for index, (_, names) in enumerate(CORE_LAYERS):
        if part in names:
            return index
    raise AssertionError(
        f"{module} is in no layer: add {part!r} to CORE_LAYERS and docs/architecture.md"
    )


CORE = sorted(m for m in MODULES if m.startswith("roundpipe_core"))


@pytest.mark.parametrize("module", CORE)
def test_core_imports_point_down(module):
    mine = _layer(module)
    up = [
        f"{target} (line {line}, layer {CORE_LAYERS[_layer(target)][0]})"
        for target, line in _imports(module)
        if _layer(target) > mine
    ]
    assert not up, f"{module} (layer {CORE_LAYERS[mine][0]}) imports upward: {up}"


@pytest.mark.parametrize("module", sorted(PLANNING))
def test_planning_modules_import_kinds_and_lower_planning_only(module):
    name = f"roundpipe_core.planning.{module}"
    allowed = {"roundpipe_core.kinds"} | {f"roundpipe_core.planning.{m}" for m in PLANNING[module]}
    found = {target for target, _ in _imports(name)}
    assert found <= allowed, f"{module} imports {sorted(found - allowed)}"


@pytest.mark.parametrize("module", sorted(PLANNING))
def test_planning_imports_stay_at_module_level(module):
    tree = ast.parse(MODULES[f"roundpipe_core.planning.{module}"].read_text())
    nested = [
        n.lineno
        for fn in ast.walk(tree)
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
        for n in ast.walk(fn)
        if isinstance(n, (ast.Import, ast.ImportFrom))
    ]
    assert not nested, f"{module} imports inside a function at lines {nested}"


def test_every_planning_module_is_listed():
    on_disk = {m.rpartition(".")[2] for m in MODULES if m.startswith("roundpipe_core.planning.")}
    assert on_disk == set(PLANNING)


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    graph = {m: {t for t, _ in _imports(m)} for m in MODULES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_module_imports_one_that_imports_it_back():
    assert _cycles() == []


def test_the_cycle_check_can_fail(monkeypatch):
    real = _imports

    def with_back_edge(module):
        found = real(module)
        if module == "roundpipe_core.kinds":
            found = [*found, ("roundpipe_core.planning.plan", 1)]
        return found

    monkeypatch.setitem(globals(), "_imports", with_back_edge)
    assert any("roundpipe_core.kinds" in c for c in _cycles())


def test_core_never_imports_lightning():
    for module in CORE:
        tree = ast.parse(MODULES[module].read_text())
        for node in ast.walk(tree):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and node.level == 0
                else []
            )
            for name in names:
                assert not name.startswith(("lightning", "pytorch_lightning")), (
                    f"{module} imports {name}"
                )
                assert not name.startswith("roundpipe_lightning"), f"{module} imports {name}"


def test_strategy_does_not_import_the_callbacks():
    """callbacks.py imports the strategy (to check a Trainer uses it), never the reverse."""
    strategy = {t for t, _ in _imports("roundpipe_lightning.strategy")}
    assert "roundpipe_lightning.callbacks" not in strategy


def test_top_level_stays_small():
    top = list((ROOT / "roundpipe_core").glob("*.py"))
    assert len(top) <= 20, sorted(p.name for p in top)


def test_the_documented_table_is_this_one():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"<!-- layers -->\n```text\n(.*?)```", doc, re.S)
    assert block, "docs/architecture.md lost its import-direction table"
    rows = [line.split(None, 1) for line in block.group(1).strip().splitlines()]
    documented = [(name, set(rest.replace(",", " ").split())) for name, rest in rows]
    assert documented == CORE_LAYERS


#: What code outside roundpipe_core/stepping/ may import from it: the step's one owner,
#: the masters, the handles and buffers of a call, and the user-facing helpers of the
#: layer-wise step. The optimizer thread, weight versions and the overlapped runs'
#: bookkeeping are the wing's own.
STEPPING_FACE = {
    "roundpipe_core.stepping.owner": {"StepOwner"},
    "roundpipe_core.stepping.masters": {"MasterWeights"},
    "roundpipe_core.stepping.pipelined": {
        "GradBuffer",
        "PendingResult",
        "RunFinisher",  # a pipelined call's completion handle (its timings, its end)
        "to_output_device",
    },
    "roundpipe_core.stepping.stepper": {"ClosedError"},
    # the user-facing helpers of the layer-wise step, and the one gradient countdown of a
    # call (a forward()'s backward counts with it too)
    "roundpipe_core.stepping.layerwise": {"step_subset", "steps_elementwise", "GradCompletion"},
    # the disk tier: made by the RoundPipe, its checkpoint verbs are the user's
    "roundpipe_core.stepping.disk_tier": {"DiskTier", "STEP_UNSUPPORTED", "check_offload_args"},
}


def _imported_names(module: str) -> list[tuple[str, str, int]]:
    """(target module, name, line) of every ``from ... import name`` in ``module``."""
    return [
        (_from_base(module, node), a.name, node.lineno)
        for node in ast.walk(ast.parse(MODULES[module].read_text()))
        if isinstance(node, ast.ImportFrom)
        for a in node.names
    ]


@pytest.mark.parametrize(
    "module", sorted(m for m in MODULES if not m.startswith("roundpipe_core.stepping"))
)
def test_only_the_stepping_face_is_used_outside_the_wing(module):
    bad = [
        f"{name} from {target} (line {line})"
        for target, name, line in _imported_names(module)
        if target.startswith("roundpipe_core.stepping")
        and name not in STEPPING_FACE.get(target, set())
    ]
    assert not bad, f"{module} imports the stepping wing's internals: {bad}"
