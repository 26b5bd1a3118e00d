"""Shared test helpers: run engine tests on every kind of device this machine has.

An engine test that takes the ``pool_devices`` fixture runs once per device
kind: ``[cpu]`` everywhere, ``[cuda]`` where a GPU is visible (marked
``cuda``, skipped without one)::

    def test_matches_pytorch(pool_devices):
        rp = RoundPipe(make_model(), devices=pool_devices(3))
        ...

``pool_devices(n)`` returns ``"cpu:n"`` for CPU workers, and for CUDA ``n``
devices spread round-robin over the visible GPUs (``[cuda:0, cuda:0, cuda:0]``
on a one-GPU machine): several workers may share one GPU, each with its own
streams, so the same 2- and 3-device schedules run on a single H200.

Select by kind with markers: ``pytest -m cuda`` runs only the CUDA variants
(and the CUDA-only tests), ``pytest -m "not cuda"`` only the CPU ones.

``ROUNDPIPE_TEST_DEVICE=cuda`` runs the *whole* suite on GPUs, tests written
for CPU workers included: every CPU worker a test asks for (``"cpu:N"``, an
int, ``None``) becomes a CUDA worker, spread round-robin over the visible GPUs.
``benchmarks/gpu_check.sh`` uses it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch


def cuda_device_count() -> int:
    """Visible GPUs; 0 without CUDA. Never raises."""
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - a broken driver means no GPU for the tests
        return 0


HAS_CUDA = cuda_device_count() > 0
ROUTE_TO_CUDA = os.environ.get("ROUNDPIPE_TEST_DEVICE", "").strip().lower() == "cuda"

DEVICE_KINDS = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.cuda),
]


def make_pool_devices(kind: str, n: int, gpus: int | None = None) -> Any:
    """The ``devices`` argument for ``n`` workers of ``kind`` ("cpu" or "cuda").

    Args:
        kind: "cpu" or "cuda".
        n: number of workers.
        gpus: GPUs to spread CUDA workers over (default: all visible).
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if kind == "cpu":
        return f"cpu:{n}"
    if kind == "cuda":
        count = cuda_device_count() if gpus is None else gpus
        if count < 1:
            raise ValueError("no CUDA GPU is visible")
        return [torch.device("cuda", i % count) for i in range(n)]
    raise ValueError(f"kind must be 'cpu' or 'cuda', got {kind!r}")


def pytest_report_header(config: pytest.Config) -> str:
    route = (
        " (ROUNDPIPE_TEST_DEVICE=cuda: CPU workers run as CUDA workers)" if ROUTE_TO_CUDA else ""
    )
    return f"roundpipe: {cuda_device_count()} CUDA GPU(s) visible{route}"


def pytest_configure(config: pytest.Config) -> None:
    # GPU results are compared with CPU / plain PyTorch at fp32 tolerance: no TF32.
    if ROUTE_TO_CUDA and not HAS_CUDA:
        raise pytest.UsageError("ROUNDPIPE_TEST_DEVICE=cuda but no CUDA GPU is visible")
    if HAS_CUDA:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(params=DEVICE_KINDS)
def device_kind(request: pytest.FixtureRequest) -> str:
    """ "cpu" or "cuda": parametrises a test over the device kinds."""
    return request.param


@pytest.fixture
def pool_devices(device_kind: str) -> Callable[[int], Any]:
    """``pool_devices(n)`` -> the ``devices`` argument for ``n`` workers of this test's kind."""
    return lambda n: make_pool_devices(device_kind, n)


@pytest.fixture(autouse=ROUTE_TO_CUDA)
def _route_cpu_workers_to_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ROUNDPIPE_TEST_DEVICE=cuda: each CPU worker a pool would make becomes a CUDA worker."""
    from roundpipe_core.devices import pool

    original = pool.resolve_devices
    count = cuda_device_count()

    def routed(devices: Any) -> list[torch.device]:
        devs = original(devices)
        k = 0
        out = []
        for d in devs:
            if d.type == "cpu":
                d = torch.device("cuda", k % count)
                k += 1
            out.append(d)
        return out

    monkeypatch.setattr(pool, "resolve_devices", routed)
