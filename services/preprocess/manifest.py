"""manifest.json of a shard set: one entry per *part* (the shards one `albert preprocess` or `--append-to` run
added), totals over every part, and the commit that rewrites it.

    {"version": 3, "config": <part 0's PreprocessConfig>, "tokenizer": {...}, "schema": [...],
     "documents", "sentences", "tokens", "examples", "example_tokens", "pair_counts": totals over the parts,
     "shards": every shard of every part in order, each with its "part" index (and "region" of a big file),
     "heldout": part 0's held-out file, "files": the counts of every input file of every part,
     "parts": [{"name", "inputs", "added", "shards", "examples", "tokens", "sentences", "example_tokens",
                "pair_counts", "documents", "heldout", "sha256", "document_ids", "unigram"}, ...],
     "unigram": the piece counts of this version (all its parts), "timings": of the run that wrote it}

Piece counts (albert_core.evaluation.unigram, the unigram baseline) are kept per part (`unigram/part-k.npy`, summed
from its units' counts) and per version of the set (`unigram/version-v.npy`: parts 0..v-1), each a new file written
before the manifest names it, so a run that trains on version v keeps its baseline when a part is appended.

A part's "sha256" is the sha256 of its shards' sha256s (hex) concatenated in order. The manifest is the commit point
of a part: its shards are on disk before the manifest lists them, and readers (`ShardsManifest.parts`, training)
see only what it lists. It is rewritten atomically while holding the set's manifest lock, after re-reading it
under that lock, so two runs never both commit the same part index.

Pure Python + numpy (piece counts) + pyarrow (counting a part made before parts had counts); no Ray.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from albert_core.evaluation.unigram import UnigramBaseline, count_pieces, part_unigram_file, version_unigram_file
from albert_core.examples.shards import EXAMPLE_SCHEMA, MANIFEST_FILE, TRAIN_DIR
from albert_core.files import atomic_write_json, file_lock, file_sha256, replacing
from services.preprocess.config import Unit
from services.preprocess.unit import MAX_SKIP_EXAMPLES

if TYPE_CHECKING:
    from albert_core.text.tokenization import AnyTokenizer
    from services.preprocess.layout import Layout

MANIFEST_VERSION = 3  # 2: "parts"; 3: documents known by the sha256 of their text, piece counts per part
DOCUMENT_IDS = "sha256(text)"  # a part's documents' identity (held-out choice, pair draws); before: file + location
COUNTS = ("examples", "tokens", "sentences", "example_tokens")  # per part, summed over parts at the top level


def read_manifest(root: Path) -> dict[str, Any] | None:
    path = root / MANIFEST_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def part_checksum(shards: Sequence[dict]) -> str:
    """A part's sha256: of its shards' sha256s (hex), concatenated in order."""
    return hashlib.sha256("".join(s["sha256"] for s in shards).encode()).hexdigest()


def count_documents(files: dict[str, dict]) -> dict[str, Any]:
    """Documents read / used / held out / skipped (by reason) over these files' counts; they must add up."""
    skipped: Counter[str] = Counter()
    for stats in files.values():
        skipped.update(stats["skipped"])
    documents = {
        "read": sum(stats["documents"] for stats in files.values()),
        "used": sum(stats["used"] for stats in files.values()),
        "heldout": sum(stats["heldout"] for stats in files.values()),
        "skipped": sum(skipped.values()),
        "skipped_by_reason": dict(sorted(skipped.items())),
    }
    if documents["read"] != documents["used"] + documents["heldout"] + documents["skipped"]:
        raise AssertionError(f"document accounting does not add up: {documents}")
    return documents


def merge_file_stats(into: dict[str, dict], files: dict[str, dict]) -> None:
    """Add one unit's counts per input file to `into` (a big file's counts come from each of its units)."""
    for path, stats in files.items():
        if path not in into:
            into[path] = json.loads(json.dumps(stats))
            continue
        total = into[path]
        for key in ("documents", "used", "heldout", "sentences", "tokens"):
            total[key] += stats[key]
        for reason, n in stats["skipped"].items():
            total["skipped"][reason] = total["skipped"].get(reason, 0) + n
        room = MAX_SKIP_EXAMPLES - len(total["skip_examples"])
        total["skip_examples"].extend(stats["skip_examples"][: max(room, 0)])


def part_entry(
    name: str, inputs: list[str], summaries: Sequence[dict], heldout: tuple[str, str]
) -> tuple[dict[str, Any], dict[str, dict]]:
    """(the part's manifest entry, its input files' counts) from its units' done markers, in unit order;
    `heldout`: the part's held-out file (relative to the set) and its sha256."""
    files: dict[str, dict] = {}
    pair_counts: Counter[str] = Counter()
    for summary in summaries:
        merge_file_stats(files, summary["files"])
        pair_counts.update(summary["pair_counts"])
    documents = count_documents(files)
    shards = []
    for s in summaries:
        shard = {"name": f"{TRAIN_DIR}/{s['shard']}", "rows": s["rows"], "sha256": s["sha256"]}
        shards.append({**shard, "files": list(s["files"]), **({"region": s["region"]} if s.get("region") else {})})
    entry = {
        "name": name,
        "inputs": list(inputs),
        "added": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "shards": shards,
        "examples": sum(s["rows"] for s in summaries),
        "tokens": sum(stats["tokens"] for stats in files.values()),
        "sentences": sum(stats["sentences"] for stats in files.values()),
        "example_tokens": sum(s["example_tokens"] for s in summaries),
        "pair_counts": dict(sorted(pair_counts.items())),
        "documents": documents,
        "heldout": {"file": heldout[0], "documents": documents["heldout"], "sha256": heldout[1]},
        "sha256": part_checksum(shards),
        "document_ids": DOCUMENT_IDS,
    }
    return entry, files


def stored_parts(manifest: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The parts a manifest lists; one written before parts existed (version 1) is one part, rebuilt from its top
    level; no manifest has none."""
    if manifest is None:
        return []
    if "parts" in manifest:
        return list(manifest["parts"])
    shards = [{k: v for k, v in s.items() if k != "part"} for s in manifest["shards"]]
    counts = {k: manifest[k] for k in (*COUNTS, "pair_counts", "documents")}
    part = {"name": "part-0", "inputs": manifest["config"]["inputs"], "added": None, "shards": shards, **counts}
    return [{**part, "heldout": manifest["heldout"], "sha256": part_checksum(shards)}]


def part_files(part: dict[str, Any], files: dict[str, dict]) -> dict[str, dict]:
    """The counts of a part's input files, out of the manifest's "files"."""
    return {path: files[path] for shard in part["shards"] for path in shard["files"]}


def part_view(manifest: dict[str, Any], index: int) -> dict[str, Any]:
    """Part `index` with its files' counts: what the console reports of the run that made it."""
    part = manifest["parts"][index]
    return {**part, "files": part_files(part, manifest["files"])}


def _with_part(old: dict | None, index: int, entry: dict, files: dict, where: Path) -> tuple[list[dict], dict]:
    """(the parts, the files' counts) once part `index` is `entry`: part 0 replaced (the later parts kept), or a
    new last part (ValueError if the set no longer has `index` parts: another run committed it first)."""
    parts = stored_parts(old)
    if index == 0:
        if parts and len(parts) > 1 and len(parts[0]["shards"]) != len(entry["shards"]):
            raise ValueError(f"{where}: part 0 would change its number of shards under the parts appended to it")
        if parts and parts[0]["sha256"] == entry["sha256"] and parts[0].get("added"):
            entry = {**entry, "added": parts[0]["added"]}  # the same shards: the same part as first added
        parts = [entry, *parts[1:]]
    elif len(parts) != index:
        raise ValueError(
            f"{where}: the shard set now has {len(parts)} parts, so this run can no longer add part {index} "
            "(another append committed first); delete this folder and run the append again"
        )
    else:
        parts = [*parts, entry]
    all_files: dict[str, dict] = {}
    for k, part in enumerate(parts):
        all_files.update(files if k == index else part_files(part, old["files"] if old else {}))
    return parts, all_files


def set_manifest(head: dict[str, Any], parts: list[dict], files: dict[str, dict]) -> dict[str, Any]:
    """The whole manifest: head (version, config, tokenizer, schema), the totals over `parts`, and the parts."""
    documents = Counter()
    skipped: Counter[str] = Counter()
    pair_counts: Counter[str] = Counter()
    for part in parts:
        documents.update({k: v for k, v in part["documents"].items() if k != "skipped_by_reason"})
        skipped.update(part["documents"]["skipped_by_reason"])
        pair_counts.update(part["pair_counts"])
    keys = ("read", "used", "heldout", "skipped")
    return {
        **head,
        "documents": {**{k: documents[k] for k in keys}, "skipped_by_reason": dict(sorted(skipped.items()))},
        **{name: sum(part[name] for part in parts) for name in ("sentences", "tokens", "examples", "example_tokens")},
        "pair_counts": dict(sorted(pair_counts.items())),
        "shards": [{**shard, "part": k} for k, part in enumerate(parts) for shard in part["shards"]],
        "heldout": parts[0]["heldout"],
        "files": files,
        "parts": parts,
    }


def manifest_head(config_json: dict[str, Any], tokenizer: AnyTokenizer) -> dict[str, Any]:
    """The version, config, tokenizer and schema of a shard set. The tokenizer is known by its kind (SentencePiece
    or WordPiece) and sha256 (of its spiece.model, or of its vocab.txt), with its special ids."""
    return {
        "version": MANIFEST_VERSION,
        "config": config_json,
        "tokenizer": {
            "path": config_json["tokenizer"],
            "kind": tokenizer.kind,
            "sha256": tokenizer.sha256,
            "vocab_size": tokenizer.vocab_size,
            "lower_case": tokenizer.lower_case,
            "keep_accents": tokenizer.keep_accents,
            "special_ids": {name: getattr(tokenizer, f"{name}_id") for name in ("pad", "unk", "cls", "sep", "mask")},
        },
        "schema": EXAMPLE_SCHEMA.names,
    }


def commit_part(
    layout: Layout, entry: dict, files: dict, head: dict, tokenizer: AnyTokenizer, timings: dict, units: Sequence[int]
) -> dict[str, Any]:
    """Write manifest.json with part `layout.part` = entry (`files`: its input files' counts, `units`: its unit
    numbers), under the set's manifest lock: the manifest re-read there, the piece counts of the part (summed over
    its units) and of the set's new version written to files of their own, then an atomic replace. Part 0 takes
    `head` (the run's config and tokenizer); a later part keeps the set's. Returns the manifest written."""
    root, index = layout.root, layout.part
    with file_lock(layout.lock):
        old = read_manifest(root)
        counts = sum_counts([layout.pieces(Unit(i, ())) for i in units], tokenizer)
        entry = {**entry, "unigram": _save_counts(root, part_unigram_file(index), counts)}
        parts, files = _with_part(old, index, entry, files, where=layout.progress)
        if index and old is not None:
            head = {**{k: old[k] for k in ("config", "tokenizer", "schema")}}
        manifest = set_manifest({**head, "version": MANIFEST_VERSION}, parts, files)
        version = sum_counts([_part_counts(root, k, part, tokenizer) for k, part in enumerate(parts)], tokenizer)
        manifest["unigram"] = _save_counts(root, version_unigram_file(len(parts)), version)
        manifest["timings"] = timings
        atomic_write_json(root / MANIFEST_FILE, manifest, "manifest.json as it was, and the finished units")
    return manifest


def sum_counts(paths: Sequence[Path], tokenizer: AnyTokenizer) -> UnigramBaseline:
    """The piece counts of these files (albert_core.evaluation.unigram's format) added up; special pieces count 0."""
    total = np.zeros(tokenizer.vocab_size, dtype=np.int64)
    for path in paths:
        total += UnigramBaseline.load_file(path, tokenizer.vocab_size).counts
    total[list(tokenizer.special_ids)] = 0
    return UnigramBaseline(total)


def _part_counts(root: Path, k: int, part: dict, tokenizer: AnyTokenizer) -> Path:
    """Part k's piece counts file; counted from its shards (by row group) for a part committed before parts had
    one."""
    path = root / part_unigram_file(k)
    if not (part.get("unigram") and path.is_file()):
        shards = [root / shard["name"] for shard in part["shards"]]
        part["unigram"] = _save_counts(root, part_unigram_file(k), count_pieces(shards, tokenizer.vocab_size, ()))
    return path


def _save_counts(root: Path, name: str, counts: UnigramBaseline) -> dict[str, str]:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    with replacing(path, partial, counts.counts.size * 8, "manifest.json as it was, and the finished units"):
        counts.save_as(partial)
    return {"file": name, "sha256": file_sha256(path)}
