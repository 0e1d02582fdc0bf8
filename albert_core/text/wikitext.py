"""MediaWiki wikitext to plain prose (`strip_wikitext`), for the MediaWiki XML reader of `albert_core.text.readers`.

Nested constructs (templates, tables, links) are removed one level per pass, at most _MAX_NESTING passes; element
tags, external links and headings are found by forward scans instead of the regexes that took quadratic or cubic
time on hostile pages (tests/test_hostile_inputs.py).
"""

from __future__ import annotations

import bisect
import html
import re

_DROP_SECTIONS = {
    "references",
    "external links",
    "see also",
    "further reading",
    "notes",
    "bibliography",
    "sources",
    "footnotes",
    "notes and references",
    "citations",
}
_LINK_NAMESPACES = {"file", "image", "category", "media"}
_DROP_TAGS = "ref|math|gallery|timeline|imagemap|score|syntaxhighlight|source|chem|ce|hiero|graph|templatedata"
_RE_COMMENT = re.compile(r"<!--.*?(?:-->|$)", re.DOTALL)
# <ref .../>, and <tag ...>...</tag> or <tag .../> for _DROP_TAGS: removed by _drop_elements (linear time).
_RE_REF_NAME = re.compile(r"<(ref)\b", re.IGNORECASE)
_RE_DROP_NAME = re.compile(rf"<({_DROP_TAGS})\b", re.IGNORECASE)
_RE_DROP_CLOSE = re.compile(rf"</({_DROP_TAGS})\s*>", re.IGNORECASE)
_RE_TAG = re.compile(r"</?[a-zA-Z][a-zA-Z0-9]*\b[^<>]*?/?>")
_RE_BR = re.compile(r"<br\s*/?>", re.IGNORECASE)
# The innermost {{...}} / [[...]]: no "{{" or "}}" ("[[", "]]") inside. Runs of other characters are taken at once
# and never given back (possessive), the same matches as the tempered `(?:(?!\{\{|\}\}).)*` at a fraction of its cost.
_RE_TEMPLATE = re.compile(r"\{\{(?:[^{}]++|\{(?!\{)|\}(?!\}))*+\}\}")
_RE_TABLE = re.compile(r"\{\|(?:(?!\{\||\|\}).)*\|\}", re.DOTALL)
_RE_LINK = re.compile(r"\[\[((?:[^\[\]]++|\[(?!\[)|\](?!\]))*+)\]\]")
_RE_EXTERNAL = re.compile(r"\[(?:https?:|ftp:)?//[^\s\]]*\s*([^\]]*)\]")
_RE_BOLD_ITALIC = re.compile(r"''+")  # (not '{2,}: the literal prefix lets re search for it fast)
_RE_MAGIC = re.compile(r"__[A-Z]+__")
# Paragraph clean-up, applied to all paragraphs at once (joined by "\n"): no pattern matches a newline.
_RE_EMPTY_PARENS = re.compile(r"\([^\S\n]*(?:[,;:][^\S\n]*)?\)")
_RE_PAREN_LEAD = re.compile(r"\([^\S\n]*[,;:][^\S\n]*")
# A run of two or more of [ \t\u00a0], or a lone tab or no-break space, becomes one space (a lone space stays). The
# pattern opens with one character class, which re scans for at C speed (the alternation `[ \t\u00a0]{2,}|[\t\u00a0]`
# was tried at every position).
_RE_SPACES = re.compile(r"[ \t\u00a0](?:(?<= )[ \t\u00a0]+|(?<=[\t\u00a0])[ \t\u00a0]*)")
_SPACE_PUNCT = [(" " + c, c) for c in ",.;:!?)"]  # after _RE_SPACES: a space before punctuation goes


# Every pass of a nested construct (templates, tables, links) removes one level and costs a pass over the page, so
# passes are capped: real pages nest a few levels, and a hostile "[[[[..." page stays linear. Deeper levels are
# left as they are (their braces are removed later).
_MAX_NESTING = 64


def _replace_until_stable(pattern: re.Pattern, repl, text: str) -> str:
    for _ in range(_MAX_NESTING):
        new = pattern.sub(repl, text)
        if new == text:
            break
        text = new
    return text


def _drop_elements(text: str, name: re.Pattern, closing: re.Pattern | None) -> str:
    """Remove `<name ...>...</name>` (when `closing` finds closing tags) and `<name .../>` from `text`.

    The same as re.sub of `<(name)\\b[^>]*?(?:/>|>.*?</\\1\\s*>)` (DOTALL, IGNORECASE), or of `<ref\\b[^>]*/>` with
    closing=None, in linear time: that regex scanned to the next `>` and then to the end of the page for every
    tag left unclosed, quadratic on a page of them. Here the end of each opening tag comes from a forward-only
    search for `>`, and its closing tag from a bisection in the closing tags found in one pass.
    """
    closes: dict[str, list[tuple[int, int]]] = {}
    for m in closing.finditer(text) if closing is not None else ():
        closes.setdefault(m.group(1).lower(), []).append((m.start(), m.end()))
    out, pos, search, gt = [], 0, 0, -1
    while (m := name.search(text, search)) is not None:
        if gt < m.end():  # the first ">" at or after the tag name (candidates only move forward)
            gt = text.find(">", m.end())
            gt = len(text) if gt < 0 else gt
        end = None
        if gt < len(text):
            if gt - 1 >= m.end() and text[gt - 1] == "/":
                end = gt + 1  # <name .../>
            elif closing is not None:
                spans = closes.get(m.group(1).lower(), [])
                i = bisect.bisect_left(spans, (gt + 1,))  # the first closing tag after the opening one
                end = spans[i][1] if i < len(spans) else None
        if end is None:
            search = m.start() + 1
            continue
        out.append(text[pos : m.start()])
        pos = search = end
    out.append(text[pos:])
    return "".join(out)


def _external_links(text: str) -> str:
    """[http://url label] -> label. Only text up to the last "]" can hold one; the rest is not searched, so a page
    of unclosed "[//" costs linear time (the regex scanned to the end of the page for each)."""
    last = text.rfind("]") + 1
    return _RE_EXTERNAL.sub(r"\1", text[:last]) + text[last:]


def _heading(line: str) -> str | None:
    """The title of a `== Title ==` line (stripped), or None: the `=` runs at both ends, the shorter one wins.

    Plain string work: the regex `^(=+)\\s*(.*?)\\s*\\1\\s*$` took cubic time on a long run of `=`.
    """
    level = min(len(line) - len(line.lstrip("=")), len(line) - len(line.rstrip("=")), len(line) // 2)
    return line[level : len(line) - level].strip() if level else None


def _link(match: re.Match) -> str:
    target, _, label = match.group(1).partition("|")
    prefix, colon, _ = target.partition(":")
    prefix = prefix.strip().lower()
    if colon and prefix in _LINK_NAMESPACES:
        return ""  # files, images, categories
    if label:
        return label.rsplit("|", 1)[-1]
    if colon and re.fullmatch(
        r"[a-z]{2,3}(-[a-z]+)*|simple|wikt|wiktionary|commons|meta|wikipedia|wp|template|help|portal|[sqbnv]", prefix
    ):
        return ""  # an interlanguage / interwiki link without a label
    return target.lstrip(":").split("#", 1)[0] or target.split("#", 1)[-1]


def strip_wikitext(text: str) -> str:
    """Wikitext to plain prose: templates (nested), tables, refs, comments, files, categories and
    interlanguage links removed; [[target|label]] → label; '''bold''' and ''italic'' unmarked; HTML tags
    removed keeping their text; headings become their own paragraph; reference sections dropped.
    Paragraphs are separated by a blank line."""
    # Each construct is looked for only when its opening characters occur: a page of plain prose costs a few scans.
    if "<!--" in text:
        text = _RE_COMMENT.sub("", text)
    if "<" in text:
        text = _drop_elements(text, _RE_REF_NAME, None)
        text = _drop_elements(text, _RE_DROP_NAME, _RE_DROP_CLOSE)
    if "{{" in text:
        text = _replace_until_stable(_RE_TEMPLATE, "", text)
    if "{|" in text:
        text = _replace_until_stable(_RE_TABLE, "", text)
    if "[[" in text:
        text = _replace_until_stable(_RE_LINK, _link, text)
    if "[" in text:
        text = _external_links(text)
    if "<" in text:
        text = _RE_BR.sub(" ", text)
        text = _RE_TAG.sub("", text)
    if "''" in text:
        text = _RE_BOLD_ITALIC.sub("", text)
    if "__" in text:
        text = _RE_MAGIC.sub("", text)
    text = text.replace("{{", "").replace("}}", "")
    if "&" in text:
        text = html.unescape(text)

    paragraphs: list[str] = []
    current: list[str] = []
    dropping = False

    def flush():
        if current:
            paragraphs.append(" ".join(current))
            current.clear()

    for raw in text.split("\n"):
        line = raw.strip()
        title = _heading(line)
        if title is not None:
            flush()
            dropping = title.lower() in _DROP_SECTIONS
            if title and not dropping:
                paragraphs.append(title)
            continue
        if dropping:
            continue
        if not line or line.startswith(("|", "!")) or set(line) <= {"-"}:
            flush()
            continue
        if line[0] in "*#:;":  # list item / indentation: its own paragraph
            flush()
            line = line.lstrip("*#:; ")
            if line:
                paragraphs.append(line)
            continue
        current.append(line)
    flush()

    text = _RE_EMPTY_PARENS.sub("", "\n".join(paragraphs))  # a paragraph holds no "\n"
    text = _RE_PAREN_LEAD.sub("(", text)
    if "  " in text or "\t" in text or "\u00a0" in text:
        text = _RE_SPACES.sub(" ", text)
    for spaced, mark in _SPACE_PUNCT:
        text = text.replace(spaced, mark)
    cleaned = (p.strip() for p in text.split("\n"))
    return "\n\n".join(p for p in cleaned if any(c.isalnum() for c in p))
