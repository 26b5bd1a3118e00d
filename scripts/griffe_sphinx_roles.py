"""Griffe extension for the API pages (mkdocs.yml): Sphinx roles as inline code.

Some docstrings refer to other objects with Sphinx roles (``:func:`name```,
``:class:`~pkg.mod.Name```), which the Google-style parser leaves as they are.
This extension rewrites each role to inline code (``~`` keeps the last dotted
part only, as Sphinx shows it), before the docstrings are parsed.
"""

from __future__ import annotations

import re
from typing import Any

from griffe import Extension, Object

_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|exc|obj|const):`(~?)([^`]+)`")


def _as_code(match: re.Match[str]) -> str:
    target = match.group(2)
    if match.group(1):
        target = target.rsplit(".", 1)[-1]
    return f"`{target}`"


class SphinxRolesAsCode(Extension):
    """Rewrite Sphinx cross-reference roles in docstrings to inline code."""

    def on_instance(self, *, obj: Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(_as_code, obj.docstring.value)
