"""How far the pair tasks can be solved from surface statistics alone: count-based predictors for SOP and NSP,
scored on held-out pairs built as the evaluator builds them (albert_core.evaluation.analysis.document_pairs).

- SOP (is the pair swapped?), junction bigram: the pair reads `X [SEP] Y`; in the documents' order the last piece of
  the first segment runs on into the first piece of the second. Predict "in order" when
  log P(Y[0] | X[-1]) > log P(X[0] | Y[-1]) under add-one bigram counts of the training shards' segments. What a
  model learns of local order at the junction, and no more.
- NSP (is Y from another document?), word overlap: the Jaccard overlap of the two segments' piece sets, with the
  threshold fitted on the pairs of half of the held-out documents and scored on the other half (the linear probes'
  split). Topic alone, no order.

Each prints its accuracy and the number of pairs; `--out` writes them as JSON. With `--checkpoint` (repeatable),
also how much each model's final [CLS] state varies across the held-out pairs, against a content token's (position
5): the norm of the per-dimension standard deviation over the norm of the mean. A pair head reads [CLS] (through the
pooler), so a [CLS] that hardly varies gives it little to work with.

    python bench/pair_baseline.py --shards .cache/albert/experiments/sop-128-XXXX [--examples 512] [--out f.json] \
        [--checkpoint runs/.../checkpoints/step_00001500 ...]
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from albert_core.evaluation.analysis import document_pairs  # noqa: E402
from albert_core.evaluation.intrinsic import read_heldout  # noqa: E402
from albert_core.examples.shards import HELDOUT_FILE, TRAIN_DIR  # noqa: E402
from services.rundir.config import RunConfig  # noqa: E402
from services.train.plan import resolve_token_ids  # noqa: E402


def segments(input_ids: list[int], cls_id: int, sep_id: int) -> tuple[list[int], list[int]]:
    """(X, Y) of `[CLS] X [SEP] Y [SEP]`."""
    body = list(input_ids[1:]) if input_ids and input_ids[0] == cls_id else list(input_ids)
    cut = body.index(sep_id)
    second = body[cut + 1 :]
    return body[:cut], second[: second.index(sep_id)] if sep_id in second else second


def bigram_counts(shards: Path, cls_id: int, sep_id: int) -> tuple[collections.Counter, collections.Counter, int]:
    """Bigram and left-piece counts within the training rows' segments, and the vocabulary seen."""
    pairs: collections.Counter = collections.Counter()
    left: collections.Counter = collections.Counter()
    vocab: set[int] = set()
    for path in sorted((shards / TRAIN_DIR).glob("*.parquet")):
        for row in pq.read_table(path, columns=["input_ids"]).column("input_ids").to_pylist():
            for segment in segments(row, cls_id, sep_id):
                vocab.update(segment)
                pairs.update(zip(segment[:-1], segment[1:], strict=True))
                left.update(segment[:-1])
    return pairs, left, len(vocab)


def sop_accuracy(examples, counts, cls_id: int, sep_id: int) -> float:
    pairs, left, vocab = counts

    def logp(a: int, b: int) -> float:
        return math.log((pairs[(a, b)] + 1) / (left[a] + vocab))

    correct = 0
    for e in examples:
        x, y = segments(e.input_ids, cls_id, sep_id)
        swapped = logp(x[-1], y[0]) < logp(y[-1], x[0])
        correct += int(swapped) == e.pair_label
    return correct / len(examples)


def nsp_accuracy(examples, cls_id: int, sep_id: int) -> tuple[float, int]:
    """Threshold on the Jaccard overlap fitted on the examples of even documents, scored on the odd ones."""
    overlap = []
    for e in examples:
        x, y = map(set, segments(e.input_ids, cls_id, sep_id))
        overlap.append(len(x & y) / max(len(x | y), 1))
    overlap, labels = np.array(overlap), np.array([e.pair_label for e in examples])
    fit = np.array([e.doc_index % 2 == 0 for e in examples])
    candidates = np.unique(overlap[fit])
    accuracy = [np.mean((overlap[fit] < t) == labels[fit]) for t in candidates]  # low overlap: B is random
    threshold = candidates[int(np.argmax(accuracy))]
    test = ~fit
    return float(np.mean((overlap[test] < threshold) == labels[test])), int(test.sum())


def state_spread(checkpoint: str, examples, pad_id: int) -> dict[str, float]:
    """{"cls": spread of the final [CLS] state, "token5": of position 5's}: |std over pairs| / |mean|."""
    import torch

    from albert_core.evaluation.analysis import pad_batches
    from albert_core.model.checkpoint import load_model
    from albert_core.model.modeling import AlbertModel

    model = load_model(checkpoint, AlbertModel).eval()
    states = []
    with torch.no_grad():
        for batch in pad_batches([e.input_ids for e in examples], pad_id=pad_id, batch_size=64,
                                 token_type_ids=[e.token_type_ids for e in examples]):  # fmt: skip
            hidden = model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]).last_hidden_state
            states.append(hidden[:, [0, 5]])
    both = torch.cat(states)
    spread = (both.std(0).norm(dim=-1) / both.mean(0).norm(dim=-1)).tolist()
    return {"checkpoint": checkpoint, "cls": spread[0], "token5": spread[1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", required=True, help="a shard set (its training rows give the bigram counts)")
    parser.add_argument("--examples", type=int, default=512)
    parser.add_argument("--max-seq-length", type=int, default=128)
    parser.add_argument("--seed", type=int, default=12345)
    parser.add_argument("--checkpoint", action="append", default=[], help="also measure this model's [CLS] spread")
    parser.add_argument("--out")
    args = parser.parse_args()
    shards = Path(args.shards)
    ids = resolve_token_ids(shards, RunConfig())
    documents = [d.sentences for d in read_heldout(str(shards / HELDOUT_FILE))]

    def pairs(objective: str, max_examples: int | None):
        return document_pairs(documents, objective=objective, max_seq_length=args.max_seq_length, seed=args.seed,
                              cls_id=ids.cls_id, sep_id=ids.sep_id, max_examples=max_examples)  # fmt: skip

    sop = pairs("sop", args.examples)
    counts = bigram_counts(shards, ids.cls_id, ids.sep_id)
    nsp_acc, nsp_n = nsp_accuracy(pairs("nsp", 2 * args.examples), ids.cls_id, ids.sep_id)
    result = {
        "shards": str(shards),
        "sop_junction_bigram": sop_accuracy(sop, counts, ids.cls_id, ids.sep_id),
        "sop_examples": len(sop),
        "nsp_word_overlap": nsp_acc,
        "nsp_examples": nsp_n,
        "heldout_documents": len(documents),
        "state_spread": [state_spread(c, pairs("nsp", 256), ids.pad_id) for c in args.checkpoint],
    }
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
