"""A CPU worker budgets its stage copies from the host memory that is actually free."""

from __future__ import annotations

import pytest

from roundpipe_core.running.devices import cpu
from roundpipe_core.running.devices.pool import DevicePool

GiB = 1024**3

# the CPU worker's own budget: not routed to (fake) CUDA workers
pytestmark = pytest.mark.cpu_backend


def test_default_capacity_is_a_share_of_available_memory(monkeypatch):
    monkeypatch.delenv("ROUNDPIPE_CPU_DEVICE_MEMORY_GB", raising=False)
    monkeypatch.setattr(cpu, "available_host_memory", lambda: 3 * GiB)
    pool = DevicePool("cpu:3")
    try:
        assert [w.memory_capacity() for w in pool.workers] == [GiB] * 3
    finally:
        pool.close()


def test_default_capacity_is_capped_at_eight_gib(monkeypatch):
    monkeypatch.delenv("ROUNDPIPE_CPU_DEVICE_MEMORY_GB", raising=False)
    monkeypatch.setattr(cpu, "available_host_memory", lambda: 1000 * GiB)
    assert cpu.cpu_device_memory_bytes(share=2) == 8 * GiB
    monkeypatch.setattr(cpu, "available_host_memory", lambda: None)  # unreadable: the default
    assert cpu.cpu_device_memory_bytes(share=2) == 8 * GiB


@pytest.mark.parametrize("setting, expected", [("2", 2 * GiB), ("0.5", GiB // 2)])
def test_the_environment_variable_wins(monkeypatch, setting, expected):
    monkeypatch.setenv("ROUNDPIPE_CPU_DEVICE_MEMORY_GB", setting)
    monkeypatch.setattr(cpu, "available_host_memory", lambda: GiB // 8)
    assert cpu.cpu_device_memory_bytes(share=4) == expected


@pytest.mark.parametrize("spec", ["cpu:٣", "cpu:+2", "cpu:2_0", "cpu:0", "cpu:-1", "cpu:"])
def test_cpu_device_count_is_ascii_digits(spec):
    with pytest.raises(ValueError, match="digits 0-9"):
        DevicePool(spec)


def test_cpu_device_count_from_the_environment_is_ascii_digits(monkeypatch):
    monkeypatch.setenv("ROUNDPIPE_CPU_DEVICES", "٢")
    with pytest.raises(ValueError, match="ROUNDPIPE_CPU_DEVICES"):
        DevicePool("cpu")
