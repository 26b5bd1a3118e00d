#!/usr/bin/env python
"""Re-plant defects this project once had and check that a test still catches each.

Every plant below is a minimal edit of the library (a line removed or changed) that
re-introduces a defect found in an earlier round, with the test(s) written to catch it.
For each plant the script copies the repository's files (tracked and untracked, not
ignored: what ``git ls-files -co --exclude-standard`` lists) into a temporary directory,
applies the edit there, and runs the plant's tests in that copy. The real tree is never
edited, so a failure or Ctrl-C leaves it as it was.

    python scripts/check_planted_defects.py            # every plant
    python scripts/check_planted_defects.py --list     # names, files, tests
    python scripts/check_planted_defects.py --only layerwise-merge-race
    python scripts/check_planted_defects.py --baseline # the same tests, no plant: must pass

Per plant: STALE (the old text does not occur exactly once: a refactor moved it, rewrite
the plant), CAUGHT (the tests failed with the plant), MISSED (they passed: no test
catches that defect any more) or ERROR (pytest could not run them: a collection error, no
test selected). The exit status is non-zero if any plant is not CAUGHT (with
``--baseline``: if any plant's tests do not pass on the unmodified tree).

The list is in docs/development.md ("Planted defects"); keep the two in step.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: pytest's exit status when tests ran and some failed
_TESTS_FAILED = 1


@dataclass(frozen=True)
class Plant:
    name: str
    defect: str
    file: str  # relative to the repository root
    old: str  # must occur exactly once in ``file``
    new: str
    tests: tuple[str, ...]  # pytest node ids; the plant is CAUGHT if any of them fails
    fake_cuda: bool = False  # run with ROUNDPIPE_TEST_DEVICE=fake-cuda
    timeout_s: int = 60  # pytest-timeout per test (a hang counts as a failure: caught)


PLANTS: tuple[Plant, ...] = (
    Plant(
        name="layerwise-merge-race",
        defect="step_layerwise takes a part's gradients outside the runs' merge lock: a "
        "result() merging the same run meanwhile leaves the step an emptied buffer (3ad7356)",
        file="roundpipe_core/stepping/layerwise.py",
        old="            merge(r, chunk)  # (a result() on another thread may merge r meanwhile)\n",
        new="            masters.add_many(r.buffer.take(chunk))\n",
        tests=(
            "tests/core/test_layerwise.py::test_a_result_merging_meanwhile_is_not_stepped_around",
        ),
    ),
    Plant(
        name="reducer-without-grad-lock",
        defect="the data-parallel reducer reads and writes the masters' .grad under a lock "
        "of its own, not the masters' grad lock (b2ca0f9: a segfault of rank 0)",
        file="roundpipe_core/distributed/reducer.py",
        old='self._grad_lock = getattr(masters, "grad_lock", None) or threading.Lock()',
        new="self._grad_lock = threading.Lock()",
        tests=(
            "tests/distributed/test_distributed_helpers.py"
            "::test_the_reducer_waits_for_the_masters_grad_lock",
        ),
    ),
    Plant(
        name="never-lend",
        defect="CPU workers copy every stage's parameters instead of computing on the "
        "host's (ae3903a: lending)",
        file="roundpipe_core/running/transfer.py",
        old="slot, epoch, lend=True)",
        new="slot, epoch, lend=False)",
        tests=(
            "tests/core/test_cpu_lending.py"
            "::test_a_blocking_call_computes_on_the_host_parameters[default]",
        ),
    ),
    Plant(
        name="lend-buffers",
        defect="CPU workers lend buffers too (a forward and its recompute write BatchNorm's "
        "running statistics into the host's twice); only read-only tensors may be lent",
        file="roundpipe_core/running/devices/cpu.py",
        old="return [t.detach() if ro else t.clone() for t, ro in zip(tensors, read_only)]",
        new="return [t.detach() for t in tensors]",
        tests=(
            "tests/core/test_cpu_lending.py::test_buffers_are_still_copied_and_written_back_once",
        ),
    ),
    Plant(
        name="lent-stage-unfenced",
        defect="a stage computing on lent host weights gets the plain upload fence: an "
        "asynchronous step's newer version is copied into the weights under it (2dacb9d)",
        file="roundpipe_core/running/transfer.py",
        old="        if stage.aliases_host:\n",
        new="        if False:\n",
        tests=(
            "tests/core/test_cpu_lending.py"
            "::test_overlapped_calls_lend_and_a_newer_version_waits_for_the_release",
        ),
    ),
    Plant(
        name="upload-skips-version-wait",
        defect="a call behind an asynchronous step uploads its layers without waiting for "
        "that step's weights to be published (reads the version before)",
        file="roundpipe_core/running/transfer.py",
        old="        run.weights.wait_ready(run.reader, layers, lambda: run.failed is not None)\n",
        new="",
        tests=("tests/core/test_optimizer.py::test_async_step_is_one_step_stale[True]",),
    ),
    Plant(
        name="missing-param-wait",
        defect="a stage computes without waiting for its parameter upload (CUDA: compute "
        "reads weights the copy has not written yet)",
        file="roundpipe_core/running/runtime.py",
        old='                worker.wait_channel("param")\n',
        new="",
        tests=(
            "tests/core/test_engine_equivalence.py::test_forward_backward_matches_pytorch[2-2]",
        ),
        fake_cuda=True,
    ),
    Plant(
        name="missing-deferred-download-wait",
        defect="an upload reading a deferred download's pinned piece does not wait for that "
        "download's event (the next stage, possibly on another GPU, reads it unwritten)",
        file="roundpipe_core/running/devices/cuda.py",
        old="                stream.wait_event(piece.event)\n",
        new="                pass\n",
        tests=(
            "tests/core/test_fake_cuda_deferred_downloads.py"
            "::test_an_upload_on_another_gpu_reads_a_pending_download_in_stream_order",
        ),
    ),
    Plant(
        name="download-not-after-compute",
        defect="a download is not ordered after the compute that made its source (its "
        "stream does not wait for an event recorded on the compute stream)",
        file="roundpipe_core/running/devices/cuda.py",
        old="            self.download_stream.wait_event(ready)\n",
        new="",
        tests=(
            "tests/core/test_devices_fake_cuda.py"
            "::test_a_download_is_ordered_after_the_compute_issued_before_it",
        ),
    ),
    Plant(
        name="scaler-scale-skips-deferred-update",
        defect="GradScaler.scale() does not wait for an update() deferred until the "
        "optimizer thread's step(): the next iteration scales with the old scale",
        file="roundpipe_core/amp.py",
        old='            self._wait_resolved("scale()")\n',
        new="",
        tests=(
            "tests/core/test_grad_scaler.py"
            "::test_scale_waits_for_deferred_update_and_times_out_without_step",
        ),
    ),
    Plant(
        name="mean-weights-ignore-rows",
        defect='loss_reduction="mean" weights uneven microbatches equally instead of by '
        "their share of the batch rows (e79918f)",
        file="roundpipe_core/loss.py",
        old="        return [n / batch_size for n in sizes]\n",
        new="        return [1.0 / num_microbatch] * num_microbatch\n",
        tests=(
            "tests/core/test_loss_reduction.py"
            "::test_mean_of_a_batch_mean_loss_is_plain_pytorch[True-3]",
        ),
    ),
    Plant(
        name="strategy-drops-loss-reduction",
        defect="the Lightning strategy builds its RoundPipe without its loss_reduction "
        '(the engine\'s "sum": a batch-mean loss_fn is num_microbatch times too large)',
        file="roundpipe_lightning/session.py",
        old="                loss_reduction=self.loss_reduction,\n"
        "                # the disk tier keeps every master in its files: never the weight itself\n",
        new="                # the disk tier keeps every master in its files: never the weight itself\n",
        tests=(
            "tests/lightning/test_strategy_loss_reduction.py"
            "::test_mean_loss_matches_plain_lightning[3]",
        ),
    ),
    Plant(
        name="resume-masters-from-module",
        defect="loading a checkpoint restores the fp32 masters from the bf16 module "
        "instead of the saved masters: the resumed run is not the straight run",
        file="roundpipe_lightning/session.py",
        old="                elif name in saved:\n                    m.copy_(saved[name])\n",
        new="                elif name in saved:\n                    m.copy_(p)\n",
        tests=(
            "tests/lightning/test_checkpoint.py"
            "::test_resume_is_identical_to_straight_run[bf16-true-sync]",
        ),
    ),
    Plant(
        name="preset-loss-weighted-twice",
        defect="the presets' causal-LM loss (already a share of the whole batch's tokens) "
        'is weighted by microbatch rows again under loss_reduction="mean"',
        file="roundpipe_core/presets/loss.py",
        old="    batch_normalized = True\n",
        new="    batch_normalized = False\n",
        tests=(
            "tests/presets/test_preset_equivalence.py"
            "::test_causal_lm_loss_fn_is_hf_loss_under_both_reductions[mean]",
        ),
    ),
)


def _repo_files(root: Path) -> list[str]:
    """Tracked files and untracked ones git does not ignore (what a commit could hold)."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "-co", "--exclude-standard"],
        cwd=root,
        check=True,
        capture_output=True,
    ).stdout
    return [f for f in out.decode().split("\0") if f and (root / f).is_file()]


def _copy_tree(root: Path, files: list[str], dest: Path) -> None:
    for f in files:
        target = dest / f
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / f, target)


def _stale_reason(plant: Plant, root: Path) -> str | None:
    path = root / plant.file
    if not path.is_file():
        return f"{plant.file} does not exist"
    n = path.read_text().count(plant.old)
    if n != 1:
        return f"the old text occurs {n} times in {plant.file} (must be exactly once)"
    return None


def _run_tests(plant: Plant, tree: Path, verbose: bool) -> tuple[int, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("ROUNDPIPE_TEST_DEVICE", None)
    if plant.fake_cuda:
        env["ROUNDPIPE_TEST_DEVICE"] = "fake-cuda"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-x",
        "-q",
        "-p",
        "no:cacheprovider",
        f"--timeout={plant.timeout_s}",
        *plant.tests,
    ]
    proc = subprocess.run(
        cmd,
        cwd=tree,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=plant.timeout_s * len(plant.tests) + 120,
    )
    if verbose:
        print(proc.stdout)
    return proc.returncode, proc.stdout


def _imports_from(tree: Path) -> bool:
    """Whether a Python started in ``tree`` imports the packages from ``tree`` (not from
    an installed copy elsewhere): else the plant would be tested against other code."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    code = "import roundpipe_core; print(roundpipe_core.__file__)"
    got = subprocess.run(
        [sys.executable, "-c", code], cwd=tree, env=env, capture_output=True, text=True
    )
    return got.returncode == 0 and Path(got.stdout.strip()).resolve().is_relative_to(tree.resolve())


def _last_lines(text: str, n: int = 15) -> str:
    return "\n".join("    | " + line for line in text.rstrip().splitlines()[-n:])


def check(plant: Plant, files: list[str], baseline: bool, verbose: bool) -> str:
    """Apply ``plant`` in a fresh copy of the tree (none with ``baseline``), run its tests;
    returns the verdict."""
    stale = _stale_reason(plant, ROOT)
    if stale is not None:
        return f"STALE ({stale})"
    with tempfile.TemporaryDirectory(prefix=f"planted-{plant.name}-") as tmp:
        tree = Path(tmp)
        _copy_tree(ROOT, files, tree)
        if not _imports_from(tree):
            return "ERROR (the copy does not import its own roundpipe_core)"
        if not baseline:
            path = tree / plant.file
            path.write_text(path.read_text().replace(plant.old, plant.new, 1))
        try:
            rc, out = _run_tests(plant, tree, verbose)
        except subprocess.TimeoutExpired:
            return "PASS? (hung)" if baseline else "CAUGHT (the tests hung past their limit)"
    if baseline:
        if rc == 0:
            return "PASS"
        return f"FAIL (pytest exit {rc})\n{_last_lines(out)}"
    if rc == _TESTS_FAILED:
        return "CAUGHT"
    if rc == 0:
        return "MISSED (the tests passed with the defect planted)"
    return f"ERROR (pytest exit {rc})\n{_last_lines(out)}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", action="append", metavar="NAME", help="check this plant (repeat)")
    ap.add_argument("--list", action="store_true", help="list the plants and exit")
    ap.add_argument(
        "--baseline",
        action="store_true",
        help="run each plant's tests on the unmodified tree (they must pass)",
    )
    ap.add_argument("-v", "--verbose", action="store_true", help="print pytest's output")
    args = ap.parse_args(argv)

    plants = list(PLANTS)
    if args.only:
        known = {p.name for p in PLANTS}
        unknown = [n for n in args.only if n not in known]
        if unknown:
            ap.error(f"unknown plant(s) {unknown}; --list shows them")
        plants = [p for p in PLANTS if p.name in args.only]
    if args.list:
        for p in plants:
            stage = "fake-CUDA" if p.fake_cuda else "CPU"
            print(f"{p.name}  [{stage}]  {p.file}\n    {p.defect}")
            for t in p.tests:
                print(f"    test: {t}")
        return 0

    files = _repo_files(ROOT)
    good = "PASS" if args.baseline else "CAUGHT"
    bad = 0
    total = time.perf_counter()
    for i, p in enumerate(plants, 1):
        t0 = time.perf_counter()
        verdict = check(p, files, args.baseline, args.verbose)
        took = time.perf_counter() - t0
        stage = "fake-CUDA" if p.fake_cuda else "CPU"
        print(f"[{i}/{len(plants)}] {p.name:<36} {stage:<9} {verdict}  ({took:.1f} s)", flush=True)
        bad += not verdict.startswith(good)
    print(
        f"{len(plants) - bad}/{len(plants)} {good}"
        f" in {time.perf_counter() - total:.0f} s" + (f"; {bad} not {good}" if bad else "")
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
