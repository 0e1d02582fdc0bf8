"""Intrinsic evaluation: held-out file reading and MLM / SOP / NSP metrics on real (tiny) ALBERT models."""

import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from albert_core.evaluation.intrinsic import HeldoutDocument, TokenIds, intrinsic_metrics, read_heldout
from albert_core.evaluation.unigram import UnigramBaseline
from albert_core.examples.shards import HELDOUT_SCHEMA
from albert_core.model.checkpoint import save_model
from albert_core.model.config import AlbertConfig
from albert_core.model.modeling import AlbertForPreTraining
from services.eval.evaluate import (
    DOWNSTREAM_TASKS,
    IntrinsicOptions,
    UnknownTask,
    evaluate_checkpoint,
)
from services.rundir.config import RunConfig

VOCAB = 64
TOKENS = TokenIds(vocab_size=VOCAB)  # pad 0, unk 1, cls 2, sep 3, mask 4


def tiny_model(seed: int = 0, layers: int = 2) -> AlbertForPreTraining:
    torch.manual_seed(seed)
    config = AlbertConfig(
        vocab_size=VOCAB,
        embedding_size=16,
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        classifier_dropout_prob=0.0,
    )
    return AlbertForPreTraining(config)


def random_documents(n_docs: int, seed: int = 0) -> list[HeldoutDocument]:
    rng = np.random.default_rng(seed)
    documents = []
    for doc_id in range(n_docs):
        sentences = [rng.integers(5, VOCAB, size=rng.integers(3, 10)).tolist() for _ in range(rng.integers(2, 6))]
        starts = [(rng.random(len(s)) < 0.7).tolist() for s in sentences]
        documents.append(HeldoutDocument(doc_id, sentences, starts))
    return documents


def ordered_documents(n_docs: int, seed: int = 0) -> list[HeldoutDocument]:
    """Two sentences each: a run of token 10 then a run of token 11, so the order is visible in the tokens."""
    rng = np.random.default_rng(seed)
    documents = []
    for doc_id in range(n_docs):
        a, b = (int(n) for n in rng.integers(2, 8, size=2))
        documents.append(HeldoutDocument(doc_id, [[10] * a, [11] * b], [[True] * a, [True] * b]))
    return documents


def one_token_documents(token: int) -> list[HeldoutDocument]:
    lengths = (6, 5, 7)
    return [HeldoutDocument(i, [[token] * n for n in lengths], [[True] * n for n in lengths]) for i in range(40)]


def write_heldout(path, documents) -> None:
    table = pa.Table.from_pylist(
        [{"doc_id": d.doc_id, "sentences": d.sentences, "word_starts": d.word_starts} for d in documents],
        schema=HELDOUT_SCHEMA,
    )
    pq.write_table(table, path)


def evaluate(model, documents, **overrides):
    options = dict(token_ids=TOKENS, max_seq_length=32, seed=7, batch_size=64, max_examples=400)
    return intrinsic_metrics(model, documents, **{**options, **overrides})


# --- reading held-out documents --------------------------------------------------------------------------------


def test_read_heldout_returns_the_documents_written_with_the_heldout_schema(tmp_path):
    documents = random_documents(5)
    write_heldout(tmp_path / "documents.parquet", documents)
    assert read_heldout(str(tmp_path / "documents.parquet")) == documents


def test_read_heldout_names_the_document_whose_word_starts_do_not_match_its_tokens(tmp_path):
    documents = random_documents(3)
    broken = HeldoutDocument(41, [[5, 6, 7]], [[True, False]])
    write_heldout(tmp_path / "documents.parquet", [*documents, broken])
    with pytest.raises(ValueError, match=r"row 3 \(doc_id 41\): sentence 0 has 3 tokens but 2 word_starts"):
        read_heldout(str(tmp_path / "documents.parquet"))


def test_read_heldout_rejects_a_file_without_the_sentences_column(tmp_path):
    not_heldout = pa.table({"doc_id": [1], "text": ["a pretraining shard, not held-out documents"]})
    pq.write_table(not_heldout, tmp_path / "x.pq")
    with pytest.raises(ValueError, match="lacks column 'sentences'"):
        read_heldout(str(tmp_path / "x.pq"))


def test_read_heldout_names_a_file_that_is_not_parquet(tmp_path):
    (tmp_path / "documents.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match="documents.parquet: cannot read held-out documents as Parquet"):
        read_heldout(str(tmp_path / "documents.parquet"))


# --- metrics ---------------------------------------------------------------------------------------------------


def test_a_random_model_scores_chance_on_sop_and_nsp():
    metrics = evaluate(tiny_model(), random_documents(300))
    assert metrics["sop_examples"] >= 300 and metrics["nsp_examples"] >= 300
    # Labels are balanced (p=0.5): 0.1 is > 3 standard deviations at 300 examples.
    assert abs(metrics["sop_acc"] - 0.5) < 0.1
    assert abs(metrics["nsp_acc"] - 0.5) < 0.1


def test_a_random_model_has_mlm_loss_near_log_vocab_and_little_accuracy():
    metrics = evaluate(tiny_model(), random_documents(300))
    assert metrics["mlm_tokens"] > 300
    # Initial weights (std 0.02) give near-uniform predictions over the vocabulary.
    assert abs(metrics["mlm_loss"] - math.log(VOCAB)) < 0.1
    assert metrics["mlm_acc"] < 0.1


def test_a_model_that_always_predicts_the_only_token_has_perfect_mlm_accuracy():
    documents = one_token_documents(9)
    model = tiny_model()
    with torch.no_grad():
        model.mlm_head.bias[9] = 50.0
    metrics = evaluate(model, documents)
    assert metrics["mlm_tokens"] > 0
    assert metrics["mlm_acc"] == 1.0
    assert metrics["mlm_loss"] < 1e-3


def test_a_model_that_always_predicts_another_token_has_zero_mlm_accuracy():
    documents = one_token_documents(9)
    model = tiny_model()
    with torch.no_grad():
        model.mlm_head.bias[8] = 50.0
    metrics = evaluate(model, documents)
    assert metrics["mlm_acc"] == 0.0
    assert metrics["mlm_loss"] > 40


@pytest.mark.parametrize("objective", ["sop", "nsp"])
def test_always_answering_0_and_always_answering_1_have_accuracies_that_sum_to_one(objective):
    documents = random_documents(200)
    accuracies = []
    for label in (0, 1):
        model = tiny_model()
        with torch.no_grad():
            model.pair_head.weight.zero_()
            model.pair_head.bias.copy_(torch.tensor([10.0, 0.0] if label == 0 else [0.0, 10.0]))
        accuracies.append(evaluate(model, documents)[f"{objective}_acc"])
    assert accuracies[0] + accuracies[1] == pytest.approx(1.0)
    assert 0.35 < accuracies[0] < 0.65  # both labels occur: the score reads the labels, not a constant


def test_sop_accuracy_is_near_perfect_after_training_on_text_whose_order_is_visible():
    model = tiny_model(layers=1)
    documents = ordered_documents(300)
    before = evaluate(model, documents, short_seq_prob=0.0)
    rng = np.random.default_rng(1)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(150):  # [CLS] A [SEP] B [SEP], A = 10s and B = 11s, swapped (label 1) half the time
        ids, types, mask = (torch.zeros(32, 20, dtype=torch.long) for _ in range(3))
        labels = torch.tensor(rng.random(32) < 0.5, dtype=torch.long)
        for row in range(32):
            n_a, n_b = (int(n) for n in rng.integers(2, 8, size=2))
            a, b = [10] * n_a, [11] * n_b
            first, second = (b, a) if labels[row] else (a, b)
            tokens = [2, *first, 3, *second, 3]
            ids[row, : len(tokens)] = torch.tensor(tokens)
            mask[row, : len(tokens)] = 1
            types[row, len(first) + 2 : len(tokens)] = 1
        ids[((ids == 10) | (ids == 11)) & (torch.rand(ids.shape) < 0.15)] = TOKENS.mask_id
        loss = model(ids, mask, types, pair_labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    after = evaluate(model, documents, short_seq_prob=0.0)
    assert abs(before["sop_acc"] - 0.5) < 0.1
    assert after["sop_acc"] > 0.95


def test_masks_cover_whole_words_as_flagged_in_the_heldout_file():
    # Words of three pieces: 20 starts a word, 21 continues it. Short documents: no truncation splits a word.
    word, flags = [20, 21, 21], [True, False, False]
    documents = [HeldoutDocument(i, [word * 3, word * 4], [flags * 3, flags * 4]) for i in range(60)]
    metrics = evaluate(tiny_model(), documents, max_seq_length=64, short_seq_prob=0.0)
    assert metrics["mlm_tokens"] > 0
    assert metrics["mlm_tokens"] % 3 == 0


def test_the_same_seed_sees_the_same_examples_and_another_seed_other_ones():
    model, documents = tiny_model(), random_documents(120)
    first, again, other = evaluate(model, documents), evaluate(model, documents), evaluate(model, documents, seed=8)
    assert first == again
    assert (other["mlm_tokens"], other["mlm_loss"]) != (first["mlm_tokens"], first["mlm_loss"])


def test_max_examples_caps_the_examples_scored():
    metrics = evaluate(tiny_model(), random_documents(120), max_examples=50)
    assert metrics["sop_examples"] == 50
    assert metrics["nsp_examples"] == 50


def test_batch_size_does_not_change_the_metrics():
    model, documents = tiny_model(), random_documents(80)
    by_64 = evaluate(model, documents, batch_size=64)
    by_7 = evaluate(model, documents, batch_size=7)
    assert by_7.keys() == by_64.keys()
    for name, value in by_64.items():
        assert by_7[name] == pytest.approx(value, rel=1e-5), name


def test_evaluation_leaves_a_training_model_in_training_mode():
    model = tiny_model()
    model.train()
    evaluate(model, random_documents(10))
    assert model.training


def test_a_token_id_outside_the_vocabulary_is_named_with_its_document():
    documents = [*random_documents(3), HeldoutDocument(77, [[5, 6], [VOCAB + 3]], [[True, True], [True]])]
    with pytest.raises(ValueError, match=rf"doc_id 77: token id {VOCAB + 3} outside the vocabulary"):
        evaluate(tiny_model(), documents)


def test_documents_too_short_for_any_pair_are_refused_with_the_skip_counts():
    documents = [HeldoutDocument(i, [[5]], [[True]]) for i in range(4)]
    with pytest.raises(ValueError, match="no sop pairs.*single_token': 4"):
        evaluate(tiny_model(), documents)


def test_a_max_seq_length_beyond_the_model_positions_is_refused():
    with pytest.raises(ValueError, match="max_seq_length 128 exceeds the model's max_position_embeddings"):
        evaluate(tiny_model(), random_documents(3), max_seq_length=128)


# --- services.eval.evaluate: the plain function `albert evaluate` uses, and the downstream registry ------------


def saved_checkpoint(directory, step: int):
    model = tiny_model()
    save_model(directory, model)
    (directory / "trainer.json").write_text(json.dumps({"step": step}))
    return model


def test_evaluate_checkpoint_returns_the_step_from_trainer_json_and_the_loaded_models_metrics(tmp_path):
    model = saved_checkpoint(tmp_path / "ckpt", 300)
    documents = random_documents(60)
    write_heldout(tmp_path / "documents.parquet", documents)
    options = IntrinsicOptions(max_seq_length=32, seed=7, batch_size=16, max_examples=100)
    result = evaluate_checkpoint(tmp_path / "ckpt", tmp_path / "documents.parquet", options=options)
    expected = evaluate(model, documents, batch_size=16, max_examples=100)
    assert result["step"] == 300
    assert result["checkpoint"] == str(tmp_path / "ckpt")
    assert {name: result[name] for name in expected} == pytest.approx(expected)


def test_a_registered_downstream_task_is_run_on_the_checkpoint_with_its_data_directory(tmp_path, monkeypatch):
    saved_checkpoint(tmp_path / "ckpt", 10)
    write_heldout(tmp_path / "documents.parquet", random_documents(20))
    (tmp_path / "task").mkdir()
    (tmp_path / "task" / "dev.tsv").write_text("a\t1\nb\t0\nc\t1\n")
    calls = []

    def count_lines(checkpoint_dir: str, data_dir: str) -> dict:
        calls.append(checkpoint_dir)
        return {"examples": len((Path(data_dir) / "dev.tsv").read_text().splitlines())}

    monkeypatch.setitem(DOWNSTREAM_TASKS, "count-lines", count_lines)
    result = evaluate_checkpoint(
        tmp_path / "ckpt",
        tmp_path / "documents.parquet",
        options=IntrinsicOptions(max_seq_length=32, max_examples=20),
        tasks=["count-lines"],
        task_data={"count-lines": str(tmp_path / "task")},
    )
    assert calls == [str(tmp_path / "ckpt")]
    assert result["tasks"] == {"count-lines": {"examples": 3}}


def test_a_downstream_task_nothing_registered_is_refused_by_name(tmp_path):
    saved_checkpoint(tmp_path / "ckpt", 10)
    with pytest.raises(UnknownTask, match="no evaluator is registered for downstream task 'boolq'"):
        evaluate_checkpoint(tmp_path / "ckpt", tmp_path / "missing.parquet", tasks=["boolq"], task_data={"boolq": "x"})


def test_intrinsic_options_follow_the_run_config():
    config = RunConfig.from_dict({"run": {"seed": 99}, "data": {"max_seq_length": 128}, "eval": {"batch_size": 8}})
    options = IntrinsicOptions.from_run_config(config)
    assert (options.seed, options.max_seq_length, options.batch_size) == (99, 128, 8)
    assert options.max_examples == config.eval.heldout_batches * 8


def test_a_checkpoint_is_scored_against_the_unigram_baseline_of_the_shard_set_version_it_trained_on(tmp_path):
    """An append commits a new version's counts (and names them in manifest.json); a run that trained on version 1
    keeps version 1's baseline, so its unigram_acc and mlm_margin do not shift mid-run (issue 31, item 4)."""
    from albert_core.evaluation.unigram import version_unigram_file

    shards = tmp_path / "shards"
    (shards / "heldout").mkdir(parents=True)
    documents = random_documents(60)
    write_heldout(shards / "heldout" / "documents.parquet", documents)
    for version, piece in ((1, 5), (2, 6)):  # each version's most frequent piece differs
        counts = np.ones(VOCAB, dtype=np.int64)
        counts[piece] = 1000
        (shards / version_unigram_file(version)).parent.mkdir(exist_ok=True)
        UnigramBaseline(counts).save_as(shards / version_unigram_file(version))
    (shards / "manifest.json").write_text(json.dumps({"unigram": {"file": version_unigram_file(2)}}))
    model = saved_checkpoint(tmp_path / "ckpt", 300)
    (tmp_path / "ckpt" / "trainer.json").write_text(json.dumps({"step": 300, "epoch_versions": [1, 1]}))
    options = IntrinsicOptions(max_seq_length=32, seed=7, batch_size=16, max_examples=100)
    result = evaluate_checkpoint(tmp_path / "ckpt", shards / "heldout" / "documents.parquet", options=options)
    version_1 = UnigramBaseline.load_file(shards / version_unigram_file(1))
    expected = evaluate(model, documents, batch_size=16, max_examples=100, unigram=version_1)
    assert result["unigram_acc"] == pytest.approx(expected["unigram_acc"])
    newest = evaluate(
        model,
        documents,
        batch_size=16,
        max_examples=100,
        unigram=UnigramBaseline.load_file(shards / version_unigram_file(2)),
    )
    assert result["unigram_acc"] != pytest.approx(newest["unigram_acc"])
