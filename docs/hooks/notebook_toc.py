"""Point the table of contents of notebook pages at the ids their headings really have.

mkdocs-jupyter builds a notebook page's TOC from a Markdown export of the notebook, but renders the
page itself with nbconvert, and the two derive heading ids differently for some headings: for
"1. Split `wkv_b` into halves" the TOC links to #1-split-into-halves while the heading's id is
1-split-wkv_b-into-halves, so the TOC entry goes nowhere. Both list the headings in document
order, so this hook pairs them up and gives each TOC entry the id of its heading.
"""

from __future__ import annotations

import logging
import re

log = logging.getLogger("mkdocs.hooks.notebook_toc")

_HEADING_ID = re.compile(r"<h[1-6]\b[^>]*\bid=\"([^\"]+)\"")


def _entries(toc):
    for entry in toc:
        yield entry
        yield from _entries(entry.children)


def on_page_context(context, page, config, nav):
    if not page.file.src_uri.endswith(".ipynb") or page.content is None:
        return context
    ids = _HEADING_ID.findall(page.content)
    entries = list(_entries(page.toc))
    if len(ids) != len(entries):
        log.warning(
            "%s: %d headings but %d table-of-contents entries; its TOC links may not resolve",
            page.file.src_uri, len(ids), len(entries),
        )
        return context
    for entry, heading_id in zip(entries, ids):
        entry.id = heading_id
    return context
