"""Read how a causal LM calls its parts from recorded forwards of the model itself.

:mod:`.structure` finds *which* modules a model has; this module runs the model on a
tiny probe batch (two rows, one left-padded) with hooks on its parts and matches each
recorded value against what the converter can rebuild; anything else raises a
``ValueError`` naming it. :func:`check_conversion` then runs the converted layers against
the model. See docs/presets.md, "the converter by structure".
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
from collections.abc import Iterator, MutableMapping
from typing import Any

import torch
from torch import nn

from ..running.carried import REPLICA_FLAGS
from .gemma import GEMMA_PARTS, AltUpStack, PerLayerInputs, altup_merge, altup_projections
from .structure import DecoderParts

__all__ = ["LayerRecipe", "ModelRecipe", "check_conversion", "eval_mode", "probe_decoder"]

PROBE_BATCH = 2
PROBE_SEQ = 8
PROBE_PAD = 2  # left padding of the second row
PROBE_WINDOW = 3  # sliding windows / attention chunks during the recording
PROBE_SEED = 1234

# mask kinds -> the name of Hugging Face's builder in transformers.masking_utils
MASK_BUILDERS = {
    "full": "create_causal_mask",
    "sliding": "create_sliding_window_causal_mask",
    "chunked": "create_chunked_causal_mask",
}
# what well-known refused keywords are, for the error message
_KNOWN_FEATURES = {
    "shared_kv_states": "KV sharing between layers (Gemma 3n/4)",
    "alibi": "an ALiBi bias (its first dim is batch x heads, not batch)",
    "per_layer_input": "per-layer inputs (Gemma 3n/4)",
    "per_layer_inputs": "per-layer inputs (Gemma 3n/4)",
}


@dataclasses.dataclass(frozen=True)
class LayerRecipe:
    """How one decoder layer is called: ``layer(hidden, *args, **kwargs)``.

    ``inputs`` holds ``(keyword, source, detail)`` triples, an int keyword being the
    positional argument at that place after the hidden states. Sources (detail in brackets):
    ``"const"`` (the value), ``"padding_mask"`` (2D), ``"position_ids"``, ``"cache_position"``
    (``arange(seq)``), ``"mask"`` (``(kind, with_position_ids, allow_is_causal_skip)``, kind a
    key of ``MASK_BUILDERS``; the last ``False`` where the model builds a mask even without
    padding, as DeepSeek V3.2's indexer needs), ``"table"`` (an index into
    :attr:`ModelRecipe.position_tables`), and, see :mod:`.gemma`, ``"fresh"`` (a mapping type:
    an empty one per call, Gemma 4's ``shared_kv_states`` where no layer reads it),
    ``"shared_kv"`` (the mapping type: one filled with the keys and values earlier layers
    stored) and ``"per_layer_input"`` (the layer's index; each block takes the first left).
    ``stacked``: the layer takes Gemma 3n's AltUp stack.
    """

    inputs: tuple[tuple[str | int, str, Any], ...]
    tuple_output: bool
    stacked: bool = False


@dataclasses.dataclass(frozen=True)
class ModelRecipe:
    """What the probe found: everything the converter needs besides the parts. Fields named
    as :class:`.common.CausalLMInputAdapter`'s arguments mean what those do, with a backbone
    part given by its attribute name and the dropout by its rate."""

    layers: tuple[LayerRecipe, ...]
    embed_scale: float | None
    embed_scale_as_tensor: bool
    position_tables: tuple[tuple[str, str | None], ...]  # (backbone attribute, layer_type)
    norm_name: str
    logit_ops: tuple[tuple[str, float], ...]
    position_embedding: str | None = None
    position_embedding_inputs: tuple[tuple[str | int, str, Any], ...] = ()
    positions_from_mask: bool = False
    embed_dropout: float | None = None


def refuse(parts: DecoderParts, what: str) -> ValueError:
    return ValueError(f"{type(parts.model).__name__} cannot be converted by structure: {what}")


def _same(a: Any, b: Any) -> bool:
    """Equal pytrees of tensors; a recorded ``(1, ...)`` tensor matches a ``(B, ...)`` candidate."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape:
            if a.dim() != b.dim() or b.shape[0] != 1 or a.shape[1:] != b.shape[1:]:
                return False
            b = b.expand_as(a)
        return a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a is None and b is None


def _first(out: Any) -> Any:
    return out[0] if isinstance(out, (tuple, list)) else out


@contextlib.contextmanager
def eval_mode(model: nn.Module, training: bool = False) -> Iterator[None]:
    """``model.eval()`` for the probe (dropout off, so rows can be compared alone and in a
    batch), or ``model.train()``, with the flags replicas run with (``REPLICA_FLAGS``:
    bitsandbytes would repack a 4-bit weight for its CPU kernel for good on an eval
    forward without grad); every module's training flag and those flags restored after."""
    flags = [(m, m.training) for m in model.modules()]
    kept = [(m, k, getattr(m, k)) for m in model.modules() for k in REPLICA_FLAGS if hasattr(m, k)]
    model.train(training)
    for module, key, _ in kept:
        setattr(module, key, REPLICA_FLAGS[key])
    try:
        yield
    finally:
        for module, training in flags:
            module.training = training
        for module, key, value in kept:
            setattr(module, key, value)


@contextlib.contextmanager
def _small_windows(config: Any) -> Iterator[None]:
    """Shrink sliding windows / attention chunks below the probe length (restored after)."""
    saved = {}
    for attr in ("sliding_window", "attention_chunk_size"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > PROBE_WINDOW:
            saved[attr] = value
            setattr(config, attr, PROBE_WINDOW)
    try:
        yield
    finally:
        for attr, value in saved.items():
            setattr(config, attr, value)


@dataclasses.dataclass
class _Recording:
    layer_calls: list[tuple[tuple, dict]]
    layer_outputs: list[Any]
    module_calls: dict[str, tuple[Any, dict, Any]]  # name -> (args, kwargs, output)
    head_call: tuple[Any, Any] | None
    logits: torch.Tensor | None


def _probe_batch(parts: DecoderParts, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    vocab = getattr(parts.config, "vocab_size", None)
    if not isinstance(vocab, int):
        weight = getattr(parts.lm_head, "weight", None)
        vocab = int(weight.shape[0]) if isinstance(weight, torch.Tensor) else 2
    g = torch.Generator().manual_seed(PROBE_SEED)
    ids = torch.randint(1, max(2, vocab), (PROBE_BATCH, PROBE_SEQ), generator=g)
    mask = torch.ones(PROBE_BATCH, PROBE_SEQ, dtype=torch.long)
    mask[1, :PROBE_PAD] = 0
    return ids.to(device), mask.to(device)


class _FirstLayerReached(Exception):
    pass


def _forward(parts: DecoderParts, mode: str, **call: Any) -> Any:
    """The model's own forward with the probe's seed (``None`` where a hook stopped it at its
    first layer); a failure is refused, saying so."""
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(PROBE_SEED)
        try:
            return parts.model(use_cache=False, **call)
        except _FirstLayerReached:
            return None
        except Exception as exc:
            raise refuse(
                parts,
                f"its own forward{mode} fails on the probe batch ({sorted(call)}): "
                f"{type(exc).__name__}: {exc}",
            ) from exc


def _record(parts: DecoderParts, **call: Any) -> _Recording:
    """One forward of the model with hooks on layers, backbone parts and head."""
    rec = _Recording([], [], {}, None, None)
    handles = []

    def pre(module: nn.Module, args: tuple, kwargs: dict) -> None:
        rec.layer_calls.append((args, dict(kwargs)))

    def post(module: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        rec.layer_outputs.append(out)

    def part_hook(name: str) -> Any:
        def hook(module: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
            rec.module_calls.setdefault(name, (args, dict(kwargs), out))

        return hook

    def head_hook(module: nn.Module, args: tuple, out: Any) -> None:
        rec.head_call = (args, out)

    try:
        for layer in parts.layers:
            handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(layer.register_forward_hook(post, with_kwargs=True))
        for name, module in parts.other_modules.items():
            handles.append(module.register_forward_hook(part_hook(name), with_kwargs=True))
        handles.append(parts.lm_head.register_forward_hook(head_hook))
        rec.logits = getattr(_forward(parts, "", **call), "logits", None)
    finally:
        for h in handles:
            h.remove()
    if len(rec.layer_calls) != len(parts.layers):
        raise refuse(
            parts,
            f"its forward made {len(rec.layer_calls)} calls to its {len(parts.layers)} decoder "
            "layers; one call each is expected",
        )
    return rec


def build_mask(
    config: Any,
    kind: str,
    embeds: torch.Tensor,
    padding_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None = None,
    skip: bool = True,
) -> Any:
    """Hugging Face's ``kind`` mask (a key of ``MASK_BUILDERS``), given ``position_ids`` where
    not ``None``, and built even without padding where not ``skip`` (``allow_is_causal_skip``)."""
    from transformers import masking_utils

    extra: dict[str, Any] = {} if position_ids is None else {"position_ids": position_ids}
    if not skip:
        extra["allow_is_causal_skip"] = False
    fn = getattr(masking_utils, MASK_BUILDERS[kind])
    extra[_cache_parameter(fn)] = None
    return fn(config=config, inputs_embeds=embeds, attention_mask=padding_mask, **extra)


@functools.cache
def _cache_parameter(builder: Any) -> str:
    """A mask builder's cache parameter: ``cache`` in the pinned transformers,
    ``past_key_values`` in older ones (5.17)."""
    return "cache" if "cache" in inspect.signature(builder).parameters else "past_key_values"


def _masks(parts: DecoderParts, hidden: torch.Tensor, mask: Any, pos: torch.Tensor) -> dict:
    """Candidate masks: ``{(kind, with_position_ids): mask}`` from Hugging Face's builders."""
    out = {}
    for kind in MASK_BUILDERS:
        for with_pos in (True, False):
            with contextlib.suppress(Exception):  # a builder this config cannot use, or lacks
                out[(kind, with_pos)] = build_mask(
                    parts.config, kind, hidden, mask, pos if with_pos else None
                )
    return out


def _tables(parts: DecoderParts, hidden: torch.Tensor, pos: torch.Tensor) -> dict:
    """Candidate position tables ``{(module name, layer_type): output}`` for batch-wide ids."""
    out: dict[tuple[str, str | None], Any] = {}
    layer_types = sorted(set(getattr(parts.config, "layer_types", None) or ()))
    for name, module in parts.position_modules.items():
        for layer_type in [None, *layer_types]:
            args = (hidden, pos) if layer_type is None else (hidden, pos, layer_type)
            with contextlib.suppress(Exception):  # a module that does not take this call
                out[(name, layer_type)] = module(*args)
    return out


def _embed_scale(
    parts: DecoderParts,
    embedded: torch.Tensor,
    first: torch.Tensor,
    added: torch.Tensor | None = None,
) -> tuple[float | None, bool]:
    """``(scale, as_tensor)`` with ``embedded * scale (+ added) == first``, or ``(None, False)``."""

    def plus(x: torch.Tensor) -> torch.Tensor:
        return x if added is None else x + added

    if _same(first, plus(embedded)):
        return None, False
    config = parts.config
    candidates = []
    hidden_size = getattr(config, "hidden_size", None)
    if isinstance(hidden_size, int):
        candidates.append(hidden_size**0.5)
    for attr in ("embedding_multiplier", "scale_emb", "embedding_scale", "embed_scale"):
        value = getattr(config, attr, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            candidates.append(float(value))
    for scale in candidates:
        for as_tensor in (True, False):
            factor: Any = torch.tensor(scale, dtype=embedded.dtype) if as_tensor else scale
            if _same(first, plus(embedded * factor)):
                return scale, as_tensor
    raise refuse(
        parts,
        "the first decoder layer's input is not the token embedding (nor the embedding times "
        "hidden_size ** 0.5 or a multiplier from the config"
        + (", plus a position embedding" if added is not None else "")
        + "): the backbone does something to the embeddings the converter does not know",
    )


def _logit_ops(parts: DecoderParts, head_out: torch.Tensor, logits: torch.Tensor) -> tuple:
    if _same(logits, head_out):
        return ()
    config = parts.config
    scales: list[tuple[str, float]] = []
    mul = getattr(parts.model, "logit_scale", None)
    if mul is None:
        mul = getattr(config, "logit_scale", None)
    if isinstance(mul, (int, float)) and not isinstance(mul, bool):
        scales.append(("mul", float(mul)))
    div = getattr(config, "logits_scaling", None)
    if isinstance(div, (int, float)) and not isinstance(div, bool):
        scales.append(("div", float(div)))
    cap = getattr(config, "final_logit_softcapping", None)
    caps = [("softcap", float(cap))] if isinstance(cap, (int, float)) and cap else []
    options: list[tuple[tuple[str, float], ...]] = [(op,) for op in scales + caps]
    options += [(s, c) for s in scales for c in caps]
    for ops in options:
        if _same(logits, apply_logit_ops(head_out, ops)):
            return ops
    raise refuse(
        parts,
        "its logits are not the LM head's output (nor scaled by config.logit_scale / "
        "logits_scaling or soft-capped by config.final_logit_softcapping)",
    )


def apply_logit_ops(logits: torch.Tensor, ops: tuple[tuple[str, float], ...]) -> torch.Tensor:
    """What a model's forward does to its LM head's output, as Hugging Face writes it:
    ``("mul", s)`` (Cohere's ``logit_scale``), ``("div", d)`` (Granite's ``logits_scaling``),
    ``("softcap", c)`` = ``c * tanh(logits / c)`` (Gemma 2/3's ``final_logit_softcapping``)."""
    for op, value in ops:
        if op == "mul":
            logits = logits * value
        elif op == "div":
            logits = logits / value
        else:
            logits = torch.tanh(logits / value) * value
    return logits


def _classify(
    parts: DecoderParts,
    index: int,
    key: str | int,
    value: Any,
    known: dict[str, Any],
    masks: dict,
    tables: dict,
    table_order: list[tuple[str, str | None]],
) -> tuple[str | int, str, Any]:
    where = (
        f"decoder layer {index} gets {key}="
        if isinstance(key, str)
        else f"decoder layer {index} gets as positional argument {key} "
    )
    per_layer = known.get("per_layer_inputs")
    if isinstance(value, torch.Tensor) and per_layer is not None:
        if _same(per_layer[:, :, index], value):
            return (key, "per_layer_input", index)
    if key in _KNOWN_FEATURES:
        if value is None:
            return (key, "const", None)
        if key == "shared_kv_states" and isinstance(value, MutableMapping):
            # without KV sharing the layers only store into it, for an assistant model to
            # read after the forward: each block gets an empty one
            shared = getattr(parts.config, "num_kv_shared_layers", 0)
            return (key, "shared_kv" if shared else "fresh", type(value))
        raise refuse(
            parts,
            f"{where}...: {_KNOWN_FEATURES[key]}, which would not travel between "
            "pipeline layers; use the automatic split",
        )
    if value is None or isinstance(value, (bool, int, float, str)):
        return (key, "const", value)
    if isinstance(value, torch.Tensor):
        if _same(known["padding_mask"], value):
            return (key, "padding_mask", None)
        if value.dim() == 2 and _same(known["position_ids"], value):
            return (key, "position_ids", None)
        if value.dim() == 2 and _same(known["mask_positions"], value):
            return (key, "mask_positions", None)
        if value.dim() == 1 and torch.equal(value, known["cache_position"]):
            return (key, "cache_position", None)
        matches = [k for k, m in masks.items() if m is not None and _same(m, value)]
        if matches:
            layer_types = getattr(parts.config, "layer_types", None)
            layer_type = str(layer_types[index]) if layer_types else ""
            preferred = [k for k in matches if k[0] in layer_type] or matches
            preferred.sort(key=lambda k: not k[1])  # with position ids first
            return (key, "mask", preferred[0])
    if isinstance(value, (torch.Tensor, tuple, list)):
        for candidate, table in tables.items():
            if _same(table, value):
                if candidate not in table_order:
                    table_order.append(candidate)
                return (key, "table", table_order.index(candidate))
    kind = type(value).__name__
    if isinstance(value, torch.Tensor):
        kind = f"a tensor of shape {tuple(value.shape)}"
    raise refuse(
        parts,
        f"{where}{kind}, which is none of what the converter rebuilds per layer (padding mask, "
        "position ids, a causal / sliding / chunked mask, a position table of the backbone's, a "
        "constant)",
    )


def probe_decoder(parts: DecoderParts) -> ModelRecipe:
    """Record one forward of ``parts.model`` and read how it calls its parts; ValueError
    naming the first thing the converter cannot rebuild."""
    params = list(parts.model.parameters())
    if not params:
        raise refuse(parts, "it has no parameters")
    device = params[0].device
    if device.type == "meta":
        raise refuse(
            parts,
            "its parameters are on the meta device; the converter runs the model once on a "
            "probe batch to read how it calls its layers",
        )
    ids, mask = _probe_batch(parts, device)
    with _small_windows(parts.config):
        rec = _record(parts, input_ids=ids, attention_mask=mask)
        first_args, first_kwargs = rec.layer_calls[0]
        first = first_args[0] if first_args else first_kwargs.get("hidden_states")
        if not isinstance(first, torch.Tensor):
            raise refuse(parts, "its decoder layers do not take the hidden states first")
        layer_input, altup = first, altup_projections(parts.backbone)
        if altup is not None:  # Gemma 3n: the layers take an AltUp stack of the embeddings
            if not _same(first, AltUpStack(altup[0])(first[0]).transpose(0, 1)):
                raise refuse(parts, "its first layer's input is not the AltUp stack")
            first = first[0]
        pos_hf = torch.arange(PROBE_SEQ, device=device).unsqueeze(0)
        pos = pos_hf.expand(PROBE_BATCH, -1)
        masks = _masks(parts, first, mask, pos_hf)
        tables = _tables(parts, first, pos)
        # packed position ids without a padding mask: does the model build masks with them?
        packed = torch.arange(PROBE_SEQ, device=device) % (PROBE_SEQ // 2)
        packed = packed.unsqueeze(0).expand(PROBE_BATCH, -1)
        try:
            rec_packed: _Recording | None = _record(parts, input_ids=ids, position_ids=packed)
        except ValueError as exc:
            if exc.__cause__ is None:
                raise
            rec_packed = None  # a model that needs a padding mask: masks take the position ids
        masks_packed = _masks(parts, first, None, packed)
    last = _first(rec.layer_outputs[-1])
    per_layer = PerLayerInputs.of(parts.backbone, parts.config)
    if altup is not None:
        last = altup_merge(altup[1], last)
    embedded = parts.embed_tokens(ids)
    per_layer_inputs = None if per_layer is None else per_layer(ids, first)
    norms = [n for n, (args, _, _) in rec.module_calls.items() if args and _same(args[0], last)]
    if len(norms) != 1:
        raise refuse(
            parts,
            "found no final norm taking the last decoder layer's output among "
            f"{sorted(parts.other_modules) or 'the backbone parts'}",
        )
    norm_name = norms[0]
    called = [n for n in rec.module_calls if n != norm_name and n not in GEMMA_PARTS]
    pos_name, embed_scale, as_tensor = _position_embedding(parts, rec, called, embedded, first)
    known = {
        "padding_mask": mask,
        "position_ids": pos,
        "mask_positions": (torch.cumsum(mask, dim=1) * mask - 1).long(),
        "cache_position": torch.arange(PROBE_SEQ, device=device),
        "per_layer_inputs": per_layer_inputs,
    }
    pos_inputs: list[tuple[str | int, str, Any]] = []
    if pos_name is not None:
        pos_args, pos_kwargs, _ = rec.module_calls[pos_name]
        pos_calls: list[tuple[str | int, Any]] = [*enumerate(pos_args), *pos_kwargs.items()]
        for key, value in pos_calls:
            entry = _classify(parts, 0, key, value, known, {}, {}, [])
            if entry[1] not in ("const", "padding_mask", "position_ids", "mask_positions"):
                raise refuse(
                    parts,
                    f"its position embedding {pos_name} gets {key}= a value the converter does "
                    "not rebuild (a padding mask, position ids or a constant)",
                )
            pos_inputs.append(entry)
    table_order: list[tuple[str, str | None]] = []
    recipes = []
    previous = None
    for i, ((args, kwargs), out) in enumerate(zip(rec.layer_calls, rec.layer_outputs)):
        if "hidden_states" in kwargs:
            kwargs = dict(kwargs)
            hidden, extra = kwargs.pop("hidden_states"), args
        else:
            hidden, extra = (args[0], args[1:]) if args else (None, ())
        if previous is not None and not _same(hidden, previous):
            raise refuse(
                parts,
                f"decoder layer {i}'s input is not layer {i - 1}'s output: the backbone runs code "
                "between its layers",
            )
        previous = _first(out)
        inputs = []
        calls: list[tuple[str | int, Any]] = [*enumerate(extra, 1), *kwargs.items()]
        for key, value in calls:
            entry = _classify(parts, i, key, value, known, masks, tables, table_order)
            if entry[1] == "mask":
                entry = _with_or_without_positions(parts, i, key, entry, rec_packed, masks_packed)
            inputs.append(entry)
        recipes.append(
            LayerRecipe(tuple(inputs), isinstance(out, (tuple, list)), altup is not None)
        )
    if any(e[1] == "mask" for r in recipes for e in r.inputs):
        with _small_windows(parts.config):
            recipes = _forced_masks(parts, ids[:1], recipes)
    head_in, head_out = rec.head_call if rec.head_call is not None else (None, None)
    norm_out = rec.module_calls[norm_name][2]
    if head_in is None or not _same(_first(head_in), _first(norm_out)):
        raise refuse(parts, "its LM head does not take the final norm's output")
    if rec.logits is None or not isinstance(head_out, torch.Tensor):
        raise refuse(parts, "its forward returns no .logits, or its LM head no tensor")
    ops = _logit_ops(parts, head_out, rec.logits)
    sources = {e[1] for r in recipes for e in r.inputs} | {e[1] for e in pos_inputs}
    from_mask = "mask_positions" in sources
    if from_mask and "position_ids" in sources:
        raise refuse(
            parts,
            "it uses two kinds of default position ids (0..S-1 and counted over the padding "
            "mask) in one forward",
        )
    if from_mask:  # they are the position ids of the state, counted by the input adapter
        recipes = [
            dataclasses.replace(r, inputs=tuple(_from_mask(e) for e in r.inputs)) for r in recipes
        ]
        pos_inputs = [_from_mask(e) for e in pos_inputs]
    with _small_windows(parts.config):
        dropout = _embedding_dropout(parts, ids, mask, layer_input)
    return ModelRecipe(
        layers=tuple(recipes),
        embed_scale=embed_scale,
        embed_scale_as_tensor=as_tensor,
        position_tables=tuple(table_order),
        norm_name=norm_name,
        logit_ops=ops,
        position_embedding=pos_name,
        position_embedding_inputs=tuple(pos_inputs),
        positions_from_mask=from_mask,
        embed_dropout=dropout,
    )


def _from_mask(entry: tuple[str | int, str, Any]) -> tuple[str | int, str, Any]:
    return (entry[0], "position_ids", None) if entry[1] == "mask_positions" else entry


def _position_embedding(
    parts: DecoderParts,
    rec: _Recording,
    called: list[str],
    embedded: torch.Tensor,
    first: torch.Tensor,
) -> tuple[str | None, float | None, bool]:
    """``(name, scale, as_tensor)``: which backbone part (if any) adds a position embedding to
    the (scaled) token embedding to give the first layer's input; any other part the backbone
    runs is refused, named."""
    if len(called) == 1:
        out = rec.module_calls[called[0]][2]
        if isinstance(out, torch.Tensor) and out.shape[-1:] == first.shape[-1:]:
            with contextlib.suppress(ValueError):
                return (called[0], *_embed_scale(parts, embedded, first, out))
    if called:
        raise refuse(
            parts,
            f"its backbone also runs {', '.join(called)}, which the converter does not place",
        )
    return (None, *_embed_scale(parts, embedded, first))


def _embedding_dropout(
    parts: DecoderParts, ids: torch.Tensor, mask: torch.Tensor, first: torch.Tensor
) -> float | None:
    """The dropout the backbone applies to the embeddings in training, or ``None``.

    The model runs in training mode up to its first decoder layer with the probe's seed;
    its input there must be the eval-mode one, or a dropout of it with a probability the
    backbone or its config names (an ``nn.Dropout`` child, a ``*drop*`` attribute)."""
    got: list[torch.Tensor] = []

    def stop(module: nn.Module, args: tuple, kwargs: dict) -> None:
        got.append(args[0] if args else kwargs["hidden_states"])
        raise _FirstLayerReached

    handle = parts.layers[0].register_forward_pre_hook(stop, with_kwargs=True)
    try:
        with eval_mode(parts.model, training=True):
            _forward(parts, " in training mode", input_ids=ids, attention_mask=mask)
    finally:
        handle.remove()
    if not got:
        raise refuse(parts, "its first decoder layer is not called in training mode")
    if _same(first, got[0]):
        return None
    candidates = {m.p for m in parts.backbone.children() if isinstance(m, nn.Dropout)}
    for owner in (parts.backbone, parts.config):
        for attr, value in vars(owner).items():
            if "drop" in attr and isinstance(value, float):
                candidates.add(value)
    for p in sorted(c for c in candidates if 0 < c < 1):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(PROBE_SEED)
            dropped = nn.functional.dropout(first, p, training=True)
        if _same(dropped, got[0]):
            return p
    raise refuse(
        parts,
        "in training mode its first decoder layer's input is neither the embeddings nor a "
        "dropout of them with a probability its backbone or config names: the backbone does "
        "something in training the converter does not know",
    )


def _argument(args: tuple, kwargs: dict, key: str | int) -> Any:
    """The recorded layer call's argument ``key`` (an int: positional, after the hidden
    states unless those came as a keyword), or ``None``."""
    if isinstance(key, str):
        return kwargs.get(key)
    at = key - 1 if "hidden_states" in kwargs else key
    return args[at] if at < len(args) else None


def _with_or_without_positions(
    parts: DecoderParts,
    index: int,
    key: str | int,
    entry: tuple[str | int, str, Any],
    rec_packed: _Recording | None,
    masks_packed: dict,
) -> tuple[str | int, str, Any]:
    kind, _ = entry[2]
    if rec_packed is None:
        return (key, "mask", (kind, True, True))
    recorded = _argument(*rec_packed.layer_calls[index], key)
    for with_pos in (True, False):
        if _same(masks_packed.get((kind, with_pos)), recorded):
            return (key, "mask", (kind, with_pos, True))
    raise refuse(
        parts,
        f"decoder layer {index}'s {key if isinstance(key, str) else f'argument {key}'} for "
        f"packed position ids matches no {kind} mask "
        f"({MASK_BUILDERS[kind]}) built with or without position_ids",
    )


def _forced_masks(
    parts: DecoderParts, row: torch.Tensor, recipes: list[LayerRecipe]
) -> list[LayerRecipe]:
    """Mark the masks the model builds even without padding (``allow_is_causal_skip=False``),
    where Hugging Face's builder would otherwise return ``None``: read from a forward of one
    unpadded row with no padding mask."""
    rec = _record(parts, input_ids=row)
    out = []
    for recipe, (args, kwargs) in zip(recipes, rec.layer_calls):
        inputs = []
        for key, source, detail in recipe.inputs:
            if source == "mask":
                recorded = _argument(args, kwargs, key)
                kind, with_pos, _ = detail
                hidden = args[0] if args else kwargs["hidden_states"]
                built = build_mask(parts.config, kind, hidden, None)
                if built is None and isinstance(recorded, torch.Tensor):
                    detail = (kind, with_pos, False)
            inputs.append((key, source, detail))
        out.append(dataclasses.replace(recipe, inputs=tuple(inputs)))
    return out


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def check_conversion(parts: DecoderParts, seq: nn.Sequential) -> None:
    """Run ``seq`` layer by layer on the probe batch; logits and loss must be the model's
    own (else ValueError, giving the relative error)."""
    device = next(parts.model.parameters()).device
    ids, mask = _probe_batch(parts, device)
    labels = ids.masked_fill(mask == 0, -100)

    def run(**inputs: Any) -> Any:
        torch.manual_seed(PROBE_SEED)
        state = seq[0](**inputs)
        for layer in list(seq)[1:]:
            state = layer(*state)
        return state

    with torch.no_grad(), torch.random.fork_rng(devices=[]), eval_mode(seq):
        ref = _forward(parts, "", input_ids=ids, attention_mask=mask, labels=labels)
        try:
            state = run(input_ids=ids, attention_mask=mask, labels=labels)
        except Exception as exc:
            raise refuse(
                parts,
                f"the converted layers fail on the probe batch: {type(exc).__name__}: {exc}",
            ) from exc
        # each row alone, as a microbatch runs it: the unpadded row takes the no-mask path
        rows = [
            run(input_ids=ids[r : r + 1], attention_mask=mask[r : r + 1]).logits
            for r in range(PROBE_BATCH)
        ]
    dtype = ref.logits.dtype
    tol = 1e-5 if dtype in (torch.float32, torch.float64) else 2e-2
    errors = {
        "logits": _rel_err(state.logits, ref.logits),
        "loss": abs(state.loss.item() - ref.loss.item()) / max(abs(ref.loss.item()), 1e-30),
        "logits of one row alone (a microbatch)": _rel_err(torch.cat(rows), ref.logits),
    }
    for what, err in errors.items():
        if not math.isfinite(err) or err > tol:
            raise refuse(
                parts,
                f"the converted layers' {what} differ from the model's own on the whole probe "
                f"batch (relative error {err:.2e} > {tol:.0e})"
                + (
                    ": a row's output depends on the other rows of the batch (e.g. through "
                    "its padding), which microbatches cannot reproduce"
                    if "alone" in what
                    else ""
                ),
            )
