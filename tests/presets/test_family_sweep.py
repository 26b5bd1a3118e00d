"""The family sweep in CI: ``scripts/sweep_hf_families.py``'s check on a selection of
structurally different families, and the coverage table of docs/presets.md kept in step
with the installed transformers.

The full sweep (every causal-LM class, a few minutes) is a script; here each family of
the selection is built tiny, wrapped with the default ``wrap_model_to_roundpipe`` on
``devices="cpu:2"`` and its fused ``forward_backward`` compared with Hugging Face's own
``loss.backward()`` (5 rows, one left-padded, 2 microbatches). A transformers release that
breaks one of them, or changes what the converter must refuse, fails here. The
selection covers what test_generic_converter.py does not: fused QKV (Phi-3), partial
rotary with LayerNorm and a ``final_layernorm`` (Phi), GPT-NeoX's layout, LayerNorm with
biases and a sliding window (Starcoder2), layers without rotary (SmolLM3), pure Mamba
mixers, short convolutions beside attention (LFM2), sliding + full attention with a
logit scale (Cohere 2), a MoE without router loss (Mixtral), a learned position
embedding with layers taking positional arguments (GPT-BigCode), a preset family (Llama),
per-layer inputs and keys/values shared between layers (Gemma 4 E2B's, with Gemma 4's MoE
block, per-family tiny config; Gemma 3n's, with its AltUp stack), a mask built even without padding (DeepSeek V3.2's indexer) and a refusal of the
converter whose automatic split is exact (Bloom: ALiBi).
"""

from __future__ import annotations

import os
import re
import sys

import pytest

pytest.importorskip("transformers")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))

from sweep_hf_families import BEGIN, DOCS, END, causal_lm_entries, check_family  # noqa: E402

SELECTION = {
    "llama": "preset",
    "phi3": "structure",
    "phi": "structure",
    "gpt_neox": "structure",
    "starcoder2": "structure",
    "smollm3": "structure",
    "mamba": "structure",
    "lfm2": "structure",
    "cohere2": "structure",
    "mixtral": "structure",
    "gpt_bigcode": "structure",
    "bloom": "automatic split",
    "gemma3n_text": "structure",
    "gemma4_text": "structure",
    "deepseek_v32": "structure",
}


@pytest.mark.parametrize("model_type", sorted(SELECTION))
def test_family_converts_exactly_or_is_refused(model_type: str) -> None:
    result = check_family(model_type)
    assert result.outcome == SELECTION[model_type], result.reason
    assert result.exact, (
        f"{model_type}: loss rel err {result.loss_err}, worst gradient rel err "
        f"{result.worst_grad_err} {result.reason}"
    )
    if result.outcome == "automatic split":
        assert result.reason  # the converter's refusal says why


def test_the_docs_table_lists_every_causal_lm_of_the_installed_transformers() -> None:
    """Regenerate with ``python scripts/sweep_hf_families.py --write`` when this fails
    (after a deliberate bump of transformers in ``scripts/constraints.txt``)."""
    doc = DOCS.read_text()
    table = doc.split(BEGIN, 1)[1].split(END, 1)[0]
    listed = set(re.findall(r"^\| ([\w.-]+) \| ", table, flags=re.MULTILINE))
    installed = {model_type for model_type, _, _ in causal_lm_entries()}
    assert listed == installed, (
        f"not in the table: {sorted(installed - listed)}; no longer installed: "
        f"{sorted(listed - installed)}"
    )
