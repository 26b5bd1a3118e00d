"""Run the tests of one wing of the code (the fast local loop): ``python scripts/test_wing.py WING``.

A change to one wing is checked in minutes instead of the whole suite's ten: each wing
maps to the test modules that exercise it (``tests/core/test_ci_selection.py`` checks
that every test module belongs to a wing). Extra arguments go to pytest, e.g.
``python scripts/test_wing.py stepping -k layerwise`` or ``... running -n 0``.
Set ``ROUNDPIPE_TEST_DEVICE=fake-cuda`` to run the wing through the CUDA worker's code.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: wing -> test files (globs relative to the repository); a module may serve two wings
WINGS: dict[str, list[str]] = {
    "planning": [
        "tests/core/test_plan_*.py",
        "tests/core/test_planner_optimal.py",
        "tests/core/test_default_plan.py",
        "tests/core/test_serial_pool.py",
        "tests/core/test_schedule.py",
        "tests/core/test_simulate.py",
        "tests/core/test_bound_baseline.py",
        "tests/core/test_async_sim.py",
        "tests/core/test_validation.py",
        "tests/core/test_timer*.py",
        "tests/core/test_trace.py",
        "tests/core/test_last_trace.py",
        "tests/core/test_verify.py",
        "tests/core/test_step_cost_benchmark.py",
        "tests/core/test_peer_pipeline_benchmark.py",
    ],
    "running": [
        "tests/core/test_devices_*.py",
        "tests/core/test_cuda_backend.py",
        "tests/core/test_fake_*.py",
        "tests/core/test_upload_layouts.py",
        "tests/core/test_cpu_lending.py",
        "tests/core/test_concurrent_cpu.py",
        "tests/core/test_memory.py",
        "tests/core/test_host_memory.py",
        "tests/core/test_host_transients.py",
        "tests/core/test_failures.py",
        "tests/core/test_engine_*.py",
        "tests/core/test_replicated_stage.py",
        "tests/core/test_recompute.py",
        "tests/core/test_async_rng.py",
        "tests/core/test_misuse.py",
        "tests/core/test_checkpoint_file.py",
    ],
    "stepping": [
        "tests/core/test_optimizer.py",
        "tests/core/test_optim.py",
        "tests/core/test_layerwise.py",
        "tests/core/test_master_copies.py",
        "tests/core/test_released_masters.py",
        "tests/core/test_shared_masters.py",
        "tests/core/test_step_never_blocks.py",
        "tests/core/test_overlap.py",
        "tests/core/test_async_overhead.py",
        "tests/core/test_grad_*.py",
        "tests/core/test_hooks.py",
        "tests/core/test_loss_reduction.py",
    ],
    "batch": ["tests/core/test_batch*.py", "tests/core/test_split_note.py"],
    "api": [
        "tests/core/test_public_api.py",
        "tests/core/test_layering.py",
        "tests/core/test_ci_selection.py",
    ],
    "presets": ["tests/presets"],
    "distributed": [
        "tests/distributed/test_data_parallel.py",
        "tests/distributed/test_sharded.py",
        "tests/distributed/test_distributed_helpers.py",
    ],
    "multinode": [  # the strategies over several processes (Lightning, Fabric)
        "tests/distributed/test_lightning_ddp.py",
        "tests/distributed/test_lightning_sharded.py",
        "tests/distributed/test_fabric_sharded.py",
        "tests/distributed/test_strategy_multinode.py",
    ],
    "lightning": ["tests/lightning"],
}


def wing_paths(wing: str) -> list[str]:
    """The test files (or folders) of ``wing``, sorted; ``ValueError`` for an unknown wing."""
    if wing not in WINGS:
        raise ValueError(f"unknown wing {wing!r}; choose one of {', '.join(WINGS)}")
    paths: set[str] = set()
    for pattern in WINGS[wing]:
        found = sorted(ROOT.glob(pattern))
        if not found:
            raise ValueError(f"wing {wing!r}: {pattern} matches nothing")
        paths.update(str(p.relative_to(ROOT)) for p in found)
    return sorted(paths)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        print("wings:", ", ".join(WINGS))
        return 0 if argv else 2
    wing, extra = argv[0], argv[1:]
    try:
        paths = wing_paths(wing)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    workers = [] if any(a == "-n" or a.startswith("-n") for a in extra) else ["-n", "auto"]
    cmd = [sys.executable, "-m", "pytest", *paths, *workers, *extra]
    print(f"[test_wing] {wing}: {len(paths)} paths", flush=True)
    return subprocess.call(cmd, cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
