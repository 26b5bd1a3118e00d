"""Devices of the engine: the pool (pool.py), the worker interface (base.py), the CPU
(cpu.py) and CUDA (cuda.py) backends, and host-memory pinning (memory.py)."""

__all__: list[str] = []
