"""What Gemma 3n and Gemma 4 E2B/E4B add to a decoder (per-layer inputs, KV sharing, Gemma
3n's AltUp stack), as parts of the converted layers. See docs/presets.md.

The per-layer inputs travel in the decoder state's ``extras`` and each block passes on only
the slices later layers still need (in E2B they are six times the hidden states' size).
:class:`AltUpStack` and :class:`AltUpMerge` are the backbone's inline code at the two ends,
written as Hugging Face writes it, for exactness.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = [
    "GEMMA_PARTS",
    "AltUpMerge",
    "AltUpStack",
    "PerLayerInputs",
    "altup_merge",
    "altup_projections",
]

_PLE_MODULES = ("embed_tokens_per_layer", "per_layer_model_projection", "per_layer_projection_norm")
# what the backbone's per-layer-input methods read besides those modules
_PLE_VALUES = (
    "config",
    "hidden_size_per_layer_input",
    "per_layer_input_scale",
    "per_layer_model_projection_scale",
    "per_layer_projection_scale",
)
_ALTUP = ("altup_projections", "altup_unembed_projections")
#: backbone parts these layers place (the probe does not look for them elsewhere)
GEMMA_PARTS = frozenset(_PLE_MODULES + _ALTUP)


def altup_projections(backbone: nn.Module) -> tuple[nn.ModuleList, nn.ModuleList] | None:
    """Gemma 3n's AltUp projections (into the stack, out of it), or ``None``."""
    into, out = (getattr(backbone, name, None) for name in _ALTUP)
    if isinstance(into, nn.ModuleList) and isinstance(out, nn.ModuleList):
        return into, out
    return None


class PerLayerInputs(nn.Module):
    """``per_layer_inputs`` from the token ids and their embeddings, by the backbone's own
    ``get_per_layer_inputs`` / ``project_per_layer_inputs`` run on this module, which holds
    the parts they read (the modules shared, the scales copied) under the same names."""

    def __init__(self, backbone: nn.Module) -> None:
        super().__init__()
        self.backbone_class = type(backbone)
        for name in _PLE_MODULES:
            setattr(self, name, getattr(backbone, name))
        for name in _PLE_VALUES:
            if name in backbone._buffers:
                self.register_buffer(name, backbone._buffers[name], persistent=False)
            elif hasattr(backbone, name):
                setattr(self, name, getattr(backbone, name))

    @staticmethod
    def of(backbone: nn.Module, config: Any) -> PerLayerInputs | None:
        if not getattr(config, "hidden_size_per_layer_input", None):
            return None
        if not all(hasattr(backbone, n) for n in _PLE_MODULES):
            return None
        return PerLayerInputs(backbone)

    def forward(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        cls: Any = self.backbone_class
        return cls.project_per_layer_inputs(self, embeds, cls.get_per_layer_inputs(self, input_ids))


def _matched(x: torch.Tensor, target: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``x`` rescaled to the root-mean-square ``target``, as Gemma 3n's backbone writes it."""
    x = x.to(dtype=like.dtype, device=target.device)
    magnitude = torch.sqrt(torch.mean(x**2, dim=-1, keepdim=True).clamp(min=1e-5))
    return x * target / magnitude


class AltUpStack(nn.Module):
    """Gemma 3n's AltUp stack of the embeddings, batch-first ``(batch, inputs, seq, hidden)``."""

    def __init__(self, projections: nn.ModuleList) -> None:
        super().__init__()
        self.projections = projections

    def forward(self, embeds: torch.Tensor) -> torch.Tensor:
        target = torch.mean(embeds**2, dim=-1, keepdim=True) ** 0.5
        stack = [embeds, *(_matched(p(embeds), target, embeds) for p in self.projections)]
        return torch.stack(stack, dim=1)


def altup_merge(projections: nn.ModuleList, stack: torch.Tensor) -> torch.Tensor:
    """Gemma 3n's AltUp stack ``(inputs, batch, seq, hidden)`` averaged back to ``(batch,
    seq, hidden)`` (before the final norm)."""
    target = torch.mean(stack[0] ** 2, dim=-1, keepdim=True) ** 0.5
    parts = [
        stack[0],
        *(_matched(p(stack[i]), target, stack) for i, p in enumerate(projections, 1)),
    ]
    return torch.mean(torch.stack(parts), dim=0)


class AltUpMerge(nn.Module):
    """The final norm of Gemma 3n: the batch-first AltUp stack averaged back, then normed."""

    def __init__(self, projections: nn.ModuleList, norm: nn.Module) -> None:
        super().__init__()
        self.projections = projections
        self.norm = norm

    def forward(self, stack: torch.Tensor) -> torch.Tensor:
        return self.norm(altup_merge(self.projections, stack.transpose(0, 1).contiguous()))
