"""A rule-based sentence splitter (`split_sentences`): paragraphs, terminators, abbreviations, initials, acronyms."""

from __future__ import annotations

import re

# Titles and abbreviations that do not end a sentence before a capitalized word or a number.
_ABBREVIATIONS = frozenset(
    """mr mrs ms dr prof rev hon gen gov sen rep col lt capt cmdr sgt maj adm brig st mt ft fr sr sra srta
    mme mlle messrs mssrs no nos vol vols fig figs pp p art ch sec secs op cf vs v viz approx ca dept
    univ assn bros jan feb mar apr jun jul aug sep sept oct nov dec""".split()
)
# Abbreviations that often end a sentence too: a boundary if the next word is capitalized.
_FINAL_ABBREVIATIONS = frozenset("etc inc ltd co corp jr esq al".split())
# Words that begin sentences: after an acronym ("U.S."), a boundary only before one of these.
_STARTERS = frozenset(
    """a an the this that these those it its he she we they i you his her our their my your there here
    but and or so yet if when while as after before in on at for of to from by with however meanwhile
    then thus today tomorrow yesterday what who why how where which no not all some many most""".split()
)
_OPEN_PUNCT = "\"'“‘«([{"
# A terminator: '.', '!', '?' or '…' (then closing quotes/brackets) before whitespace or the end, or CJK full stops
# (then their closers) anywhere; the word after it in a lookahead (group 1). The pattern opens with one character
# class, so the regex engine scans for it at C speed (an alternation at the top would be tried at every position).
_RE_SENTENCE_END = re.compile(
    r"[.!?…。！？](?:(?<=[.!?…])[.!?…]*[\"'”’»)\]]*(?=\s|$)|(?<=[。！？])[。！？]*[\"”’」』)]*)(?=\s*(\S*))"
)
_RE_PARAGRAPH = re.compile(r"\n\s*\n")
_RE_ACRONYM = re.compile(r"(?:[A-Za-z]\.)+[A-Za-z]")  # "U.S", "e.g", "a.m"


def _is_boundary(para: str, start: int, match: re.Match, next_word: str) -> bool:
    """Whether the terminator `match` of `para` (the current sentence begins at `start`) ends a sentence before
    `next_word` (not empty)."""
    terminator = match.group()
    if terminator[0] in "。！？":
        return True
    first = next_word.lstrip(_OPEN_PUNCT)[:1]
    if first.islower():
        return False  # "e.g. the", "approx. five", '"Go!" she said'
    if "!" in terminator or "?" in terminator:
        return True
    if not terminator.startswith(".") or terminator.startswith(".."):
        return True  # ellipsis before a capital
    # The word before the terminator, found by position (no copies of the paragraph's tail).
    word = para[max(start, para.rfind(" ", start, match.start()) + 1) : match.start()].lstrip(_OPEN_PUNCT)
    lower = word.lower()
    if lower in _ABBREVIATIONS:
        return False
    if lower in _FINAL_ABBREVIATIONS:
        return first.isupper()
    if len(word) == 1 and word.isupper() and word != "I":
        return False  # an initial: "J. R. R. Tolkien"
    if _RE_ACRONYM.fullmatch(word):
        return next_word.lstrip(_OPEN_PUNCT).lower().rstrip(",;:") in _STARTERS
    return True


def split_sentences(text: str) -> list[str]:
    """Rule-based sentence splitter. Paragraph breaks (blank lines) always end a sentence; single newlines
    and runs of whitespace become one space. A '.', '!', '?' or '…' (with closing quotes/brackets) followed
    by whitespace ends a sentence unless the next word is lower-case, or the period ends a title or
    abbreviation ("Mr.", "Dr.", "No. 5", "etc." before a lower-case word), an initial ("J. Smith") or an
    acronym not followed by a typical sentence opener ("the U.S. Army" vs "the U.S. He ..."). Decimals
    ("3.14") never split (no space after the period). CJK full stops split without a space."""
    sentences: list[str] = []
    for paragraph in _RE_PARAGRAPH.split(text):
        para = " ".join(paragraph.split())
        start = 0
        for match in _RE_SENTENCE_END.finditer(para):
            next_word = match.group(1)
            if next_word and not _is_boundary(para, start, match, next_word):
                continue
            end = match.end()
            sentence = para[start:end].strip()
            if sentence:
                sentences.append(sentence)
            start = end
        rest = para[start:].strip()
        if rest:
            sentences.append(rest)
    return sentences
