"""docs/add-a-preset.md's worked example runs as written: its NanoChat preset, imported
from ``roundpipe_core.presets`` alone, trains exactly as Hugging Face (the page's own
check block), and without ``stack=`` it is refused as the page says."""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path
from typing import Any

import pytest

import roundpipe_core.presets as presets

DOC = Path(__file__).resolve().parents[2] / "docs" / "add-a-preset.md"


def _blocks() -> tuple[str, str]:
    """The page's preset module and the block that checks it."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    preset = next(b for b in blocks if "def convert_nanochat" in b)
    check = next(b for b in blocks if "import nanochat_preset" in b)
    return preset, check


@pytest.fixture
def preset_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Writes the page's preset as ``nanochat_preset.py`` and forgets it afterwards."""
    pytest.importorskip("transformers").NanoChatConfig  # noqa: B018  (the family exists)
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(text: str) -> None:
        (tmp_path / "nanochat_preset.py").write_text(text)

    yield write
    sys.modules.pop("nanochat_preset", None)
    presets._REGISTRY.pop("NanoChatForCausalLM", None)


def test_the_pages_nanochat_preset_trains_as_hugging_face(
    preset_module: Any, caplog: pytest.LogCaptureFixture
) -> None:
    preset, check = _blocks()
    preset_module(preset)
    with caplog.at_level(logging.INFO, logger="roundpipe_core.presets"):
        exec(compile(check, str(DOC), "exec"), {})  # its assert_close calls are the test
    assert "NanoChatForCausalLM converted by its preset" in caplog.text


def test_without_the_stack_step_the_pages_preset_is_refused(preset_module: Any) -> None:
    preset, check = _blocks()
    stack_line = next(line for line in preset.splitlines() if "stack=backbone.norm" in line)
    preset_module(preset.replace(stack_line + "\n", ""))
    with pytest.raises(ValueError, match="the converted layers' logits differ"):
        exec(compile(check, str(DOC), "exec"), {})
