"""Griffe extension for the API docs: Sphinx roles in docstrings become cross-references.

gradcomm's docstrings name other objects with reST roles (``:func:`name```, ``:class:`~pkg.Name```), which
Markdown would print as written. This rewrites each role into mkdocs-autorefs' optional cross-reference: a link
where the name resolves to a documented object, plain code otherwise (torch's names, private helpers), so the
strict build never fails on a name the reference does not cover. reST's ``text::`` before an indented literal
block becomes ``text:``, as Markdown shows an indented block as code by itself.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_LITERAL_BLOCK = re.compile(r"(?<=\S)::\n\n")  # reST's "text::" before an indented block; Markdown's is ":"
_ROLE = re.compile(r":(?:func|class|meth|attr|mod|data|obj|exc|envvar):`(~?)([^`]+)`")


def _identifier(obj: griffe.Object, name: str) -> str:
    """Full path of ``name`` as seen from ``obj``'s scope, or ``name`` itself when it does not resolve."""
    try:
        return obj.resolve(name)
    except (griffe.NameResolutionError, AttributeError, KeyError):
        return name


def _rewrite(obj: griffe.Object, text: str) -> str:
    def replace(match: re.Match[str]) -> str:
        short, name = match.group(1), match.group(2).strip()
        title = name.rsplit(".", 1)[-1] if short else name
        return f'<autoref identifier="{_identifier(obj, name)}" optional><code>{title}</code></autoref>'

    return _LITERAL_BLOCK.sub(":\n\n", _ROLE.sub(replace, text))


class SphinxRoles(griffe.Extension):
    """Rewrite the roles of every docstring once the package is loaded (names then resolve across modules)."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        self._visit(pkg, set())

    def _visit(self, obj: griffe.Object, seen: set[str]) -> None:
        if obj.path in seen:
            return
        seen.add(obj.path)
        if obj.docstring is not None:
            obj.docstring.value = _rewrite(obj, obj.docstring.value)
        for member in obj.members.values():
            if not member.is_alias:
                self._visit(member, seen)
