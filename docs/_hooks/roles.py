"""MkDocs hook: the Sphinx roles devmesh's docstrings use (``:class:`~devmesh.x.Y```,
``:func:``, ``:meth:``, ``:mod:``, ``:attr:``, ``:data:``, ``:exc:``, ``:obj:``) rendered as
code, linked to the object's entry where the page documents it (mkdocstrings gives each
entry its dotted path as id). mkdocstrings leaves them as raw text otherwise."""

from __future__ import annotations

import re

ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj):<code>(~?)([\w.]+)(\(\))?</code>")
IDS = re.compile(r'\bid="([\w.]+)"')


def on_page_content(html: str, page, config, files) -> str:
    ids = set(IDS.findall(html))

    def render(match: re.Match) -> str:
        short, target, call = match.group(1), match.group(2), match.group(3) or ""
        name = target.rsplit(".", 1)[-1] if short else target.lstrip(".")
        found = target if target in ids else next(
            (i for i in ids if i.endswith("." + target.lstrip("."))), None)
        code = f"<code>{name}{call}</code>"
        return f'<a href="#{found}">{code}</a>' if found else code

    return ROLE.sub(render, html)
