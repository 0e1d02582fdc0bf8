"""The pretraining shard format: plain Arrow columns that pyarrow reads alone (no Ray tensor extension types).

One row is one `[CLS] A [SEP] B [SEP]` example. The preprocess service writes shards of these rows plus a
manifest; the training stream reads them and masks dynamically (`albert_core.examples.batch`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from albert_core.files import leaves_directory
from albert_core.text.tokenization import tokenizer_at

EXAMPLE_SCHEMA = pa.schema(
    [
        # Globally unique, stable across reruns: (shard index << 32) | row in shard. Seeds the dynamic masks.
        pa.field("example_id", pa.int64(), nullable=False),
        pa.field("input_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("token_type_ids", pa.list_(pa.int8()), nullable=False),
        # Whole-word starts per token (the masking unit).
        pa.field("word_starts", pa.list_(pa.bool_()), nullable=False),
        # SOP: 1 = swapped; NSP: 1 = random B; objective "none": -100.
        pa.field("pair_label", pa.int8(), nullable=False),
    ]
)

# How shards and held-out files are written: zstd, and a CRC32 of every page, which readers check (the training
# input reads with page_checksum_verification), so bytes changed on disk fail their row group's read instead of
# decoding into other token ids. Measured by bench/shard_checks.py on a 36 MB shard of 128 row groups: 6,864 bytes
# more (0.02%), no measurable write time, and reading every row group verified took 1-2% more CPU time (482 against
# 474 ms median of 15); a sha256 of the whole file, 32 ms (1.1 GB/s).
PARQUET_WRITE_OPTIONS: dict[str, Any] = {"compression": "zstd", "write_page_checksum": True}

MANIFEST_FILE = "manifest.json"  # the shard set's manifest (services/preprocess writes it)
TRAIN_DIR = "train"


class ManifestError(ValueError):
    """The shards manifest cannot be read; the message names the file."""


@dataclass(frozen=True)
class ShardsManifest:
    """What a shard set's manifest.json says, read once: its tokenizer and vocabulary size.

    The tokenizer entry is a path, or an object with "path" (and "vocab_size"), as services/preprocess writes; a
    relative path is tried as given, then under the shards directory. A missing manifest reads as empty.
    """

    directory: Path
    data: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def read(cls, shards_dir: str | Path) -> ShardsManifest:
        directory = Path(shards_dir)
        path = directory / MANIFEST_FILE
        if not path.is_file():
            return cls(directory)
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ManifestError(f"{path} is not valid JSON ({err})") from None
        if not isinstance(data, dict):
            raise ManifestError(f"{path}: expected a JSON object, got {type(data).__name__}")
        return cls(directory, data)

    @property
    def _tokenizer_entry(self) -> dict[str, Any]:
        entry = self.data.get("tokenizer")
        if isinstance(entry, str):
            return {"path": entry}
        return entry if isinstance(entry, dict) else {}

    def tokenizer_model(self) -> Path | None:
        """The tokenizer the shards were made with, as `albert_core.text.tokenization.load_tokenizer` reads it (a
        spiece.model, or a directory holding a WordPiece vocabulary): in the shards directory, in its tokenizer/
        folder, or where the manifest says; None when none of them holds one."""
        candidates = [self.directory, self.directory / "tokenizer"]
        named = self._tokenizer_entry.get("path")
        if isinstance(named, str):
            candidates.append(
                Path(named) if Path(named).is_absolute() or Path(named).exists() else self.directory / named
            )
        return next((found for path in candidates if (found := tokenizer_at(path)) is not None), None)

    @property
    def tokenizer_kind(self) -> str:
        """The kind of tokenizer the manifest records (SentencePiece when it says none: made before WordPiece)."""
        kind = self._tokenizer_entry.get("kind")
        return kind if isinstance(kind, str) and kind else "SentencePiece"

    @property
    def special_ids(self) -> dict[str, int]:
        """The special ids the manifest records as {"pad_id": ..., "unk_id", "cls_id", "sep_id", "mask_id"}; empty
        when it records none (ALBERT's layout then)."""
        recorded = self._tokenizer_entry.get("special_ids")
        if not isinstance(recorded, dict):
            return {}
        ids = {f"{name}_id": recorded.get(name) for name in ("pad", "unk", "cls", "sep", "mask")}
        ok = all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids.values())
        return ids if ok else {}

    @property
    def vocab_size(self) -> int | None:
        size = self.data.get("vocab_size", self._tokenizer_entry.get("vocab_size"))
        return size if isinstance(size, int) and not isinstance(size, bool) else None

    def _config_value(self, name: str, kind: type) -> Any:
        """An option the shards were preprocessed with (the manifest's "config"), or None when absent or of another
        type."""
        config = self.data.get("config")
        value = config.get(name) if isinstance(config, dict) else None
        return value if isinstance(value, kind) and not isinstance(value, bool) else None

    @property
    def max_seq_length(self) -> int | None:
        """The --max-seq-length the shards were preprocessed with, or None."""
        return self._config_value("max_seq_length", int)

    @property
    def heldout_fraction(self) -> float | None:
        """The --heldout-fraction the shards were preprocessed with, or None."""
        value = self._config_value("heldout_fraction", float)
        return value if value is not None else self._config_value("heldout_fraction", int)

    @property
    def objective(self) -> str | None:
        """The pair objective the shards were made with (sop, nsp or none), or None."""
        return self._config_value("objective", str)

    @property
    def tokenizer_sha256(self) -> str | None:
        """The sha256 of the tokenizer model the manifest records (services/preprocess writes it), or None."""
        digest = self._tokenizer_entry.get("sha256")
        return digest if isinstance(digest, str) and digest else None

    @property
    def parts(self) -> tuple[ShardPart, ...]:
        """The shard set's parts in the order they were added (`albert preprocess` writes part 0, each
        `--append-to` one more). A manifest without "parts" (written before parts existed) is one part of all its
        "shards"; one without either has none."""
        parts = self.data.get("parts")
        if parts is None:
            shards = self.data.get("shards")
            if not isinstance(shards, list) or not shards:
                return ()
            parts = [{"name": "part-0", "shards": shards}]
        if not isinstance(parts, list):
            raise ManifestError(f"{self.directory / MANIFEST_FILE}: parts: expected a list")
        return tuple(ShardPart.from_json(entry, index=i, source=self.directory / MANIFEST_FILE)
                     for i, entry in enumerate(parts))  # fmt: skip

    @property
    def version(self) -> int:
        """The shard set's version: how many parts it holds (a run records the version each epoch trained on)."""
        return len(self.parts)


@dataclass(frozen=True)
class ShardPart:
    """One part of a shard set: the shards one `albert preprocess` (or `--append-to`) run added, in order."""

    index: int
    name: str
    shards: tuple[str, ...]  # relative to the shard set directory, e.g. train/shard-00003.parquet
    rows: tuple[int, ...]
    sha256: tuple[str, ...]  # of each shard file ("" where the manifest records none)

    @classmethod
    def from_json(cls, entry: Any, *, index: int, source: Path) -> ShardPart:
        where = f"{source}: parts[{index}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("shards"), list) or not entry["shards"]:
            raise ManifestError(f"{where}: expected an object with a non-empty list of shards")
        names, rows, digests = [], [], []
        for shard in entry["shards"]:
            if not isinstance(shard, dict) or not isinstance(shard.get("name"), str):
                raise ManifestError(f"{where}: each shard needs a name, got {shard!r}")
            if leaves_directory(shard["name"]):
                raise ManifestError(f"{where}: shard name {shard['name']!r} leaves the shard set directory")
            n = shard.get("rows")
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise ManifestError(f"{where}: shard {shard['name']}: rows must be an int >= 0, got {n!r}")
            names.append(shard["name"])
            rows.append(n)
            digests.append(str(shard.get("sha256") or ""))
        name = entry.get("name", f"part-{index}")
        return cls(index, str(name), tuple(names), tuple(rows), tuple(digests))


def example_id(shard: int, row: int) -> int:
    return (shard << 32) | row


def document_hash(text: str) -> int:
    """A document's 64-bit identity: the first 8 bytes of the sha256 of its text. The same text gets the same
    hash in any file, order or cut of the corpus (preprocess holds a document out when it is below fraction x
    2**64, and seeds its pair draws with it); its id in the held-out file is this hash >> 1."""
    return int.from_bytes(hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()[:8], "big")


# Held-out documents (not pairs), so evaluation can build SOP and NSP pairs from the same text (Table 5).
HELDOUT_SCHEMA = pa.schema(
    [
        pa.field("doc_id", pa.int64(), nullable=False),
        pa.field("sentences", pa.list_(pa.list_(pa.int32())), nullable=False),
        pa.field("word_starts", pa.list_(pa.list_(pa.bool_())), nullable=False),
    ]
)
HELDOUT_FILE = "heldout/documents.parquet"
