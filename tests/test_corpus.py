import bz2
import gzip
import json
import os
import tracemalloc
import uuid
from pathlib import Path

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from albert_core.text.corpus import list_inputs, read_documents
from albert_core.text.records import CorpusError, Document, Skip
from albert_core.text.sentences import split_sentences
from albert_core.text.wikitext import strip_wikitext


def docs(records):
    return [r for r in records if isinstance(r, Document)]


def skips(records):
    return [r for r in records if isinstance(r, Skip)]


def write(path: Path, data: bytes | str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
    return path


# ---------------------------------------------------------------------------------------------------------
# plain text


def test_text_files_are_one_document_each_in_sorted_order(tmp_path):
    write(tmp_path / "b.txt", "Second file.\n")
    write(tmp_path / "a.txt", "First file.\nStill first.\n")
    records = list(read_documents(str(tmp_path)))
    assert [(Path(r.source).name, r.location, r.text) for r in records] == [
        ("a.txt", "file", "First file.\nStill first.\n"),
        ("b.txt", "file", "Second file.\n"),
    ]


def test_blank_line_split_yields_each_paragraph_with_its_first_line(tmp_path):
    write(tmp_path / "c.txt", "\nOne a.\nOne b.\n\n\nTwo.\n   \nThree.")
    records = list(read_documents(str(tmp_path / "c.txt"), split="blank_line"))
    assert [(r.location, r.text) for r in records] == [
        ("line 2", "One a.\nOne b.\n"),
        ("line 6", "Two.\n"),
        ("line 8", "Three."),
    ]


def test_directories_are_walked_recursively_skipping_hidden_and_unknown_files(tmp_path):
    write(tmp_path / "z" / "deep" / "x.txt", "deep")
    write(tmp_path / "a.txt", "top")
    write(tmp_path / ".hidden.txt", "hidden")
    write(tmp_path / "_SUCCESS", "")
    write(tmp_path / "SOURCES.json", "{}")
    files = list_inputs(str(tmp_path))
    assert [os.path.relpath(f, tmp_path) for f in files] == ["a.txt", "z/deep/x.txt"]


def test_glob_patterns_expand_in_sorted_order(tmp_path):
    for name in ["b.txt", "a.txt", "c.md"]:
        write(tmp_path / name, name)
    assert [Path(f).name for f in list_inputs(str(tmp_path / "*.txt"))] == ["a.txt", "b.txt"]


def test_gzip_and_bz2_files_are_decompressed_transparently(tmp_path):
    write(tmp_path / "a.txt.gz", gzip.compress(b"gzip text"))
    write(tmp_path / "b.txt.bz2", bz2.compress(b"bz2 text"))
    assert [r.text for r in read_documents(str(tmp_path))] == ["gzip text", "bz2 text"]


def test_fsspec_urls_are_read():
    root = f"memory://corpus-{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    with fs.open(f"{root}/one.txt", "wb") as f:
        f.write(b"in memory")
    with fs.open(f"{root}/two.jsonl", "wb") as f:
        f.write(b'{"text": "a record"}\n')
    records = list(read_documents(root))
    assert [(r.source.rsplit("/", 1)[-1], r.text) for r in records] == [
        ("one.txt", "in memory"),
        ("two.jsonl", "a record"),
    ]
    assert all(r.source.startswith("memory://") and fsspec.open(r.source).fs.exists(r.source) for r in records)


def test_byte_order_mark_and_crlf_are_normalized(tmp_path):
    write(tmp_path / "w.txt", b"\xef\xbb\xbfWindows line.\r\nNext.\r\n")
    (record,) = read_documents(str(tmp_path / "w.txt"))
    assert record.text == "Windows line.\nNext.\n"


def test_invalid_utf8_is_skipped_and_reading_goes_on(tmp_path):
    write(tmp_path / "a.txt", b"good start\nbad \xff byte\n")
    write(tmp_path / "b.txt", "still read")
    records = list(read_documents(str(tmp_path)))
    assert [type(r) for r in records] == [Skip, Document]
    assert records[0].reason == "invalid_utf8" and "line 2" in records[0].detail
    assert records[1].text == "still read"


def test_invalid_utf8_fails_naming_file_and_line(tmp_path):
    path = write(tmp_path / "a.txt", b"good\nbad \xff byte\n")
    with pytest.raises(CorpusError, match=rf"{path}.*line 2, column 5: expected UTF-8"):
        list(read_documents(str(path), on_error="fail"))


def test_invalid_utf8_in_a_paragraph_skips_only_that_paragraph(tmp_path):
    write(tmp_path / "p.txt", b"first ok\n\nsecond \xc3( bad\nsecond more\n\nthird ok\n")
    records = list(read_documents(str(tmp_path / "p.txt"), split="blank_line"))
    assert [(type(r).__name__, r.location) for r in records] == [
        ("Document", "line 1"),
        ("Skip", "line 3"),
        ("Document", "line 6"),
    ]


def test_utf8_sequence_cut_by_end_of_file_is_invalid(tmp_path):
    write(tmp_path / "t.txt", b"caf" + "é".encode()[:1])
    (record,) = read_documents(str(tmp_path / "t.txt"))
    assert record.reason == "invalid_utf8"


def test_binary_files_are_skipped(tmp_path):
    write(tmp_path / "blob.txt", bytes(range(256)) * 10)
    write(tmp_path / "ok.txt", "text")
    records = list(read_documents(str(tmp_path)))
    assert [getattr(r, "reason", "doc") for r in records] == ["binary", "doc"]


def test_binary_file_fails_naming_the_file(tmp_path):
    path = write(tmp_path / "blob.txt", b"\x00\x01\x02")
    with pytest.raises(CorpusError, match=rf"{path}: file: binary: NUL byte"):
        list(read_documents(str(path), on_error="fail"))


def test_empty_file_and_blank_document_are_skipped_as_empty(tmp_path):
    write(tmp_path / "a.txt", b"")
    write(tmp_path / "b.txt", " \n\t\n")
    records = list(read_documents(str(tmp_path)))
    assert [(Path(r.source).name, r.reason) for r in records] == [("a.txt", "empty"), ("b.txt", "empty")]


def test_empty_file_fails(tmp_path):
    path = write(tmp_path / "a.txt", b"")
    with pytest.raises(CorpusError, match="empty"):
        list(read_documents(str(path), on_error="fail"))


def test_a_50mb_line_is_skipped_as_too_long_with_bounded_memory(tmp_path):
    with open(tmp_path / "a_huge.txt", "wb") as f:
        for _ in range(50):
            f.write(b"x" * 1_000_000)
        f.write(b"\n")
    write(tmp_path / "b_after.txt", "after the huge file")
    tracemalloc.start()
    try:
        records = list(read_documents(str(tmp_path)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [getattr(r, "reason", "doc") for r in records] == ["too_long", "doc"]
    assert peak < 16_000_000


def test_a_50mb_line_in_jsonl_and_paragraph_mode_is_skipped_and_the_next_read(tmp_path):
    huge = b"y" * 50_000_000
    write(tmp_path / "h.jsonl", b'{"text": "' + huge + b'"}\n{"text": "next"}\n')
    write(tmp_path / "h.txt", huge + b"\n\nnext\n")
    jsonl = list(read_documents(str(tmp_path / "h.jsonl")))
    text = list(read_documents(str(tmp_path / "h.txt"), split="blank_line"))
    for records in (jsonl, text):
        assert [getattr(r, "reason", "doc") for r in records] == ["too_long", "doc"]
        assert records[1].text.strip() == "next"


def test_max_document_chars_bounds_each_document(tmp_path):
    write(tmp_path / "a.txt", "12345")
    write(tmp_path / "b.txt", "123456")
    records = list(read_documents(str(tmp_path), max_document_chars=5))
    assert [getattr(r, "reason", "doc") for r in records] == ["doc", "too_long"]


def test_missing_path_is_a_skip(tmp_path):
    records = list(read_documents(str(tmp_path / "nope.txt")))
    assert [(r.reason, r.source) for r in records] == [("missing", str(tmp_path / "nope.txt"))]


def test_missing_path_fails_naming_it(tmp_path):
    with pytest.raises(CorpusError, match=r"nope\.txt: file: missing"):
        list(read_documents(str(tmp_path / "nope.txt"), on_error="fail"))


def test_corrupt_compressed_file_is_unreadable_and_reading_goes_on(tmp_path):
    write(tmp_path / "a.txt.gz", b"this is not gzip data at all")
    write(tmp_path / "b.txt", "fine")
    records = list(read_documents(str(tmp_path)))
    assert [getattr(r, "reason", "doc") for r in records] == ["unreadable", "doc"]


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root reads files without permission")
def test_file_without_read_permission_is_unreadable(tmp_path):
    path = write(tmp_path / "secret.txt", "x")
    path.chmod(0)
    (record,) = read_documents(str(path))
    assert record.reason == "unreadable"


def test_unknown_extension_given_explicitly_needs_a_format(tmp_path):
    path = write(tmp_path / "data.csv", "a,b\n")
    (record,) = read_documents(str(path))
    assert record.reason == "unknown_format"
    assert [r.text for r in read_documents(str(path), fmt="text")] == ["a,b\n"]


def test_invalid_arguments_are_rejected():
    with pytest.raises(ValueError, match="fmt"):
        list(read_documents("x", fmt="csv"))
    with pytest.raises(ValueError, match="on_error"):
        list(read_documents("x", on_error="ignore"))


# ---------------------------------------------------------------------------------------------------------
# JSONL


def test_jsonl_records_become_documents_and_blank_lines_are_ignored(tmp_path):
    write(tmp_path / "d.jsonl", '{"text": "one"}\n\n{"text": "two", "id": 2}\n')
    records = list(read_documents(str(tmp_path / "d.jsonl")))
    assert [(r.location, r.text) for r in records] == [("line 1", "one"), ("line 3", "two")]


def test_jsonl_text_field_is_configurable(tmp_path):
    write(tmp_path / "d.jsonl", '{"body": "custom"}\n')
    assert [r.text for r in read_documents(str(tmp_path / "d.jsonl"), text_field="body")] == ["custom"]


def test_malformed_jsonl_records_are_skipped_and_later_records_read(tmp_path):
    lines = ['{"text": "ok"}', '{"text": broken', '{"title": "no text"}', "[1, 2]", '{"text": 5}', '{"text": ""}']
    write(tmp_path / "d.jsonl", "\n".join([*lines, '{"text": "last"}']) + "\n")
    records = list(read_documents(str(tmp_path / "d.jsonl")))
    assert [(r.location, getattr(r, "reason", "doc")) for r in records] == [
        ("line 1", "doc"),
        ("line 2", "malformed_record"),
        ("line 3", "missing_field"),
        ("line 4", "malformed_record"),
        ("line 5", "malformed_record"),
        ("line 6", "empty"),
        ("line 7", "doc"),
    ]


def test_malformed_jsonl_fails_naming_file_line_and_expectation(tmp_path):
    path = write(tmp_path / "d.jsonl", '{"text": "ok"}\n{"text": broken\n')
    with pytest.raises(CorpusError, match=rf"{path}: line 2: malformed_record: expected a JSON object"):
        list(read_documents(str(path), on_error="fail"))


def test_jsonl_missing_text_field_fails_naming_the_field(tmp_path):
    path = write(tmp_path / "d.jsonl", '{"title": "t"}\n')
    with pytest.raises(CorpusError, match=r"line 1: missing_field: no 'text' field \(fields: title\)"):
        list(read_documents(str(path), on_error="fail"))


# ---------------------------------------------------------------------------------------------------------
# Parquet


def test_parquet_rows_become_documents_and_nulls_are_skipped(tmp_path):
    pq.write_table(pa.table({"text": ["first", None, "third"], "n": [1, 2, 3]}), tmp_path / "d.parquet")
    records = list(read_documents(str(tmp_path / "d.parquet")))
    assert [(r.location, r.text if isinstance(r, Document) else r.reason) for r in records] == [
        ("row 1", "first"),
        ("row 2", "empty"),
        ("row 3", "third"),
    ]


def test_parquet_without_the_text_column_is_skipped_naming_the_columns(tmp_path):
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "d.parquet")
    (record,) = read_documents(str(tmp_path / "d.parquet"))
    assert record.reason == "missing_field" and "columns: body" in record.detail


def test_corrupt_parquet_is_skipped(tmp_path):
    write(tmp_path / "d.parquet", b"PAR1 definitely not parquet")
    (record,) = read_documents(str(tmp_path / "d.parquet"))
    assert record.reason == "malformed_parquet"


# ---------------------------------------------------------------------------------------------------------
# MediaWiki XML

NS = "http://www.mediawiki.org/xml/export-0.10/"


def page(title: str, page_id: int, text: str, ns: int = 0, redirect: str | None = None) -> str:
    from xml.sax.saxutils import escape

    redirect_tag = f'<redirect title="{redirect}" />' if redirect else ""
    return (
        f"<page><title>{title}</title><ns>{ns}</ns><id>{page_id}</id>{redirect_tag}"
        f'<revision><id>1</id><text xml:space="preserve">{escape(text)}</text></revision></page>\n'
    )


def export(*pages: str, close: bool = True) -> str:
    head = f'<mediawiki xmlns="{NS}" version="0.10"><siteinfo><sitename>W</sitename></siteinfo>\n'
    return head + "".join(pages) + ("</mediawiki>\n" if close else "")


ARTICLE = "'''Tide''' is the rise and fall of the [[sea|ocean]].{{citation needed}}\n\n== History ==\nOld."


def test_mediawiki_articles_become_prose_and_other_pages_are_counted_skips(tmp_path):
    xml = export(
        page("Tide", 1, ARTICLE),
        page("Tides", 2, "#REDIRECT [[Tide]]", redirect="Tide"),
        page("Talk:Tide", 3, "Talk page.", ns=1),
        page("Box", 4, "{{Infobox}}[[Category:Things]]"),
        page("Moon", 5, "The [[Moon]] pulls the sea."),
    )
    write(tmp_path / "dump.xml.bz2", bz2.compress(xml.encode()))
    records = list(read_documents(str(tmp_path / "dump.xml.bz2")))
    assert [(r.location, getattr(r, "reason", "doc")) for r in records] == [
        ("page 1 (Tide)", "doc"),
        ("page 2 (Tides)", "redirect"),
        ("page 3 (Talk:Tide)", "namespace"),
        ("page 4 (Box)", "markup_only"),
        ("page 5 (Moon)", "doc"),
    ]
    assert records[0].text == "Tide is the rise and fall of the ocean.\n\nHistory\n\nOld."


def test_redirects_and_other_namespaces_do_not_fail(tmp_path):
    xml = export(page("R", 1, "#REDIRECT [[X]]"), page("User:U", 2, "hi", ns=2), page("A", 3, "Prose."))
    path = write(tmp_path / "dump.xml", xml)
    records = list(read_documents(str(path), on_error="fail"))
    assert [getattr(r, "reason", "doc") for r in records] == ["redirect", "namespace", "doc"]


def test_malformed_xml_keeps_the_pages_before_it_and_is_a_skip(tmp_path):
    xml = export(page("A", 1, "Good prose."), close=False) + "<page><title>B</title><ns>0</ns></pag>"
    write(tmp_path / "bad.xml", xml)
    write(tmp_path / "good.txt", "next file")
    records = list(read_documents(str(tmp_path)))
    assert [getattr(r, "reason", "doc") for r in records] == ["doc", "malformed_xml", "doc"]
    assert records[1].location.startswith("line 3, column")


def test_malformed_xml_fails_naming_file_and_line(tmp_path):
    path = write(tmp_path / "bad.xml", export(page("A", 1, "Good."), close=False) + "<page></pag>")
    with pytest.raises(CorpusError, match=rf"{path}: line 3, column \d+: malformed_xml: expected well-formed XML"):
        list(read_documents(str(path), on_error="fail"))


def test_xml_that_is_not_a_mediawiki_export_is_malformed(tmp_path):
    path = write(tmp_path / "other.xml", "<html><body>hi</body></html>")
    (record,) = read_documents(str(path))
    assert record.reason == "malformed_xml" and "<mediawiki>" in record.detail


def test_every_input_document_is_accounted_for(tmp_path):
    write(tmp_path / "a.jsonl", '{"text": "1"}\nnot json\n{"text": "3"}\n')
    write(tmp_path / "b.txt", b"bad \xff")
    write(tmp_path / "c.txt", "fine")
    write(tmp_path / "d.xml", export(page("A", 1, "x"), page("B", 2, "#redirect [[A]]")))
    records = list(read_documents(str(tmp_path)))
    assert (len(docs(records)), len(skips(records))) == (4, 3)


# ---------------------------------------------------------------------------------------------------------
# wikitext


def test_nested_templates_are_removed():
    assert strip_wikitext("A {{outer|x={{inner|{{deep}}}}|y}}B.") == "A B."


def test_links_keep_their_label_or_target_and_link_trails():
    assert strip_wikitext("See [[Ocean|the sea]], [[Moon]] and [[bus]]es.") == "See the sea, Moon and buses."


def test_files_categories_and_interlanguage_links_are_removed():
    text = "[[File:x.jpg|thumb|A [[boat]] at sea]]Prose here.\n[[Category:Boats]]\n[[de:Boot]]"
    assert strip_wikitext(text) == "Prose here."


def test_bold_italic_refs_comments_and_tags_are_removed_keeping_text():
    text = "'''Bold''' and ''italic''<ref name=\"a/b\">cite</ref><ref name=c/> <!-- note --><span>kept</span>&amp;"
    assert strip_wikitext(text) == "Bold and italic kept&"


def test_tables_are_removed():
    assert strip_wikitext("Before.\n{| class=x\n|-\n| a || b\n{|\n|c\n|}\n|}\nAfter.") == "Before.\n\nAfter."


def test_headings_become_paragraphs_and_reference_sections_are_dropped():
    text = "Intro.\n== Life ==\nBorn.\n== References ==\n* A book.\n== Legacy ==\nRemembered."
    assert strip_wikitext(text) == "Intro.\n\nLife\n\nBorn.\n\nLegacy\n\nRemembered."


def test_external_links_keep_their_label():
    assert strip_wikitext("Read [http://example.org the site] now [http://x.org].") == "Read the site now."


# ---------------------------------------------------------------------------------------------------------
# sentences


def test_sentences_split_at_terminal_punctuation():
    assert split_sentences("It rained. Was it cold? Yes! We left.") == [
        "It rained.",
        "Was it cold?",
        "Yes!",
        "We left.",
    ]


def test_titles_and_abbreviations_do_not_end_sentences():
    text = "Mr. Smith met Dr. Jones at No. 5 Main St. on Jan. 3rd. They talked."
    assert split_sentences(text) == ["Mr. Smith met Dr. Jones at No. 5 Main St. on Jan. 3rd.", "They talked."]


def test_acronyms_end_a_sentence_only_before_a_sentence_opener():
    assert split_sentences("He served in the U.S. Army for years.") == ["He served in the U.S. Army for years."]
    assert split_sentences("He moved to the U.S. He liked it.") == ["He moved to the U.S.", "He liked it."]


def test_lower_case_next_word_never_starts_a_sentence():
    assert split_sentences("Use tools, e.g. hammers, i.e. heavy ones. Done.") == [
        "Use tools, e.g. hammers, i.e. heavy ones.",
        "Done.",
    ]


def test_decimals_and_initials_do_not_split():
    assert split_sentences("Pi is 3.14 roughly. J. R. R. Tolkien agreed.") == [
        "Pi is 3.14 roughly.",
        "J. R. R. Tolkien agreed.",
    ]


def test_quotes_close_with_their_sentence():
    assert split_sentences('"Go!" she said. He said "Stop." Then he left.') == [
        '"Go!" she said.',
        'He said "Stop."',
        "Then he left.",
    ]


def test_etc_ends_a_sentence_before_a_capital_only():
    assert split_sentences("Ropes, nets, etc. were sold. Ships, boats, etc. The end.") == [
        "Ropes, nets, etc. were sold.",
        "Ships, boats, etc.",
        "The end.",
    ]


def test_paragraph_breaks_split_and_line_wraps_join():
    assert split_sentences("A heading\n\nA wrapped\nsentence. Next one") == [
        "A heading",
        "A wrapped sentence.",
        "Next one",
    ]


def test_cjk_full_stops_split_without_spaces():
    assert split_sentences("東京は首都です。港があります。") == ["東京は首都です。", "港があります。"]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.sampled_from([*"ab .!?\n\"'", "U.S.", "Mr.", " The", "e.g.", "。", "\n\n"]), max_size=40).map("".join)
)
def test_sentences_keep_every_non_space_character_in_order(text):
    sentences = split_sentences(text)
    assert "".join("".join(s.split()) for s in sentences) == "".join(text.split())
    assert all(s == s.strip() and s for s in sentences)


def test_jsonl_written_by_json_dumps_round_trips_unicode(tmp_path):
    texts = ["naïve café", "東京", 'quote " and \\ backslash']
    write(tmp_path / "u.jsonl", "\n".join(json.dumps({"text": t}) for t in texts))
    assert [r.text for r in read_documents(str(tmp_path / "u.jsonl"))] == texts
