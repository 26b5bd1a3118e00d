"""What every RoundPipe wrapper shares (:class:`RoundPipeBase`), and ``OptimizerCtx``.

``RoundPipe`` (``model.py``) adds the pipelined calls of an ``nn.Sequential``;
``AutoRoundPipe`` (``autosplit.py``) runs a model that is not one; neither subclasses
the other.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from itertools import chain
from operator import attrgetter
from typing import Any

import torch
from torch import nn

from .checks import (
    IdleSteps,
    check_no_post_accumulate_hooks,
    check_not_compiled_in_place,
    check_not_on_meta,
    claim_parameters,
)
from .kinds import PinMode, check_flag, parse_kind
from .running.carried import carried_tensors
from .running.devices import memory
from .running.devices.pool import DevicePool
from .running.trace import chrome_trace, spans_from_roundpipe
from .stepping.disk_tier import STEP_UNSUPPORTED, DiskTier, check_offload_args
from .stepping.masters import MasterWeights
from .stepping.owner import StepOwner
from .stepping.pipelined import GradBuffer

_log = logging.getLogger(__name__)

__all__ = ["OptimizerCtx", "RoundPipeBase"]

_CLOSE_JOIN_S = 10.0
_POST_HOOKS = attrgetter("_post_accumulate_grad_hooks")


class _OptimCtxState(threading.local):
    depth = 0


_OPTIM_CTX = _OptimCtxState()


class OptimizerCtx:
    """Inside ``with OptimizerCtx():`` a RoundPipe's ``parameters()`` /
    ``named_parameters()`` are its master (optimizer) parameters, so
    ``torch.optim.AdamW(model.parameters())`` gets the fp32 masters."""

    def __enter__(self) -> OptimizerCtx:
        _OPTIM_CTX.depth += 1
        return self

    def __exit__(self, *exc: Any) -> None:
        _OPTIM_CTX.depth -= 1


def release_roundpipe(
    name: str, pool: DevicePool, owns_pool: bool, steps: StepOwner, pin_handle: Any = None
) -> None:
    """Free a RoundPipe's threads and memory (``close()``, garbage collection or exit).

    It never waits for a step still running (a stuck ``step_fn`` must not hang
    interpreter exit) and warns about a step error nobody has seen. The pool drains
    (``DevicePool.close``; ``synchronize`` for a pool passed in) before registered host
    memory is unregistered: unregistering under a DMA still reading it is undefined.
    """
    unseen = steps.unobserved_error()
    steps.shutdown()
    drained = pool.close() if owns_pool else pool.synchronize()
    if pin_handle is not None:
        if drained:
            pin_handle.release()
        elif pin_handle.registered:
            warnings.warn(
                f"RoundPipe {name!r}: a device did not finish its work within the close "
                "timeout; its registered host memory stays page-locked until the process "
                "exits rather than being unregistered under copies still reading it",
                RuntimeWarning,
                stacklevel=1,
            )
    if unseen is not None:
        warnings.warn(
            f"RoundPipe {name!r}: an optimizer step raised {unseen!r} and the error was never "
            "raised to the caller; call synchronize() (or close()) to see step errors",
            RuntimeWarning,
            stacklevel=1,
        )


class RoundPipeBase(nn.Module):
    """What every RoundPipe wrapper shares: the wrapped module and its layers, the master
    copies and their gradients, the asynchronous step, ``synchronize()``, the device pool
    and attribute fall-through to the original model. The arguments are ``RoundPipe``'s.
    """

    def __init__(
        self,
        model: nn.Module,
        optim_dtype: torch.dtype | None = None,
        name: str | None = None,
        pin_model: PinMode | str = PinMode.ALLOC,
        devices: Any = None,
        original_model: Any = None,
        master_owner: RoundPipeBase | None = None,
        shared_masters: bool | None = None,
        offload_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"RoundPipe wraps an nn.Module (ideally nn.Sequential), got {type(model).__name__}"
            )
        if isinstance(model, RoundPipeBase):
            raise TypeError("this model is already wrapped in RoundPipe")
        pin = parse_kind(PinMode, pin_model, "pin_model")
        if optim_dtype is not None and not (
            isinstance(optim_dtype, torch.dtype) and optim_dtype.is_floating_point
        ):
            raise TypeError(
                f"optim_dtype must be a floating torch.dtype such as torch.float32, got {optim_dtype!r}"
            )
        check_flag(shared_masters, "shared_masters", none="the pool's default")
        if master_owner is not None and not isinstance(master_owner, RoundPipeBase):
            raise TypeError(f"master_owner must be a RoundPipe, got {type(master_owner).__name__}")
        self.model = model
        layers = list(model.children()) if isinstance(model, nn.Sequential) else [model]
        if not layers:
            raise ValueError("the nn.Sequential is empty; give it at least one layer")
        check_not_compiled_in_place(layers)
        for i, layer in enumerate(layers):
            # refuses a plain attribute requiring grad: its device copy's gradient is lost
            carried_tensors(layer, f"layer {i}")
        check_no_post_accumulate_hooks(model.named_parameters())
        check_not_on_meta(model)
        if master_owner is None:
            claim_parameters(model, None)  # before any thread or memory is taken
        object.__setattr__(self, "layers", layers)
        object.__setattr__(
            self, "_original_model", original_model if original_model is not None else model
        )
        self.name = name or type(model).__name__
        self.pin_model = pin
        self.optim_dtype = optim_dtype or next(
            (p.dtype for p in model.parameters() if p.is_floating_point()),
            torch.get_default_dtype(),
        )
        if offload_dir is not None:  # (before any thread is started)
            shared_masters = check_offload_args(offload_dir, shared_masters, master_owner is None)
        object.__setattr__(
            self, "pool", devices if isinstance(devices, DevicePool) else DevicePool(devices)
        )
        pin_handle = None
        if self.pool.is_cuda:
            # pinned host memory makes uploads asynchronous; "register" must be undone at close
            pin_handle = memory.pin_model(model, pin)

        self._shared_by_default = shared_masters is None
        if shared_masters is None:
            # shared on CPU workers (the synchronous step is faster on the host's cores they
            # compute on); separate on GPUs, for the async step
            shared_masters = not self.pool.concurrent
        self.masters = MasterWeights(
            model,
            self.optim_dtype,
            create=master_owner is None,
            share=shared_masters,
            values=offload_dir is None,
        )
        self.shared_masters = shared_masters
        self.disk_tier = None
        if offload_dir is not None:
            try:
                self.disk_tier = DiskTier(offload_dir, self.masters, layers, self.name)
            except BaseException:
                # (no space, an IO error): the pool's threads started above end here
                if not isinstance(devices, DevicePool):
                    self.pool.close()
                if pin_handle is not None:
                    pin_handle.release()
                raise
        self._warned_sync_step = False
        self._idle = IdleSteps(self.name)
        object.__setattr__(self, "_master_owner", master_owner)
        # the optimizer side (thread, weight versions, overlapped iterations): one owner
        self._grad_hooks: list[Callable[[list[nn.Parameter]], None]] = []
        self._steps = StepOwner(
            self.name,
            layers,
            self.masters,
            intra_op_threads=self.pool.optimizer_threads(),
            grad_hooks=self._grad_hooks,
        )
        self._call_lock = threading.RLock()  # issues one call at a time
        # (start, end) of the latest optimizer steps for last_trace(): a few cover the last call
        self._step_spans: deque[tuple[float, float]] = deque(maxlen=8)
        self._closer = weakref.finalize(
            self,
            release_roundpipe,
            self.name,
            self.pool,
            not isinstance(devices, DevicePool),
            self._steps,
            pin_handle,
        )
        if master_owner is None:
            claim_parameters(model, self)

    # -- attribute fall-through --------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            original = self.__dict__.get("_original_model")
            if original is None:
                raise
            return getattr(original, name)

    def _is_own(self, name: str) -> bool:
        d = self.__dict__
        return (
            "_rp_sealed" not in d
            or name in d
            or hasattr(type(self), name)
            or any(name in d.get(k, {}) for k in ("_parameters", "_buffers", "_modules"))
        )

    def __setattr__(self, name: str, value: Any) -> None:
        """Writes of names RoundPipe does not have go to the original model (like reads)."""
        if self._is_own(name):
            super().__setattr__(name, value)
        else:
            setattr(self.__dict__["_original_model"], name, value)

    def __delattr__(self, name: str) -> None:
        if self._is_own(name):
            super().__delattr__(name)
        else:
            delattr(self.__dict__["_original_model"], name)

    def _seal(self) -> None:
        """End of construction: from now on unknown attribute writes fall through."""
        object.__setattr__(self, "_rp_sealed", True)

    def set_original_model(self, original_model: Any) -> None:
        """Make attribute reads and writes RoundPipe does not handle fall through to
        ``original_model`` (a preset passes the Hugging Face model it converted)."""
        if original_model is None:
            raise TypeError("set_original_model needs a model, got None")
        object.__setattr__(self, "_original_model", original_model)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_devices(self) -> int:
        return len(self.pool)

    # -- parameters ----------------------------------------------------------------
    def optim_parameters(self) -> list[nn.Parameter]:
        """The master copies the optimizer updates (trainable parameters only); with
        ``shared_masters=True``, the module's own parameters where they are their master."""
        return self.masters.params()

    def optim_named_parameters(
        self, prefix: str = "", remove_duplicate: bool = True
    ) -> list[tuple[str, nn.Parameter]]:
        """``(name, master)`` of the trainable parameters, named as in the wrapped module.

        Args:
            prefix: prepended to every name (``"prefix.name"``).
            remove_duplicate: list a parameter shared by several modules once (else under
                each of its names).
        """
        out = []
        for pname, p in self.model.named_parameters(
            prefix=prefix, remove_duplicate=remove_duplicate
        ):
            m = self.masters.master_of.get(id(p))
            if m is not None:
                out.append((pname, m))
        return out

    def master_param(self, param: torch.Tensor) -> nn.Parameter | None:
        """The master copy of one of the model's parameters (None if it is frozen)."""
        return self.masters.master_of.get(id(param))

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        if _OPTIM_CTX.depth > 0:
            return iter(self.optim_parameters())
        return super().parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        if _OPTIM_CTX.depth > 0:
            return iter(self.optim_named_parameters())
        return super().named_parameters(*args, **kwargs)

    # -- gradients -----------------------------------------------------------------
    def _home(self) -> RoundPipeBase:
        """The RoundPipe whose masters receive this one's gradients."""
        owner = self._master_owner
        return owner._home() if owner is not None else self

    def _fold_grads(self, buffer: GradBuffer) -> None:
        """Add a finished call's buffered gradients to the home's masters' ``.grad``
        (``StepOwner.fold``: after the step in flight, which reads and clears them)."""
        self._home()._steps.fold(buffer)

    def register_grad_hook(self, hook: Callable[[list[nn.Parameter]], None]) -> Callable[[], None]:
        """Call ``hook(masters)`` as soon as those master gradients are complete for the
        current pipelined call: on a worker thread while later stages still compute (a
        data-parallel reducer starts early), or on the optimizer thread right after a
        step in flight. Returns a function that removes the hook.
        """
        self._grad_hooks.append(hook)
        return lambda: self._grad_hooks.remove(hook) if hook in self._grad_hooks else None

    def _check_param_hooks(self) -> None:
        """At each training call: refuse a post-accumulate gradient hook registered since
        wrapping (:func:`~roundpipe_core.checks.check_no_post_accumulate_hooks`)."""
        masters = self._home().masters
        if any(map(_POST_HOOKS, chain.from_iterable(masters.hooked_by.values()))):
            check_no_post_accumulate_hooks((n, t) for n, p, m in masters.entries for t in (p, m))

    # -- optimizer step ---------------------------------------------------------------
    def step(
        self, step_fn: Callable[..., Any], is_async: bool = True, *args: Any, **kwargs: Any
    ) -> None:
        """Run ``step_fn(*args, **kwargs)`` (e.g. ``lambda: (opt.step(), opt.zero_grad())``)
        on the master copies on the optimizer thread, then copy the masters into the model.

        With ``is_async=True`` it returns at once and the next call overlaps with the
        update; the new weights enter the model at the next ``step()`` / ``synchronize()``,
        so each iteration computes with weights one step stale (as upstream RoundPipe).
        The optimizer thread makes that copy ahead of the update; the next call waits for
        each layer's copy just before uploading it.

        With a parameter that is its own master (``shared_masters``) every step is
        synchronous, as it writes the weights devices read: ``is_async=True`` runs as
        ``False``, said once.

        After ``forward_backward(blocking=False)`` calls whose gradients are not in
        ``.grad`` yet, the step is deferred (this call does not wait) until they are
        complete -- the same math as the blocking loop.

        Raises:
            TypeError: ``step_fn`` is not callable.
            ValueError: ``is_async=True`` while masters are released (a sharded host state).
            RuntimeError: this RoundPipe is closed.
        """
        if not callable(step_fn):
            raise TypeError(f"step_fn must be callable, got {type(step_fn).__name__}")
        check_flag(is_async, "is_async")
        self._check_open("step()")
        if self._home().disk_tier is not None:
            raise ValueError(STEP_UNSUPPORTED)
        is_async = self._async_allowed(is_async)
        fn = functools.partial(step_fn, *args, **kwargs) if args or kwargs else step_fn
        fn = self._timed_step(self._idle.watch(fn, self._home().masters))
        self._steps.step(fn, is_async, self._may_publish_in_background(), settle=self._settle)

    def _timed_step(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        """``fn`` noting the (start, end) of each of its runs for ``last_trace()``."""
        spans = self._step_spans

        def timed() -> Any:
            start = time.perf_counter()
            try:
                return fn()
            finally:
                spans.append((start, time.perf_counter()))

        return timed

    def _convert_grads_on_add(self) -> bool:
        """``GradBuffer(convert_on_add)``: on CPU workers, unless the masters are on disk
        (the tier keeps model-dtype gradients, half the bytes, until a part is stepped)."""
        return self.pool.cuda_workers == 0 and self._home().disk_tier is None

    def _may_publish_in_background(self) -> bool:
        """Whether an asynchronous ``step()`` may leave the copy of the previous step's
        weights to the optimizer thread: only where the blocking calls wait for it."""
        return False

    @property
    def uploads_lend_parameters(self) -> bool:
        """Whether every upload computes on the host's parameters instead of copying them
        (``Worker.lends_host_tensors``); the planner counts them as free on the device."""
        workers = self.pool.workers
        return bool(workers) and all(w.lends_host_tensors for w in workers)

    def _async_allowed(self, is_async: bool) -> bool:
        """``is_async``, unless a master is shared (said once: a warning where
        ``shared_masters=True`` was passed, an info log where the pool's default chose it);
        refused while masters are released (``MasterWeights.sync_only``: a sharded host state)."""
        if is_async and self._home().masters.sync_only:
            raise ValueError(self._home().masters.sync_only)
        if is_async and self._home().masters.num_shared:
            if not self._warned_sync_step:
                self._warned_sync_step = True
                why = (
                    "on CPU workers (they compute on the cores an overlapped step would take; "
                    "the masters are the model's own weights, shared_masters=None)"
                    if self._shared_by_default
                    else "because shared_masters=True (the optimizer updates the weights "
                    "devices read, in place)"
                )
                msg = (
                    f"RoundPipe {self.name!r}: step(is_async=True) is synchronous {why}; pass "
                    "shared_masters=False for an asynchronous, one-step-stale step"
                )
                if self._shared_by_default:
                    _log.info("%s", msg)
                else:
                    warnings.warn(msg, UserWarning, stacklevel=3)
            return False
        return is_async

    def step_layerwise(
        self,
        step_params: Callable[[list[nn.Parameter]], Any],
        finish: Callable[[], Any] | None = None,
        is_async: bool = True,
    ) -> None:
        """``step()``, taken parameter by parameter as their gradients complete.

        ``step_params(masters)`` must update exactly the given masters from their
        ``.grad`` -- e.g. :func:`roundpipe_core.stepping.layerwise.step_subset` of an Adam or
        SGD (:func:`~roundpipe_core.stepping.layerwise.steps_elementwise` says which
        optimizers give the same result stepped in parts) -- and ``finish()`` runs once
        all are stepped (e.g. ``zero_grad``). After non-blocking calls the optimizer
        thread steps the deepest layers while the backward still runs on the first ones;
        otherwise it is one ``step_params(all masters)`` and ``finish()``. The result and
        errors are those of ``step()``.

        Raises:
            TypeError: ``step_params`` or ``finish`` is not callable.
            RuntimeError: this RoundPipe is closed.
        """
        if not callable(step_params):
            raise TypeError(f"step_params must be callable, got {type(step_params).__name__}")
        if finish is not None and not callable(finish):
            raise TypeError(f"finish must be callable or None, got {type(finish).__name__}")
        check_flag(is_async, "is_async")
        self._check_open("step_layerwise()")
        tier = self._home().disk_tier
        if tier is not None:
            step_params = tier.streamed(step_params)
        is_async = self._async_allowed(is_async)
        self._steps.step_layerwise(
            step_params,
            finish,
            is_async,
            self._may_publish_in_background(),
            self._timed_step,
            settle=self._settle,
        )

    def after_step(self, fn: Callable[[], Any]) -> None:
        """Run ``fn()`` -- typically an optimizer's ``zero_grad`` called outside
        ``step_fn`` -- in program order with the asynchronous step: after the step queued
        by ``step()`` has run (on the optimizer thread; this call does not wait), at once
        when none is in flight. Clearing ``.grad`` directly while a step runs would race
        with it. Its error is raised by the next ``synchronize()`` or blocking call.

        Raises:
            TypeError: ``fn`` is not callable.
            RuntimeError: this RoundPipe is closed.
        """
        if not callable(fn):
            raise TypeError(f"after_step needs a callable, got {type(fn).__name__}")
        self._check_open("after_step()")
        self._home()._steps.in_step_order(fn, self._settle)

    def last_trace(self) -> dict[str, Any]:
        """The last pipelined call's measured timeline as a Chrome trace-event object: a
        row per device (compute, uploads, transfers) and an ``optimizer`` row with the
        steps. Save it with :func:`roundpipe_core.running.trace.write_trace`.
        """
        return chrome_trace(spans_from_roundpipe(self))

    def _take_model_grads(self) -> None:
        """Hook for wrappers whose model parameters collect gradients themselves."""

    def wait_step(self) -> None:
        """Block until the step queued by ``step()`` (if any) has finished; its error, if
        any, is raised by ``synchronize()``. The masters are then safe to read."""
        self._check_not_reentrant("wait_step()")
        self._steps.wait_step()

    def synchronize(self) -> None:
        """Wait for everything in flight -- pipelined iterations and steps -- (re-raising
        an error), copy the masters into the model and show the accumulated gradients on
        the model's own parameters.

        Afterwards, as in upstream RoundPipe, each trainable parameter of the wrapped
        module holds the latest weights and its ``.grad`` the gradients accumulated since
        the last step (in the parameter's dtype), so an optimizer over the module's
        parameters works::

            opt = torch.optim.Adam(model.parameters())
            rp.forward_backward(...); rp.synchronize(); opt.step(); opt.zero_grad()

        At the next call, ``step()`` or ``synchronize()``, what was done to the module's
        ``.grad`` decides the masters' ``.grad``: set to None -> None; replaced or changed
        in place -> that tensor; untouched -> the masters' ``.grad`` stands. The module's
        ``.grad`` is then cleared again (a parameter that is its own master keeps its
        gradients in its ``.grad`` all the time).
        """
        self._check_not_reentrant("synchronize()")
        self._settle()
        self._home().masters.hand_grads_to_model()

    def _settle(self) -> None:
        """``synchronize()`` without showing the gradients on the model."""
        self._home().masters.take_back_grads()
        self._steps.settle()
        self._take_model_grads()

    # -- lifecycle ----------------------------------------------------------------------------
    def _check_not_reentrant(self, what: str) -> None:
        """Refuse a call that would wait for the thread it runs on (a deadlock)."""
        if self._home()._steps.on_optimizer_thread():
            raise RuntimeError(
                f"RoundPipe {self.name!r}: {what} was called inside step_fn, on the optimizer "
                "thread, and would wait for that thread itself (a deadlock). Call it after "
                "step() returns; work that must follow the step can use after_step(fn)"
            )
        if self.pool.on_worker_thread():
            raise RuntimeError(
                f"RoundPipe {self.name!r}: {what} was called on one of its own worker threads "
                "(inside loss_fn, a layer's forward or a hook), and would wait for the workers "
                "that run it (a deadlock). Compute it outside the call, e.g. after "
                "forward_backward returns"
            )

    def _check_open(self, what: str = "this call") -> None:
        self._check_not_reentrant(what)
        self._steps.check_open()

    def close(self) -> None:
        """Finish the pending step and stop this RoundPipe's threads. Safe to call twice."""
        if self._steps.closed:
            return
        try:
            self.synchronize()
        finally:
            # the queue is empty after synchronize(): the thread ends at once; the bound
            # only matters when synchronize() raised with work still queued
            self._steps.shutdown(timeout=_CLOSE_JOIN_S)
            self._closer()
            if self.disk_tier is not None:
                self.disk_tier.close()
