"""Parameter upload, gradient download and accumulation.

A stage is uploaded by filling the parameter and buffer slots of a worker's
parameter-less copy (skeleton) of each of its layers with device copies of the host
tensors. After the stage ran for every microbatch its gradients (summed over them by
autograd) are downloaded once and handed to the masters' accumulator, buffers a real
forward wrote are copied back, and the device copies are dropped. Every backend runs
this code: only the ``Worker`` primitives differ. What every upload of a stage does
is worked out once per worker, stage and skeleton slot (a stage layout) and checked
against the host modules once per call, so that a job costs its copies and little else.
"""

from __future__ import annotations

import copy
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from ..planning.schedule import Job
from .buffer_fences import reading_buffers, write_back
from .carried import CarriedState, attribute_tensors
from .devices.base import Worker

__all__ = [
    "GradSink",
    "GradSinkMany",
    "WeightGate",
    "batched_sink",
    "StageReplica",
    "download_grads",
    "release_stage",
    "upload_job",
    "upload_stage",
    "write_back_buffers",
]

GradSink = Callable[[torch.Tensor, torch.Tensor], None]
"""Called as ``sink(host_param, host_grad)`` for each downloaded gradient."""
GradSinkMany = Callable[[list[torch.Tensor], list[torch.Tensor]], None]
"""Called as ``sink_many(host_params, host_grads)`` with a job's gradients at once."""


def batched_sink(sink: GradSink) -> GradSinkMany:
    """The one-call-per-job form of ``sink``: the ``add_many(params, grads)`` of the object
    whose bound ``add`` it is (``pipelined.GradBuffer``), else a loop over ``sink``."""
    many = getattr(getattr(sink, "__self__", None), "add_many", None)
    if callable(many) and getattr(sink, "__name__", None) == "add":
        return many

    def each(params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        for p, g in zip(params, grads):
            sink(p, g)

    return each


class StageReplica:
    """The layers of one job on one worker: ``modules``, the replicas in layer order;
    ``held``, the device tensors in their slots (parameters wrapped so that gradients
    land on them); ``param_tensors``, what the uploads returned (released by
    :func:`release_stage`); ``lent``, a lock held until release by a stage computing on
    host weights a newer version may replace (:func:`upload_job`)."""

    __slots__ = ("worker", "layout", "held", "param_tensors", "modules", "aliases_host", "lent")

    def __init__(
        self,
        worker: Worker,
        layout: _StageLayout,
        held: list[torch.Tensor],
        param_tensors: list[torch.Tensor],
    ) -> None:
        self.worker = worker
        self.layout = layout
        self.held = held
        self.param_tensors = param_tensors
        self.modules: list[nn.Module] = layout.modules
        self.aliases_host = False  # some device tensor is a host tensor itself (lent)
        self.lent: threading.Lock | None = None

    def layer(self, index: int) -> nn.Module:
        """The replica of model layer ``index`` (``KeyError`` if not in this stage)."""
        return self.modules[self.layout.position[index]]


_SYNCED_TYPES = (bool, int, float, str, type(None))


def _signature(m: nn.Module) -> tuple:
    """Changes when a submodule or tensor of ``m`` is added, removed or replaced (read
    from its tables, without walking the tree)."""
    return (
        tuple(map(id, m._modules.values())),
        tuple(map(id, m._parameters.values())),
        tuple(map(id, m._buffers.values())),
    )


_MISSING = object()
# the types of nn.Module's own tables (parameters, buffers, submodules, hooks): never synced
_TABLES = frozenset({dict, OrderedDict, set})
# the attribute names of those tables
_MODULE_TABLES = frozenset(k for k, v in nn.Module().__dict__.items() if type(v) in _TABLES)


def _synced(tree: _Tree) -> bool:
    """Whether ``tree``'s layer keeps the structure its skeleton was built from (nothing
    replaced, no attribute added or removed); if so, its replica now has the host's
    flags (``training``, dropout ``p``, ...)."""
    if tree.carried is not None and not tree.carried.current():
        return False
    for m, sig, host, size, rep, keys in tree.checks:
        if len(host) != size or sig != _signature(m):
            return False
        for k in keys:
            v = host.get(k, _MISSING)
            if rep.get(k, _MISSING) is not v:
                if v is _MISSING:
                    return False
                if isinstance(v, _SYNCED_TYPES):
                    rep[k] = v
    return True


class _Tree:
    """A skeleton of ``layer``: ``replica``, a deep copy with meta placeholders for its
    parameters, buffers and the tensors its modules keep outside them (``carried.py``),
    shared tensors staying shared (``ValueError`` for a plain attribute that requires
    grad), to be filled by an upload; its host tensors in upload order, tied ones once."""

    def __init__(self, layer: nn.Module) -> None:
        memo: dict[int, object] = {}
        for p in layer.parameters(recurse=True):
            memo[id(p)] = nn.Parameter(
                torch.empty_like(p, device="meta"), requires_grad=p.requires_grad
            )
        for b in layer.buffers(recurse=True):
            memo[id(b)] = torch.empty_like(b, device="meta")
        for t in attribute_tensors(layer):
            memo.setdefault(id(t), torch.empty_like(t, device="meta"))
        self.replica = replica = copy.deepcopy(layer, memo)
        # per host module what one check reads: its signature, its __dict__ and size, the
        # replica's __dict__, the keys of the attributes that are not tables (flags to sync)
        self.checks = [
            (
                m,
                _signature(m),
                m.__dict__,
                len(m.__dict__),
                r.__dict__,
                tuple(k for k in m.__dict__ if k not in _MODULE_TABLES),
            )
            for m, r in zip(layer.modules(), replica.modules())
        ]
        self.source_list: list[torch.Tensor] = []
        self.is_param: list[bool] = []
        # where each upload puts its tensors: the replica modules' own tables, found once
        self.fills: list[tuple[dict[str, Any], str, int]] = []
        pos: dict[int, int] = {}
        for (_, orig), (_, rep) in zip(
            layer.named_modules(remove_duplicate=False),
            replica.named_modules(remove_duplicate=False),
        ):
            for table, is_param in ((orig._parameters, True), (orig._buffers, False)):
                into = rep._parameters if is_param else rep._buffers
                for name, t in table.items():
                    if t is None:
                        continue
                    i = pos.setdefault(id(t), len(self.source_list))
                    if i == len(self.source_list):
                        self.source_list.append(t)
                        self.is_param.append(False)
                    self.is_param[i] = self.is_param[i] or is_param
                    self.fills.append((into, name, i))
        # what the layer keeps outside its parameters and buffers (quant states): uploaded
        # after them, rebuilt into the replica on every upload
        carried = CarriedState(layer, replica, self.source_list)
        self.carried: CarriedState | None = None if carried.empty else carried
        self.num_sources = len(self.source_list)
        if self.carried is not None:
            self.carried.mark_replica()
            self.source_list.extend(self.carried.tensors)
            self.is_param.extend(False for _ in self.carried.tensors)
        self.epoch: object = None  # the stretch of uploads that last checked and synced it


def _skeleton_for(worker: Worker, layer: nn.Module, slot: int, epoch: object = None) -> _Tree:
    """The worker's cached skeleton of ``layer``, two per layer (``slot`` 0/1: the running
    and the prefetched stage never share modules), checked against the host module and
    synced to its flags once per ``epoch`` (:func:`upload_stage`; ``None``: every time)."""
    cache = worker.skeletons
    key = (id(layer), slot)
    hit = cache.get(key)
    if hit is not None and epoch is not None and hit[1].epoch is epoch and hit[0] is layer:
        return hit[1]
    if hit is None or hit[0] is not layer or not _synced(hit[1]):
        hit = (layer, _Tree(layer))
        cache[key] = hit  # a fresh deep copy: its flags are the host's already
    hit[1].epoch = epoch
    return hit[1]


class _StageLayout:
    """What every upload of one stage in one skeleton slot does, worked out once: the
    replica modules, the host tensors to copy (tied weights once), which become
    parameters and take gradients, where each lands. Rebuilt with a layer's skeleton;
    flags re-read once per epoch (a parameter frozen between calls stops taking grads)."""

    def __init__(
        self,
        layers: Sequence[nn.Module],
        indices: Sequence[int],
        trees: Sequence[_Tree],
    ) -> None:
        self.layers = list(layers)
        self.trees = list(trees)
        self.modules = [tree.replica for tree in trees]
        self.position = {idx: k for k, idx in enumerate(indices)}
        self.sources: list[torch.Tensor] = [t for tree in trees for t in tree.source_list]
        self.fills: list[tuple[dict[str, Any], str, int]] = []
        is_param: list[bool] = []
        carried_pos: set[int] = set()
        # per layer with carried state: it, and where its sources and its extras start
        self.carried: list[tuple[CarriedState, int, int, int]] = []
        for tree in self.trees:
            base = len(is_param)
            is_param.extend(tree.is_param)
            self.fills.extend((table, name, base + i) for table, name, i in tree.fills)
            if tree.carried is not None:
                end = base + len(tree.source_list)
                self.carried.append((tree.carried, base, base + tree.num_sources, end))
                carried_pos.update(range(base + tree.num_sources, end))
        self._is_param = is_param
        # carried tensors are the layer's own constants, never written back
        self.buffer_pos = [i for i, p in enumerate(is_param) if not p and i not in carried_pos]
        self.wrap: list[bool | None] = []
        self.grad_pos: list[int] = []
        self.epoch: object = None
        self.refresh()

    def refresh(self) -> None:
        """Re-read ``wrap`` (None for a buffer, else its parameter's ``requires_grad``)
        and ``grad_pos`` (the parameters whose gradients are downloaded)."""
        wrap = [src.requires_grad if p else None for src, p in zip(self.sources, self._is_param)]
        if wrap == self.wrap:
            return
        self.wrap = wrap
        self.grad_pos = [
            i
            for i, (src, w) in enumerate(zip(self.sources, self.wrap))
            if w and isinstance(src, nn.Parameter)
        ]


# a worker's stage layouts beyond this many are dropped (re-planned stages leave old ones)
_MAX_LAYOUTS = 4096


def _stage_layout(
    worker: Worker,
    layers: Sequence[nn.Module],
    indices: Sequence[int],
    slot: int,
    epoch: object,
) -> _StageLayout:
    """The worker's cached layout of a stage, checked once per ``epoch`` through its
    layers' skeletons (:func:`_skeleton_for`), rebuilt if one of them was."""
    cache: dict[tuple, _StageLayout] = worker.stage_layouts
    key = (slot, *map(id, layers), *indices)
    layout = cache.get(key)
    if layout is not None and epoch is not None and layout.epoch is epoch:
        return layout
    trees = [_skeleton_for(worker, layer, slot, epoch) for layer in layers]
    # the key's ids name these very layers: the cached layout keeps them alive; trees
    # compare by identity (no __eq__)
    if layout is None or layout.trees != trees:
        if len(cache) >= _MAX_LAYOUTS:
            cache.clear()
        layout = _StageLayout(layers, indices, trees)
        cache[key] = layout
    else:
        layout.refresh()
    layout.epoch = epoch
    return layout


def upload_stage(
    worker: Worker,
    layers: Sequence[nn.Module],
    indices: Sequence[int],
    slot: int = 0,
    epoch: object = None,
    lend: bool = False,
) -> StageReplica:
    """Issue the upload of a stage's layers to ``worker`` (asynchronous on CUDA: compute
    waits with ``worker.wait_channel("param")``). ``slot`` (0/1) picks the skeleton
    copy: consecutive jobs of a worker alternate. ``epoch`` names a stretch of uploads
    during which the host modules do not change (one per worker queue of a call): a
    skeleton checked in it is used as is. With ``lend`` a backend whose memory is the
    host's computes on the parameters themselves (``Worker.lend_in``; ``aliases_host``
    says so), which then stay unchanged until the stage is released."""
    layout = _stage_layout(worker, layers, indices, slot, epoch)
    dev: list[torch.Tensor] = []
    buffers = [layout.sources[i] for i in layout.buffer_pos]
    try:
        with reading_buffers(worker, buffers):  # a write-back waits for these reads
            aliases = False
            # one upload per layer, as a failed upload must release the layers before it.
            # A stage only reads its parameters (``is_param``): a backend whose memory is
            # the host's may lend those (Worker.lend_in); buffers are copied, as a forward
            # may write them and its recompute must not write them twice
            for tree in layout.trees:
                chunk = tree.source_list
                if lend:
                    lent = worker.lend_in(chunk, tree.is_param)
                    aliases = aliases or any(
                        d.data_ptr() == h.data_ptr() != 0 for d, h in zip(lent, chunk)
                    )
                    dev.extend(lent)
                else:
                    dev.extend(worker.copy_in(chunk, "param"))  # every backend detaches
        if layout.carried:
            held = _carry(layout, dev)
        else:
            # Parameter wrappers replace the raw device tensors so grads land on them
            held = [t if w is None else _parameter(t, w) for t, w in zip(dev, layout.wrap)]
        for table, name, i in layout.fills:
            table[name] = held[i]
    except BaseException:
        # Layers uploaded before the failure would otherwise stay in the cached skeletons
        # and the ledger (device memory on CUDA) until those skeletons are next used.
        release_stage(StageReplica(worker, layout, [], dev))
        raise
    stage = StageReplica(worker, layout, held, dev)
    stage.aliases_host = aliases
    return stage


def _carry(layout: _StageLayout, dev: list[torch.Tensor]) -> list[Any]:
    """The held tensors of an upload whose layers carry state (``carried.py``): subclass
    parameters rebuilt around their device copies, carried attributes set."""
    subclass = {base + i for c, base, _, _ in layout.carried for i in c.param_pos}
    held: list[Any] = [
        t if w is None or i in subclass else _parameter(t, w)
        for i, (t, w) in enumerate(zip(dev, layout.wrap))
    ]
    for carried, base, extra, end in layout.carried:
        local = held[base:extra]
        build = carried.wrap_params(dev[base:extra], dev[extra:end], local, layout.wrap[base:extra])
        held[base:extra] = local
        carried.attach(build)
    return held


def _parameter(t: torch.Tensor, requires_grad: bool) -> nn.Parameter:
    """``t`` as an ``nn.Parameter``. A plain tensor the upload just made becomes the
    parameter itself (its class switched: all the constructor adds), without a second
    tensor object per parameter of every upload."""
    if type(t) is torch.Tensor:
        if requires_grad:
            t.requires_grad_(True)
        t.__class__ = nn.Parameter
        return t  # type: ignore[return-value]
    return nn.Parameter(t, requires_grad=requires_grad)


def download_grads(stage: StageReplica, sink_many: GradSinkMany) -> None:
    """Download the stage's gradients (``Worker.take_out``) to ``sink_many`` in one call."""
    held, sources = stage.held, stage.layout.sources
    pending_src: list[torch.Tensor] = []
    pending_dev: list[torch.Tensor] = []
    for i in stage.layout.grad_pos:
        g = held[i].grad
        if g is not None:
            pending_src.append(sources[i])
            pending_dev.append(g)
    if pending_dev:
        sink_many(pending_src, stage.worker.take_out(pending_dev))


def write_back_buffers(stage: StageReplica) -> None:
    """Copy buffers a real forward may have written (BatchNorm statistics) back to the host."""
    pos = stage.layout.buffer_pos
    if not pos:
        return
    sources, held = stage.layout.sources, stage.held
    host = stage.worker.copy_out([held[i] for i in pos])
    # not under another worker's upload of these buffers that has not read them yet
    write_back([sources[i] for i in pos], host)


def release_stage(stage: StageReplica) -> None:
    """Drop the device copies of a stage; the emptied skeletons stay cached."""
    stage.worker.release(stage.param_tensors, "param")
    for table, name, _ in stage.layout.fills:
        table[name] = None
    for carried, *_ in stage.layout.carried:
        carried.detach()
    stage.held = []
    stage.param_tensors = []
    lent, stage.lent = stage.lent, None  # (released once)
    if lent is not None:
        lent.release()


class WeightGate(Protocol):
    """Which weight version the host copy holds (``pipelined.WeightVersions``): an upload
    waits for the version it reads; a newer one is published after the older uploads'
    fences returned."""

    def wait_ready(
        self, reader: Any, layers: Sequence[int], failed: Callable[[], bool], block: bool = True
    ) -> bool: ...

    def uploaded(self, reader: Any, layers: Sequence[int], fence: Callable[[], None]) -> None: ...


def upload_job(
    run: Any, worker: Worker, job: Job, slot: int, wait: bool = True, epoch: object = None
) -> StageReplica | None:
    """Upload a job's layers for ``run`` (a ``runtime.PipelineRun``), once the host holds
    the weight version it reads; with ``wait=False`` (prefetch) None instead of
    waiting, so the current job is not held back by the next one's weights."""
    layers = list(job.layers)
    if run.weights is not None:
        if not run.weights.wait_ready(run.reader, layers, lambda: run.failed is not None, wait):
            return None
    # a host-memory backend computes on the host weights (a copy would hold the stage
    # twice in host memory): a newer version's publication then waits until the stage
    # is released, not only until the weights were read (the fence below)
    stage = upload_stage(worker, [run.layers[i] for i in layers], layers, slot, epoch, lend=True)
    if run.weights is not None:
        fence: Callable[[], None]
        if stage.aliases_host:
            stage.lent = threading.Lock()
            stage.lent.acquire()
            fence = _ReleaseFence(run, stage.lent)
        else:
            # the host copy of these layers may be overwritten once this upload has read it
            fence = worker.param_fence()
        run.weights.uploaded(run.reader, layers, fence)
    return stage


#: how often a publication waiting for a lent stage's release checks the run's failure
_RELEASE_WAIT_S = 0.05


class _ReleaseFence:
    """A fence until a stage computing on host weights is released, or its run failed.
    It holds the run weakly and says when it is ``settled()``: the fences of ended runs
    wait for the next publication, which a loop without steps never reaches, and a
    settled one is not kept (each would keep its run's records and outputs alive)."""

    __slots__ = ("_run", "lent")

    def __init__(self, run: Any, lent: threading.Lock) -> None:
        self._run = weakref.ref(run)
        self.lent = lent  # held until the stage is released

    def settled(self) -> bool:
        return not self.lent.locked()

    def __call__(self) -> None:
        while not self.lent.acquire(timeout=_RELEASE_WAIT_S):
            run = self._run()
            if run is None or run.failed is not None:
                return
        self.lent.release()  # (for the other fences of the stage)
