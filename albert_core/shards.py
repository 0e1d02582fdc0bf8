"""The pretraining shard format: plain Arrow columns that pyarrow reads alone (no Ray tensor extension types).

One row is one `[CLS] A [SEP] B [SEP]` example. The preprocess service writes shards of these rows plus a
manifest; the training stream reads them and masks dynamically (`albert_core.batch`).
"""

from __future__ import annotations

import pyarrow as pa

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

MANIFEST_FILE = "manifest.json"
TRAIN_DIR = "train"


def example_id(shard: int, row: int) -> int:
    return (shard << 32) | row


# Held-out documents (not pairs), so evaluation can build SOP and NSP pairs from the same text (Table 5).
HELDOUT_SCHEMA = pa.schema(
    [
        pa.field("doc_id", pa.int64(), nullable=False),
        pa.field("sentences", pa.list_(pa.list_(pa.int32())), nullable=False),
        pa.field("word_starts", pa.list_(pa.list_(pa.bool_())), nullable=False),
    ]
)
HELDOUT_FILE = "heldout/documents.parquet"
