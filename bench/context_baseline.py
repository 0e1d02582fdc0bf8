"""How far a model gets from a masked piece's visible neighbours alone: a count-based predictor scored by the
production evaluator on exactly the held-out positions a run is scored on.

Each masked piece is predicted as the most frequent training piece between its left and right neighbours when
both are visible and that pair was seen (a "trigram" with a hole), else the most frequent piece after its left
neighbour, else before its right neighbour, else the most frequent piece (the unigram floor). Counts come from the
training shards' unmasked rows. A model at this score uses its neighbours and little else; one below it has not
learned to find them (docs/learning.md, round 13).

    python bench/context_baseline.py [--shards .cache/albert/sample-shards-8000-128] [--examples 512] [--max-ngram 3]
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from albert_core.evaluation.intrinsic import intrinsic_metrics, read_heldout  # noqa: E402
from albert_core.examples.masking import IGNORE_INDEX  # noqa: E402
from albert_core.examples.shards import TRAIN_DIR  # noqa: E402
from albert_core.model.modeling import PreTrainingOutput  # noqa: E402
from services.rundir.config import RunConfig  # noqa: E402
from services.train.plan import resolve_token_ids  # noqa: E402

Counts = dict[object, collections.Counter]


def neighbour_counts(shards: Path, special: set[int]) -> tuple[Counts, Counts, Counts, int]:
    """(left, right) -> piece, left -> piece, right -> piece counts, and the most frequent piece."""
    both, after, before = (collections.defaultdict(collections.Counter) for _ in range(3))
    unigram: collections.Counter = collections.Counter()
    for path in sorted((shards / TRAIN_DIR).glob("*.parquet")):
        for row in pq.read_table(path, columns=["input_ids"]).column("input_ids").to_pylist():
            for i in range(1, len(row) - 1):
                piece = row[i]
                if piece in special:
                    continue
                unigram[piece] += 1
                after[row[i - 1]][piece] += 1
                before[row[i + 1]][piece] += 1
                both[(row[i - 1], row[i + 1])][piece] += 1
    return both, after, before, unigram.most_common(1)[0][0]


class NeighbourPredictor(torch.nn.Module):
    """Answers the evaluator as a model would: one-hot MLM logits at the masked positions, no pair opinion."""

    def __init__(self, counts, vocab_size: int, mask_id: int, pad_id: int):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # the evaluator reads the device from a parameter
        self.both, self.after, self.before, self.most_frequent = counts
        self.vocab_size, self.mask_id, self.pad_id = vocab_size, mask_id, pad_id

    def predict(self, left: int, right: int) -> int:
        seen_left, seen_right = left != self.mask_id, right not in (self.mask_id, self.pad_id)
        if seen_left and seen_right and (left, right) in self.both:
            return self.both[(left, right)].most_common(1)[0][0]
        if seen_left and left in self.after:
            return self.after[left].most_common(1)[0][0]
        if seen_right and right in self.before:
            return self.before[right].most_common(1)[0][0]
        return self.most_frequent

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, mlm_labels=None) -> PreTrainingOutput:
        ids = input_ids.numpy()
        padded = np.pad(ids, ((0, 0), (0, 1)), constant_values=self.pad_id)
        rows, cols = np.nonzero(mlm_labels.numpy() != IGNORE_INDEX)
        guesses = [self.predict(int(padded[r, c - 1]), int(padded[r, c + 1])) for r, c in zip(rows, cols, strict=True)]
        logits = torch.full((len(guesses), self.vocab_size), -1e4)
        logits[torch.arange(len(guesses)), torch.tensor(guesses, dtype=torch.long)] = 0.0
        return PreTrainingOutput(None, None, None, logits, torch.zeros(ids.shape[0], 2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", default=str(ROOT / ".cache/albert/sample-shards-8000-128"))
    parser.add_argument("--recipe", default="tiny", help="the run config whose evaluation options are used")
    parser.add_argument("--examples", type=int, default=512, help="held-out examples (the recipe search's 512)")
    parser.add_argument("--max-ngram", type=int, default=3, help="n-gram masking of the held-out positions")
    args = parser.parse_args()
    shards = Path(args.shards).resolve()
    config = RunConfig.load(args.recipe, overrides={"data.shards": str(shards)})
    ids = resolve_token_ids(shards, config)
    predictor = NeighbourPredictor(neighbour_counts(shards, set(ids.special_ids)), ids.vocab_size, ids.mask_id,
                                   ids.pad_id)  # fmt: skip
    metrics = intrinsic_metrics(
        predictor,
        read_heldout(str(shards / "heldout" / "documents.parquet")),
        token_ids=ids,
        max_seq_length=config.data.max_seq_length,
        seed=config.run.seed,
        max_examples=args.examples,
        max_ngram=args.max_ngram,
    )
    print(
        f"{shards.name}, {args.examples} held-out examples, max_ngram {args.max_ngram}: neighbour counts "
        f"mlm_acc {metrics['mlm_acc']:.4f} on {metrics['mlm_tokens']} masked pieces"
    )


if __name__ == "__main__":
    main()
