"""The optimizer's master copies of a model's trainable parameters and their gradients.

The wrapped module keeps its own parameters (what devices upload); the masters
(``optim_dtype``, usually fp32) are what the optimizer updates. Every call's gradients
accumulate in the masters' ``.grad``; a step's result reaches the module through
:meth:`MasterWeights.copy_to_model`.

With ``share=True`` a host parameter that already has the masters' dtype is its own
master: a *shared* entry has nothing to copy or hand over (every step is synchronous).

A separate master can be *released* (:meth:`MasterWeights.release`): its values dropped
(a zero-stride placeholder, which refuses an in-place write), its gradient still
accumulated. A data-parallel rank that shards the host state releases the masters
another rank owns; their values reach its model from the owner
(``roundpipe_core.distributed.sharded``, through :attr:`MasterWeights.publishers`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from itertools import chain
from operator import attrgetter, itemgetter
from typing import Any

import torch
from torch import nn

from ..running.devices.memory import ReusedHostTensors

__all__ = ["MasterWeights", "copy_pairs", "run_tensor_hooks"]

_HOOKS = attrgetter("_backward_hooks")


def run_tensor_hooks(
    master: nn.Parameter, grad: torch.Tensor, tensors: Sequence[torch.Tensor], name: str = ""
) -> torch.Tensor:
    """``grad`` after the tensor hooks (``Tensor.register_hook``) of ``tensors`` (the model
    parameters ``master`` copies, then ``master``, in its dtype), in registration
    order, each getting what the previous returned (``None``: unchanged), as autograd
    runs a leaf's hooks before accumulating. Devices backpropagate into their own copies,
    so autograd never calls these hooks; they run here on the call's complete gradient,
    on a worker or the optimizer thread (a hook must be thread-safe).

    Raises:
        RuntimeError: a hook returned something other than None or a tensor of the
            gradient's shape (naming the parameter ``name``).
    """
    for t in tensors:
        hooks = t._backward_hooks
        if not hooks:
            continue
        if t is master and grad.dtype != master.dtype:
            grad = grad.to(master.dtype)
        for hook in list(hooks.values()):
            out = hook(grad)
            if out is None:
                continue
            if not isinstance(out, torch.Tensor) or out.shape != grad.shape:
                got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                raise RuntimeError(
                    f"a gradient hook (register_hook) of parameter {name!r} returned {got} "
                    f"for a gradient of shape {tuple(grad.shape)}: a hook must return None "
                    "or a tensor of the gradient's shape"
                )
            grad = out
    return grad


def copy_pairs(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``p.copy_(m)`` for each ``(p, m)`` (a cast where the dtypes differ): one
    ``torch._foreach_copy_`` for plain tensors (a loop re-takes the GIL per tensor, each
    re-take may wait a switch interval while other threads run Python); tensor
    subclasses one by one."""
    kinds = (torch.Tensor, nn.Parameter)
    plain = [pm for pm in pairs if type(pm[0]) in kinds and type(pm[1]) in kinds]
    with torch.no_grad():
        if plain:
            torch._foreach_copy_([p for p, _ in plain], [m for _, m in plain])
        if len(plain) < len(pairs):
            for p, m in pairs:
                if not (type(p) in kinds and type(m) in kinds):
                    p.copy_(m)


class MasterWeights:
    """``(name, model parameter, master)`` for each trainable parameter of ``model``.

    Args:
        model: the wrapped module.
        optim_dtype: dtype of the masters.
        create: False for a model whose masters another RoundPipe owns (none are made).
        share: a trainable host parameter of dtype ``optim_dtype`` is its own master
            (no copy); other parameters still get copies.
        values: False: the separate masters are made as released placeholders (the disk
            tier writes them to its files from the model's parameters, one at a time).
    """

    def __init__(
        self,
        model: nn.Module,
        optim_dtype: torch.dtype,
        create: bool = True,
        share: bool = False,
        values: bool = True,
    ) -> None:
        self.entries: list[tuple[str, nn.Parameter, nn.Parameter]] = []
        # the entries whose master is a separate tensor (what copy_to_model writes)
        self.copies: list[tuple[str, nn.Parameter, nn.Parameter]] = []
        self.master_of: dict[int, nn.Parameter] = {}
        # master id -> the tensors whose hooks (Tensor.register_hook) run on its gradient
        # in add_many: the model parameters it is a separate copy of, then itself
        self.hooked_by: dict[int, tuple[torch.Tensor, ...]] = {}
        self.name_of: dict[int, str] = {}  # master id -> its parameter's name
        self._of_layers: dict[tuple[int, ...], tuple[tuple[nn.Module, ...], list]] = {}
        # guards the masters' .grad: workers add to it while the caller may read it
        self.grad_lock = threading.Lock()
        if create:
            for pname, p in model.named_parameters():
                if not p.requires_grad:
                    continue
                if share and p.dtype == optim_dtype and p.device.type == "cpu":
                    m = p
                else:
                    m = nn.Parameter(
                        p.detach().to(dtype=optim_dtype, copy=True)
                        if values
                        else torch.zeros((), dtype=optim_dtype).expand(p.shape)
                    )
                    self.copies.append((pname, p, m))
                self.entries.append((pname, p, m))
                self.master_of[id(p)] = m
                self.name_of.setdefault(id(m), pname)
                held = self.hooked_by.get(id(m), (m,))[:-1] + ((p,) if p is not m else ())
                self.hooked_by[id(m)] = (*held, m)
        # ids of the released masters (see release()); shared with the weight versions,
        # whose publication skips them too
        self.released: set[int] = set()
        # why a step may not be asynchronous while masters are released (None: it may)
        self.sync_only: str | None = None
        # who publishes the released masters' versions into the model (the weight
        # versions' remote publishers: a data-parallel rank's shards, asynchronous steps)
        self.publishers: list[Any] = []
        # model parameter id -> (param, master, the .grad handed to it, its version, shared)
        self._handed: dict[int, tuple[nn.Parameter, nn.Parameter, torch.Tensor, int, bool]] = {}
        # converted gradients' memory, written again every step (see _first_grad)
        self._converted = ReusedHostTensors()

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def num_shared(self) -> int:
        """Entries whose master is the model parameter itself."""
        return len(self.entries) - len(self.copies)

    def params(self) -> list[nn.Parameter]:
        return [m for _, _, m in self.entries]

    def add_grad(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """Add ``grad`` (of the model parameter ``param``) to its master's ``.grad``."""
        master = self.master_of.get(id(param))
        if master is None:
            return  # frozen parameter
        with self.grad_lock:
            if master.grad is None:
                master.grad = grad if grad.dtype == master.dtype else self._first_grad(master, grad)
            else:
                master.grad.add_(grad)

    def _first_grad(self, master: nn.Parameter, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` (of another dtype) as ``master``'s new ``.grad``: converted into memory
        reused across steps (a fresh fp32 tensor per step would be faulted in page by
        page: see ``ReusedHostTensors``)."""
        if master.device.type != "cpu" or not master.is_contiguous():
            return grad.to(master.dtype)
        out = self._converted.take(
            master.shape, master.dtype, lambda: torch.empty(master.shape, dtype=master.dtype)
        )
        return out.copy_(grad)

    def add_many(self, items: Iterable[tuple[nn.Parameter, torch.Tensor]]) -> None:
        """Add ``(master, grad)`` pairs, each one call's whole gradient of that master.

        A master without ``.grad`` takes ``grad`` itself (the buffer's to give away),
        converted to its dtype here, on the merging thread; the others accumulate with
        one ``torch._foreach_add_`` per dtype and device (another dtype: one mixed-dtype
        ``add_``). The tensor hooks (e.g. ``wandb.watch``) run on each first, once per
        call, as plain PyTorch runs a leaf's hooks once per backward (:func:`run_tensor_hooks`).
        """
        items = list(items)
        hooked_by = self.hooked_by
        # hooks are rare: a C-level pass over the items' tensors looks for any first (a
        # Python step per parameter showed as engine cost per job on small layers)
        held = map(hooked_by.__getitem__, map(id, map(itemgetter(0), items)))
        if any(map(_HOOKS, chain.from_iterable(held))):
            items = [
                (m, run_tensor_hooks(m, g, hooked_by[id(m)], self.name_of[id(m)])) for m, g in items
            ]
        acc: dict[tuple[torch.dtype, torch.device], tuple[list, list]] = {}
        batched: set[int] = set()

        def flush() -> None:
            for dst, src in acc.values():
                torch._foreach_add_(dst, src)
            acc.clear()
            batched.clear()

        with self.grad_lock:
            for master, g in items:
                have = master.grad
                if have is None:
                    master.grad = g if g.dtype == master.dtype else self._first_grad(master, g)
                    continue
                if id(master) in batched:
                    flush()  # the same master again: its earlier addition first, as a loop would
                if g.dtype != have.dtype or g.device != have.device:
                    have.add_(g)
                    continue
                batched.add(id(master))
                dst, src = acc.setdefault((have.dtype, have.device), ([], []))
                dst.append(have)
                src.append(g)
            flush()

    def copy_to_model(self, skip: set[int] | None = None) -> None:
        """Put the masters' values into the model's parameters (see :func:`copy_pairs`);
        a released master has none (its owner's values reach the model instead), nor is
        one in ``skip`` (ids of masters already in the model) copied."""
        left_out = self.released if not skip else self.released | skip
        # a shared master is the parameter: nothing to copy
        copy_pairs([(p, m) for _, p, m in self.copies if id(m) not in left_out])

    def release(self, masters: Iterable[nn.Parameter], sync_only: str | None) -> int:
        """Release these separate masters (see the module docstring; others are left
        alone), each still the same parameter to the optimizer. With ``sync_only``,
        ``step(is_async=True)`` raises ``ValueError(sync_only)`` from now on (the released
        values reach the model inside the step); ``None``: a remote publisher
        (:attr:`publishers`) writes them at publication. Returns the bytes freed."""
        separate = {id(m) for _, _, m in self.copies}
        freed = 0
        for m in masters:
            if id(m) not in separate or id(m) in self.released:
                continue
            freed += m.untyped_storage().nbytes()
            m.data = torch.zeros((), dtype=m.dtype).expand(m.shape)
            self.released.add(id(m))
        if self.copies and sync_only is not None:
            # (also where this rank owns them all: its peers' steps are synchronous)
            self.sync_only = sync_only
        return freed

    def restore_released(self) -> int:
        """Give the released masters values again, from their model parameters (cast to
        the masters' dtype: exact for a model in ``optim_dtype``, the model dtype's
        rounding otherwise). Returns how many were restored."""
        restored = 0
        for _, p, m in self.copies:
            if id(m) in self.released:
                m.data = p.detach().to(dtype=m.dtype, copy=True)
                restored += 1
        self.released.clear()
        self.sync_only = None
        return restored

    def of_layers(self, layers: Sequence[nn.Module]) -> list[nn.Parameter]:
        """The masters of the parameters of ``layers`` (each once; a shared list, not to
        be changed). Kept per layer run, as the masters never change: every call asks it
        for each of its backward jobs."""
        key = tuple(map(id, layers))
        known = self._of_layers.get(key)
        if known is not None:
            return known[1]
        seen: dict[int, nn.Parameter] = {}
        for layer in layers:
            for p in layer.parameters():
                m = self.master_of.get(id(p))
                if m is not None:
                    seen[id(m)] = m
        masters = list(seen.values())
        # the layers are kept with their masters: while cached, no other module has their ids
        self._of_layers[key] = (tuple(layers), masters)
        return masters

    def hand_grads_to_model(self) -> None:
        """Show each master's accumulated gradient as its model parameter's ``.grad``
        (``synchronize()``; see there for what happens next). A shared master's
        ``.grad`` already is its parameter's: it is neither handed over nor taken back."""
        with self.grad_lock:
            for _, p, m in self.copies:
                g = m.grad
                if g is None:
                    continue
                shared = g.dtype == p.dtype and g.device == p.device
                shown = g if shared else g.detach().to(p.dtype)
                p.grad = shown
                self._handed[id(p)] = (p, m, shown, shown._version, shared)

    def take_back_grads(self) -> None:
        """Before gradients are added or a step runs: what was done to the model's
        ``.grad`` since ``hand_grads_to_model`` decides the masters' ``.grad``."""
        if not self._handed:
            return
        with self.grad_lock:
            handed, self._handed = self._handed, {}
            for p, m, shown, version, shared in handed.values():
                now = p.grad
                if now is None:  # zeroed (set_to_none): the gradients were consumed
                    m.grad = None
                elif now is not shown or (not shared and now._version != version):
                    m.grad = now.detach().to(m.dtype, copy=True)  # replaced or changed
                # else untouched, or the master's own tensor: the master's .grad stands
                p.grad = None
