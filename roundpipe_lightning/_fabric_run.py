"""One module set up by :class:`~roundpipe_lightning.RoundPipeFabricStrategy`: its
RoundPipe, the calls ``fabric.setup()``'s module gains, and its optimizers' gradients.

Fabric returns a ``_FabricModule`` whose ``forward`` runs the strategy's module (the
RoundPipe) and whose other attributes are looked up on the module the user passed to
``fabric.setup()``. So the RoundPipe calls are put on that module, as plain functions
(Fabric wraps *bound methods* found there in a tracker that reports any submodule call
as bypassing the strategy -- these calls *are* the strategy's path):

* ``forward_backward(...)``: ``RoundPipe.forward_backward`` under the precision
  plugin's input conversion and forward context (autocast for ``bf16-mixed``);
* ``synchronize()``: ``RoundPipe.synchronize`` (the module's weights are then current);
* ``roundpipe``: the RoundPipe itself (plans, timer, ``last_trace()``).

and its ``state_dict()`` synchronizes first (a state-dict pre-hook), so it holds the
weights of every step queued so far.

They are removed again at the strategy's ``teardown()``.

Gradients: the optimizer steps the fp32 master copies, and its step, queued on
RoundPipe's optimizer thread, clears their gradients right after the update (a
``zero_grad()`` on the main thread would race with a step still running). So
``optimizer.zero_grad()`` only clears what no queued step will: gradients produced
after the last step (``forward_backward`` or ``fabric.backward`` since then), after
waiting for everything in flight. Fabric's optimizer wrapper finds ``zero_grad`` on
the class of what it wraps, so it wraps a view of the user's optimizer whose class
has this ``zero_grad`` (:func:`roundpipe_lightning._private.optimizer_view`); the
user's own object gets it too, as an instance attribute.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from lightning.fabric.plugins import Precision
from torch import Tensor, nn
from torch.optim import Optimizer

from roundpipe_core import AutoRoundPipe, RoundPipe
from roundpipe_core import distributed as D

from ._private import optimizer_view, replace_zero_grad, restore_zero_grad
from .checkpoint_io import CHECKPOINT_FORMAT, check_roundpipe_section, restore_learned
from .sharded_checkpoint import load_optimizer_state, of_optimizer, sharded_masters

__all__ = ["FabricRun", "CALLS"]

#: the attributes ``fabric.setup()``'s module gains
CALLS = ("forward_backward", "synchronize", "roundpipe")


class FabricRun:
    """A set-up module (see the module docstring).

    Args:
        rp: the RoundPipe wrapping ``module`` (or its preset conversion).
        module: what was passed to ``fabric.setup()``; its state dict is the checkpoint's.
        precision: the Fabric precision plugin (read at each call).
        dp: its data parallel over the nodes (no-ops in one process): the gradient
            reducers of its optimizers and, with ``shard_host_state``, their shards.
    """

    @staticmethod
    def check_free(module: nn.Module) -> None:
        """Refuse a module that has one of the RoundPipe calls already (set up before)."""
        clash = [name for name in CALLS if hasattr(module, name)]
        if clash:
            raise ValueError(
                f"{type(module).__name__} already has {', '.join(map(repr, clash))}: "
                "RoundPipeFabricStrategy gives the module passed to fabric.setup() the attributes "
                f"{', '.join(CALLS)}. Rename yours, and set each module up once."
            )

    def __init__(
        self,
        rp: RoundPipe | AutoRoundPipe,
        module: nn.Module,
        precision: Callable[[], Precision],
        dp: D.DataParallel,
    ) -> None:
        self.check_free(module)
        self.rp = rp
        self.module = module
        self.precision = precision
        self.dp = dp
        #: optimizers (by id) whose gradients were reduced over the nodes since their step
        self.reduced: set[int] = set()
        #: gradients were produced after the last queued step (which clears its own)
        self.grads_fresh = False
        self.optimizers: list[Optimizer] = []
        self.real_zero_grad: dict[int, Callable[..., None]] = {}
        # the losses forward_backward returned: already backpropagated
        self._losses: weakref.WeakValueDictionary[int, Tensor] = weakref.WeakValueDictionary()

        @functools.wraps(rp.forward_backward)
        def forward_backward(
            input_args: Any = (), input_kwargs: Any = None, *a: Any, **kw: Any
        ) -> Any:
            if isinstance(rp, AutoRoundPipe):
                raise TypeError(
                    f"{type(module).__name__} is not an nn.Sequential and no preset converts "
                    "it, so it runs split automatically (AutoRoundPipe), which has no "
                    "forward_backward: compute the loss from out = model(x) and call "
                    "fabric.backward(loss), or give fabric.setup() an nn.Sequential"
                )
            self.check_not_reduced()
            plugin = self.precision()
            input_args, input_kwargs = plugin.convert_input((input_args, input_kwargs))
            with plugin.forward_context():
                out = rp.forward_backward(input_args, input_kwargs, *a, **kw)
            self.grads_fresh = True
            self._remember(out[0] if kw.get("return_outputs") else out)
            return out

        @functools.wraps(rp.synchronize)
        def synchronize() -> None:
            rp.synchronize()

        # ``model.state_dict()`` / ``net.state_dict()`` hold the weights of every step queued
        # so far (with async_step=True the module's own tensors lag one step behind)
        self._state_dict_hook = module.register_state_dict_pre_hook(
            lambda *_args, **_kwargs: rp.synchronize()
        )

        for name, value in zip(CALLS, (forward_backward, synchronize, rp)):
            # not nn.Module.__setattr__: the RoundPipe must not become a submodule (its
            # parameters would enter the module's state dict a second time)
            object.__setattr__(module, name, value)

    # -- losses -----------------------------------------------------------------------------
    def _remember(self, loss: Any) -> None:
        if isinstance(loss, Tensor):
            self._losses[id(loss)] = loss
        elif isinstance(loss, (tuple, list)):
            for item in loss:
                self._remember(item)

    def returned(self, tensor: Tensor) -> bool:
        """Whether ``forward_backward`` returned ``tensor`` (its backward already ran)."""
        return self._losses.get(id(tensor)) is tensor

    # -- optimizers -------------------------------------------------------------------------
    def holds(self, optimizer: Optimizer) -> bool:
        """Whether ``optimizer`` has parameters of this module (or their masters)."""
        ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
        mine = {id(p) for p in self.rp.model.parameters()}
        mine |= {id(m) for m in self.rp.optim_parameters()}
        return bool(ids & mine)

    def adopt(self, optimizer: Optimizer) -> Optimizer:
        """``optimizer`` (already pointed at the masters) steps this module; its
        ``zero_grad`` becomes :meth:`zero_grad`'s policy. Returns the view of it that
        Fabric wraps (see the module docstring)."""
        real = type(optimizer).zero_grad.__get__(optimizer)
        policy = functools.partial(self.zero_grad, real)
        replace_zero_grad(optimizer, policy)
        view = optimizer_view(optimizer, policy)
        self.optimizers.append(optimizer)
        self.real_zero_grad[id(optimizer)] = real
        return view

    def owns(self, optimizer: Any) -> Optimizer | None:
        """The user's optimizer of which ``optimizer`` is the view (or itself), if adopted."""
        for opt in self.optimizers:
            if optimizer is opt or getattr(optimizer, "__dict__", None) is vars(opt):
                return opt
        return None

    def step_queued(self) -> None:
        """A step was queued: it clears the gradients there are now."""
        self.grads_fresh = False
        self.reduced.clear()

    # -- several nodes ----------------------------------------------------------------------
    def reduce(self, optimizer: Optimizer) -> None:
        """Reduce ``optimizer``'s master gradients over the nodes, once per step (at
        ``opt.step()``, or at ``fabric.clip_gradients`` before it). Collective; a no-op in
        one process."""
        if self.dp.world_size == 1 or id(optimizer) in self.reduced:
            return
        self.rp.synchronize()  # pending iterations' gradients are in; the last step is done
        self.dp.reduce(optimizer)
        self.reduced.add(id(optimizer))

    def check_not_reduced(self) -> None:
        """Refuse new gradients once this step's were reduced over the nodes (they would
        miss the reduction)."""
        if self.reduced:
            raise RuntimeError(
                "RoundPipeFabricStrategy: this step's gradients were already reduced over the "
                "nodes (by fabric.clip_gradients); run every backward of the step first, then "
                "clip, then opt.step()"
            )

    def sharding(self, optimizer: Any) -> D.HostShard | None:
        """The shard of ``optimizer`` (the user's, or the view Fabric wraps) when its state
        is sharded over several nodes, else None."""
        raw = self.owns(optimizer)
        return self.dp.shard(raw) if raw is not None else None

    def clip_sharded(
        self, optimizer: Any, max_norm: float, norm_type: float, error_if_nonfinite: bool
    ) -> Tensor:
        """Clip a sharded ``optimizer``'s (reduced) gradients by the norm over every
        node's share (collective). Returns the total norm."""
        shard = self.sharding(optimizer)
        assert shard is not None
        norm = shard.clip_grad_norm_(float(max_norm), float(norm_type))
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(
                f"The total norm of order {float(norm_type)} for gradients is non-finite, so "
                "it cannot be clipped (the gradients were scaled by it on every node)"
            )
        return norm

    def save_shard(self, directory: Any, optimizer: Any) -> None:
        """Sharded: write this node's share of ``optimizer``'s state (and its masters)
        into ``directory``. Unsharded: nothing (the state is in the checkpoint file)."""
        raw, shard = self.owns(optimizer), self.sharding(optimizer)
        if raw is not None and shard is not None:
            named = of_optimizer(self.named_masters(), raw)
            D.save_shard(directory, named, raw, shard.owns, shard.rank, shard.world_size)

    def load_optimizer(self, directory: Any, optimizer: Any, state: Any) -> None:
        """Restore ``optimizer`` from the checkpoint's ``state``: a state dict, or the
        marker of shards in ``directory`` (any node count); sharded, this node keeps
        what it owns now."""
        load_optimizer_state(
            directory, self.owns(optimizer), state, self.sharding(optimizer), self.named_masters()
        )

    def zero_grad(self, real: Callable[..., None], set_to_none: bool = True) -> None:
        """Clear the master gradients no queued step will clear (see the module docstring)."""
        if not self.grads_fresh:
            return
        self.rp.synchronize()  # nothing in flight: a pending iteration's gradients are in
        real(set_to_none=set_to_none)
        self.grads_fresh = False
        self.reduced.clear()

    # -- checkpoints ------------------------------------------------------------------------
    def named_masters(self) -> dict[str, nn.Parameter]:
        """The module's parameter name -> its master (what the optimizers step)."""
        return {name: m for name, _, m in self._named_masters()}

    def _named_masters(self) -> list[tuple[str, nn.Parameter, nn.Parameter]]:
        out = []
        for name, p in self.module.named_parameters():
            m = self.rp.master_param(p)
            if m is not None:
                out.append((name, p, m))
        return out

    def section(self) -> dict[str, Any]:
        """What a checkpoint holds beyond the module's state dict, in the layout of
        ``RoundPipeStrategy``'s ``checkpoint["roundpipe"]``: the masters whose dtype
        differs from their parameter's (fp32 masters of a bf16 module), the layer
        timer and which stages draw random numbers; those of a sharded optimizer are in its shards instead (each in its owner's).
        Call after ``synchronize()``."""
        in_shards = sharded_masters(self.dp, self.optimizers)
        masters = {
            n: m.detach()
            for n, p, m in self._named_masters()
            if m.dtype != p.dtype and id(m) not in in_shards
        }
        section: dict[str, Any] = {"format": CHECKPOINT_FORMAT, "masters": masters}
        if isinstance(self.rp, RoundPipe):  # (an AutoRoundPipe has no layer timer)
            section["timer"] = self.rp.model_timer.state_dict()
            section["draws"] = self.rp.pool.learned_draws(self.rp.layers)
        return section

    def load_state(self, state_dict: Mapping[str, Any], strict: bool) -> None:
        """Load the module's weights and make the masters equal to them."""
        self.rp.synchronize()
        self.module.load_state_dict(state_dict, strict=strict)
        released = self.rp.masters.released  # another node's share: its shard restores it
        with torch.no_grad():
            for _, p, m in self._named_masters():
                if m is not p and id(m) not in released:  # (a shared one: loaded already)
                    m.copy_(p)
                m.grad = None
        self.grads_fresh = False

    def load_section(self, section: Any, strict: bool) -> None:
        """Restore the masters saved with a higher precision than the module's weights,
        and what the RoundPipe learned: the layer timer and the stages' draws (after
        :meth:`load_state`)."""
        params = {name: p for name, p, _ in self._named_masters()}
        saved = check_roundpipe_section(section, params, strict=strict)
        with torch.no_grad():
            for name, _, m in self._named_masters():
                if name in saved:
                    m.copy_(saved[name])
        if isinstance(self.rp, RoundPipe):
            restore_learned(self.rp, section or {})

    # -- end --------------------------------------------------------------------------------
    def close(self) -> None:
        """Finish what is in flight, stop the RoundPipe's threads, take the installed
        calls off the module and give the optimizers their own ``zero_grad`` back."""
        self._state_dict_hook.remove()
        try:
            self.rp.close()
        finally:
            for name in CALLS:
                if name in vars(self.module):
                    object.__delattr__(self.module, name)
            for opt in self.optimizers:
                restore_zero_grad(opt)
            self.optimizers.clear()
