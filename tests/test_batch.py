"""MLM/SOP batches: padding, dtypes, and masks that depend only on (seed, epoch, example id)."""

from __future__ import annotations

import numpy as np
import pytest

from albert_core.examples.batch import mlm_batch, padded_length
from albert_core.examples.masking import IGNORE_INDEX
from albert_core.examples.pairs import PairConfig, create_pairs

PAD, CLS, SEP, MASK = 0, 2, 3, 4
VOCAB = 1000
KEYS = {"input_ids", "attention_mask", "token_type_ids", "mlm_labels", "pair_labels"}


def make_rows(n: int, seed: int = 0, lengths: tuple[int, int] = (20, 120)) -> list[dict]:
    """Pair rows as preprocessing stores them: ids, token types, pair label, word starts, example id."""
    rng = np.random.default_rng(seed)
    rows = []
    for example_id in range(n):
        length = int(rng.integers(*lengths))
        len_a = int(rng.integers(1, length - 3))
        ids = rng.integers(5, VOCAB, size=length)
        ids[[0, len_a + 1, length - 1]] = (CLS, SEP, SEP)
        word_starts = rng.random(length) < 0.75
        word_starts[[0, len_a + 1, length - 1]] = True
        types = np.r_[np.zeros(len_a + 2, dtype=int), np.ones(length - len_a - 2, dtype=int)]
        rows.append(
            {
                "input_ids": ids.tolist(),
                "token_type_ids": types.tolist(),
                "pair_label": int(rng.integers(2)),
                "word_starts": word_starts.tolist(),
                "example_id": 1000 + example_id,
            }
        )
    return rows


def batch_of(rows: list[dict], *, seed: int = 0, epoch: int = 0, seq_len: int | None = None) -> dict[str, np.ndarray]:
    return mlm_batch(
        [r["input_ids"] for r in rows],
        [r["token_type_ids"] for r in rows],
        [r["pair_label"] for r in rows],
        [r["word_starts"] for r in rows],
        [r["example_id"] for r in rows],
        seed=seed,
        epoch=epoch,
        seq_len=seq_len,
        vocab_size=VOCAB,
        special_ids=(PAD, CLS, SEP),
        mask_id=MASK,
    )


def row_of(batch: dict[str, np.ndarray], r: int, length: int) -> dict[str, np.ndarray]:
    return {key: batch[key][r, :length] for key in ("input_ids", "attention_mask", "token_type_ids", "mlm_labels")}


def test_batch_has_int64_arrays_of_batch_by_length():
    rows = make_rows(5)
    batch = batch_of(rows)
    assert set(batch) == KEYS
    width = batch["input_ids"].shape[1]
    for key in KEYS - {"pair_labels"}:
        assert batch[key].shape == (5, width) and batch[key].dtype == np.int64
    assert batch["pair_labels"].shape == (5,) and batch["pair_labels"].dtype == np.int64
    assert batch["pair_labels"].tolist() == [r["pair_label"] for r in rows]


def test_dynamic_length_is_the_longest_row_rounded_up_to_8():
    rows = make_rows(6)
    longest = max(len(r["input_ids"]) for r in rows)
    width = batch_of(rows)["input_ids"].shape[1]
    assert width % 8 == 0 and longest <= width < longest + 8
    assert padded_length(13) == 16 and padded_length(16) == 16 and padded_length(1) == 8


def test_explicit_seq_len_pads_every_batch_to_it():
    assert batch_of(make_rows(3, lengths=(20, 40)), seq_len=128)["input_ids"].shape == (3, 128)


def test_row_longer_than_seq_len_is_rejected_naming_the_example():
    rows = make_rows(3, lengths=(60, 61))
    with pytest.raises(ValueError, match=r"row 0 \(example 1000\) has 60 tokens, more than seq_len=32"):
        batch_of(rows, seq_len=32)


def test_padding_is_unattended_untyped_and_unlabelled():
    rows = make_rows(4)
    batch = batch_of(rows, seq_len=128)
    for r, row in enumerate(rows):
        n = len(row["input_ids"])
        assert (batch["attention_mask"][r, :n] == 1).all() and (batch["attention_mask"][r, n:] == 0).all()
        assert (batch["input_ids"][r, n:] == PAD).all()
        assert (batch["token_type_ids"][r, n:] == 0).all()
        assert (batch["mlm_labels"][r, n:] == IGNORE_INDEX).all()
        assert batch["token_type_ids"][r, :n].tolist() == row["token_type_ids"]


def test_rows_are_masked_about_15_percent_with_labels_holding_the_originals():
    rows = make_rows(64)
    batch = batch_of(rows)
    predicted, real = 0, 0
    for r, row in enumerate(rows):
        ids = np.asarray(row["input_ids"])
        labels = batch["mlm_labels"][r, : ids.size]
        chosen = labels != IGNORE_INDEX
        np.testing.assert_array_equal(labels[chosen], ids[chosen])
        predicted += chosen.sum()
        real += (~np.isin(ids, (CLS, SEP))).sum()
    assert 0.13 < predicted / real <= 0.15


def test_a_rows_mask_does_not_depend_on_batch_composition():
    rows = make_rows(6)
    together = batch_of(rows)
    alone = batch_of([rows[4]])
    reordered = batch_of([rows[5], rows[4], rows[0]])
    n = len(rows[4]["input_ids"])
    for key, value in row_of(together, 4, n).items():
        np.testing.assert_array_equal(value, row_of(alone, 0, n)[key])
        np.testing.assert_array_equal(value, row_of(reordered, 1, n)[key])


def test_same_seed_and_epoch_rebuild_the_same_batch():
    rows = make_rows(8)
    first, again = batch_of(rows, seed=3, epoch=2), batch_of(rows, seed=3, epoch=2)
    for key in KEYS:
        np.testing.assert_array_equal(first[key], again[key])


@pytest.mark.parametrize("change", [{"epoch": 1}, {"seed": 1}])
def test_a_new_epoch_or_seed_draws_new_masks(change):
    rows = make_rows(8)
    base = batch_of(rows, seed=0, epoch=0)["mlm_labels"]
    changed = batch_of(rows, **({"seed": 0, "epoch": 0} | change))["mlm_labels"]
    assert not np.array_equal(base, changed)


def test_the_example_id_not_the_row_position_selects_the_mask():
    rows = make_rows(2, lengths=(100, 101))
    same_tokens = [dict(rows[0]), dict(rows[0], example_id=rows[0]["example_id"] + 1)]
    batch = batch_of(same_tokens)
    assert not np.array_equal(batch["mlm_labels"][0], batch["mlm_labels"][1])


def test_columns_of_different_lengths_are_rejected():
    rows = make_rows(3)
    with pytest.raises(ValueError, match="pair_labels has 2 rows but input_ids has 3"):
        mlm_batch(
            [r["input_ids"] for r in rows],
            [r["token_type_ids"] for r in rows],
            [0, 1],
            [r["word_starts"] for r in rows],
            [0, 1, 2],
            seed=0,
            epoch=0,
            seq_len=None,
            vocab_size=VOCAB,
            special_ids=(PAD, CLS, SEP),
            mask_id=MASK,
        )


def test_row_with_mismatched_token_types_is_rejected_naming_the_example():
    rows = make_rows(2)
    rows[1]["token_type_ids"] = rows[1]["token_type_ids"][:-1]
    with pytest.raises(ValueError, match=r"row 1 \(example 1001\) has .* token_type_ids for"):
        batch_of(rows)


def test_pairs_from_create_pairs_batch_directly():
    rng = np.random.default_rng(0)
    documents = [[rng.integers(5, VOCAB, size=rng.integers(5, 30)).tolist() for _ in range(20)] for _ in range(4)]
    examples = create_pairs(documents, config=PairConfig(max_seq_length=64), rng=rng, cls_id=CLS, sep_id=SEP).examples
    rows = [
        {
            "input_ids": e.input_ids,
            "token_type_ids": e.token_type_ids,
            "pair_label": e.pair_label,
            "word_starts": [True] * len(e.input_ids),
            "example_id": i,
        }
        for i, e in enumerate(examples)
    ]
    batch = batch_of(rows, seq_len=64)
    assert batch["input_ids"].shape == (len(examples), 64)
    assert (batch["mlm_labels"] != IGNORE_INDEX).any(axis=1).all()
    np.testing.assert_array_equal(batch["attention_mask"].sum(axis=1), [len(e.input_ids) for e in examples])
