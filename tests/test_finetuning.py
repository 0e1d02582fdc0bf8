"""Fine-tuning: recipes, the train loop, and each task pipeline end to end on small files in the official formats.

Models are 2-layer ALBERTs (H=64) over a SentencePiece model trained here; the SQuAD v1.1 pipeline also runs on the
real allennlp fixture. Torch runs single-threaded: the CI machine's two cores are shared.
"""

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from albert_core.finetune.config import PAPER_HYPERPARAMS, FinetuneConfig, canonical_task
from albert_core.finetune.finetuning import (
    build_model,
    eval_steps,
    finetune,
    load_task_data,
    markdown_table,
    median_of_seeds,
    score_ensemble,
)
from albert_core.finetune.tasks.glue import encode_pair, polarity_split, read_polarity, truncate_pair
from albert_core.finetune.tasks.outputs import TaskOutputs, ensemble
from albert_core.model.checkpoint import save_model, state_dict_of
from albert_core.model.config import AlbertConfig
from albert_core.model.modeling import AlbertForPreTraining
from albert_core.text.tokenization import Tokenizer, TokenizerTrainConfig, train_tokenizer

FIXTURES = Path(__file__).parent / "fixtures"
SQUAD_V1 = FIXTURES / "squad_v1_allennlp.json"

WORDS = (
    "the a movie film plot actor scene story was is very quite rather long short dull bright fun slow music "
    "score ending"
).split()
KEYWORD = "excellent"


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    """Every test here on one torch thread (tests/conftest.py)."""


def keyword_rows(n: int, seed: int) -> list[tuple[str, int]]:
    """Sentences of random filler words; label 1 exactly when KEYWORD is in the sentence."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 10))]
        if i % 2:
            words.insert(rng.randrange(len(words) + 1), KEYWORD)
        rows.append((" ".join(words), i % 2))
    return rows


SQUAD_V2 = {
    "version": "v2.0",
    "data": [
        {
            "title": "Rivers",
            "paragraphs": [
                {
                    "context": "The Nile flows north through Egypt. It is about 6650 km long and ends in the sea.",
                    "qas": [
                        {
                            "id": "q-answerable",
                            "question": "Which way does the Nile flow?",
                            "answers": [{"text": "north", "answer_start": 15}],
                            "is_impossible": False,
                        },
                        {
                            "id": "q-unanswerable",
                            "question": "Who named the Nile?",
                            "answers": [],
                            "plausible_answers": [{"text": "Egypt", "answer_start": 29}],
                            "is_impossible": True,
                        },
                    ],
                }
            ],
        }
    ],
}

RACE_RECORDS = {
    "middle": {
        "answers": ["B", "D"],
        "options": [
            ["in the morning", "after school", "at noon", "at night"],
            ["happy", "angry", "tired", "surprised"],
        ],
        "questions": ["When does Tom play football?", "Tom felt _ when he saw the new ball."],
        "article": "Tom plays football after school. One day his father gave him a new ball. He could not believe it.",
        "id": "middle1.txt",
    },
    "high": {
        "answers": ["A"],
        "options": [["a scientist", "a farmer", "a teacher", "a writer"]],
        "questions": ["What was Marie Curie?"],
        "article": "Marie Curie was a physicist and chemist who did pioneering research on radioactivity.",
        "id": "high7.txt",
    },
}


def race_texts() -> list[str]:
    texts = []
    for record in RACE_RECORDS.values():
        texts += [record["article"], *record["questions"], *(o for options in record["options"] for o in options)]
    return texts


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    paragraphs = [p for a in json.loads(SQUAD_V1.read_text())["data"] for p in a["paragraphs"]]
    squad = [p["context"] for p in paragraphs] + [q["question"] for p in paragraphs for q in p["qas"]]
    squad += [p["context"] for p in SQUAD_V2["data"][0]["paragraphs"]]
    texts = [s for s, _ in keyword_rows(300, 0)] + [f"{KEYWORD} {KEYWORD}"] * 20 + squad + race_texts()
    texts += (FIXTURES / "tokenizer_corpus.txt").read_text().splitlines()
    out = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(texts, out, TokenizerTrainConfig(vocab_size=300))
    return out


@pytest.fixture(scope="module")
def tok(tok_dir) -> Tokenizer:
    return Tokenizer.load(tok_dir)


def tiny(vocab_size: int, **overrides) -> AlbertConfig:
    return AlbertConfig.preset(
        "albert-tiny",
        **{
            "num_hidden_layers": 2,
            "hidden_size": 64,
            "embedding_size": 32,
            "num_attention_heads": 2,
            "intermediate_size": 128,
            "vocab_size": vocab_size,
            "max_position_embeddings": 256,
            **overrides,
        },
    )


SMALL = {"lr": 1e-3, "batch_size": 8, "train_steps": 4, "warmup_steps": 1, "max_seq_length": 64}


def config(task, data_dir, tok_dir, tmp_path, **kwargs) -> FinetuneConfig:
    tokenizer = Tokenizer.load(tok_dir)
    defaults = dict(
        model=tiny(tokenizer.vocab_size),
        tokenizer=str(tok_dir),
        overrides=dict(SMALL),
        eval_every=2,
        output_dir=str(tmp_path / "out"),
        eval_batch_size=16,
    )
    return FinetuneConfig(task, str(data_dir), **{**defaults, **kwargs})


def write_tsv(path: Path, header: list[str] | None, rows: list[list[str]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = (["\t".join(header)] if header else []) + ["\t".join(r) for r in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def write_sst2(root: Path, n_train: int = 200, n_dev: int = 60, test: bool = True) -> Path:
    folder = root / "SST-2"
    rows = keyword_rows(n_train + n_dev, 1)
    write_tsv(folder / "train.tsv", ["sentence", "label"], [[s, str(y)] for s, y in rows[:n_train]])
    write_tsv(folder / "dev.tsv", ["sentence", "label"], [[s, str(y)] for s, y in rows[n_train:]])
    if test:
        write_tsv(folder / "test.tsv", ["index", "sentence"], [[str(i), s] for i, (s, _) in enumerate(rows[:12])])
    return folder


# --- recipes and config ------------------------------------------------------------------------------------


def test_paper_recipes_cover_the_twelve_tasks_with_classifier_dropout_0_1_and_adamw():
    assert set(PAPER_HYPERPARAMS) == {
        *("cola", "stsb", "sst2", "mnli", "qnli", "qqp", "rte", "mrpc", "wnli", "squad1", "squad2", "race")
    }
    assert all(h.classifier_dropout == 0.1 and h.optimizer == "adamw" for h in PAPER_HYPERPARAMS.values())
    assert PAPER_HYPERPARAMS["squad1"].max_seq_length == 384
    assert all(h.max_seq_length == 512 for name, h in PAPER_HYPERPARAMS.items() if name != "squad1")


def test_paper_recipe_values_for_mnli_and_squad_v2():
    m, s = PAPER_HYPERPARAMS["mnli"], PAPER_HYPERPARAMS["squad2"]
    assert (m.lr, m.batch_size, m.train_steps, m.warmup_steps) == (3e-5, 128, 10000, 1000)
    assert (s.lr, s.batch_size, s.train_steps, s.warmup_steps) == (3e-5, 48, 8144, 814)


def test_task_aliases_resolve_and_unknown_tasks_are_named():
    assert canonical_task("SST-2") == "sst2"
    assert canonical_task("squad-v2.0") == "squad2"
    with pytest.raises(ValueError, match="'imdb'"):
        canonical_task("imdb")


def test_max_steps_shortens_the_run_and_scales_warmup_alike(tmp_path):
    h = FinetuneConfig("rte", str(tmp_path), model=tiny(100), max_steps=80).hyperparams()
    assert (h.train_steps, h.warmup_steps, h.lr) == (80, 20, 3e-5)  # RTE: 200 of 800 steps warm up


def test_overrides_replace_recipe_values(tmp_path):
    h = FinetuneConfig("rte", str(tmp_path), model=tiny(100), overrides={"lr": 1e-4, "optimizer": "lamb"}).hyperparams()
    assert (h.lr, h.optimizer, h.batch_size) == (1e-4, "lamb", 32)


def test_unknown_override_is_rejected_naming_it(tmp_path):
    with pytest.raises(ValueError, match="'learning_rate'"):
        FinetuneConfig("rte", str(tmp_path), model=tiny(100), overrides={"learning_rate": 1e-4})


def test_config_needs_a_checkpoint_or_a_model(tmp_path):
    with pytest.raises(ValueError, match="checkpoint"):
        FinetuneConfig("rte", str(tmp_path))


def test_missing_tokenizer_error_names_the_places_tried(tmp_path):
    cfg = FinetuneConfig("rte", str(tmp_path), checkpoint=str(tmp_path / "ckpt"))
    with pytest.raises(FileNotFoundError, match="spiece.model"):
        cfg.tokenizer_path()


def test_tokenizer_is_found_in_the_checkpoint_directory(tmp_path, tok):
    tok.save(tmp_path / "run")
    ckpt = tmp_path / "run" / "checkpoints" / "step_10"
    ckpt.mkdir(parents=True)
    assert FinetuneConfig("rte", str(tmp_path), checkpoint=str(ckpt)).tokenizer_path() == tmp_path / "run" / (
        "spiece.model"
    )


def test_eval_steps_are_periodic_and_include_the_last_step():
    assert eval_steps(10, 4) == {4, 8, 10}
    assert eval_steps(10, 0) == {10}
    assert eval_steps(100, None) == set(range(10, 101, 10))


# --- GLUE inputs -------------------------------------------------------------------------------------------


def test_truncate_pair_cuts_the_longer_side_first_then_b_on_ties():
    a, b = truncate_pair(list(range(10)), list(range(4)), 8)
    assert (len(a), len(b)) == (4, 4)
    a, b = truncate_pair(list(range(5)), list(range(5)), 9)
    assert (a, b) == (list(range(5)), list(range(4)))


def test_encode_pair_builds_cls_a_sep_b_sep_with_segment_ids(tok):
    ids, types = encode_pair(tok, "a long movie", "the plot", 64)
    a, b = tok.encode("a long movie"), tok.encode("the plot")
    assert ids == [tok.cls_id, *a, tok.sep_id, *b, tok.sep_id]
    assert types == [0] * (len(a) + 2) + [1] * (len(b) + 1)


def test_encode_pair_respects_max_seq_length(tok):
    ids, types = encode_pair(tok, " ".join(WORDS * 3), " ".join(WORDS), 20)
    assert len(ids) == len(types) == 20 and ids.count(tok.sep_id) == 2


# --- the train loop ----------------------------------------------------------------------------------------


def test_training_learns_a_keyword_task_to_high_dev_accuracy(tmp_path, tok_dir):
    data = write_sst2(tmp_path, test=False)
    overrides = {"lr": 1e-3, "batch_size": 16, "train_steps": 120, "warmup_steps": 12, "max_seq_length": 32}
    result = finetune(config("sst2", data, tok_dir, tmp_path, overrides=overrides, eval_every=40))
    assert result["history"][0]["step"] == 40
    assert result["dev"]["acc"] >= 0.95
    first_loss, last_loss = result["history"][0]["train_loss"], result["history"][-1]["train_loss"]
    assert last_loss < first_loss


def test_glue_run_writes_the_submission_file_and_one_metrics_line_per_evaluation(tmp_path, tok_dir):
    data = write_sst2(tmp_path, n_train=40, n_dev=16)
    result = finetune(config("sst2", data, tok_dir, tmp_path))
    out = tmp_path / "out"
    lines = (out / "SST-2.tsv").read_text().splitlines()
    assert lines[0] == "index\tprediction"
    assert [line.split("\t")[0] for line in lines[1:]] == [str(i) for i in range(12)]
    assert {line.split("\t")[1] for line in lines[1:]} <= {"0", "1"}
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4]
    assert all(0.0 <= r["acc"] <= 1.0 for r in records)
    assert json.loads((out / "result.json").read_text())["dev"] == result["dev"]


def test_best_dev_weights_are_kept_and_their_outputs_rescore_to_the_reported_metrics(tmp_path, tok_dir):
    data = write_sst2(tmp_path, n_train=60, n_dev=30, test=False)
    cfg = config("sst2", data, tok_dir, tmp_path, overrides={**SMALL, "train_steps": 8}, eval_every=1)
    result = finetune(cfg)
    best = max(result["history"], key=lambda r: r["acc"])
    assert result["best_step"] == best["step"]
    assert result["dev"]["acc"] == best["acc"]
    rescored = score_ensemble(cfg, [Path(result["files"]["outputs_dev"]).parent])  # an ensemble of this run alone
    assert rescored["dev"] == result["dev"]


def test_early_stopping_ends_the_run_after_patience_evaluations_without_improvement(tmp_path, tok_dir):
    data = write_sst2(tmp_path, n_train=40, n_dev=16, test=False)
    overrides = {**SMALL, "lr": 1e-12, "train_steps": 20}  # the dev metric cannot move
    result = finetune(config("sst2", data, tok_dir, tmp_path, overrides=overrides, eval_every=2, patience=3))
    assert result["stopped_early"]
    assert result["steps"] == 8  # best at step 2, then 3 evaluations (4, 6, 8) without a better one
    assert result["best_step"] == 2


def test_gradient_accumulation_matches_the_full_batch_update(tmp_path, tok_dir):
    data = write_sst2(tmp_path, n_train=32, n_dev=16, test=False)
    outputs = []
    for micro in (None, 2):
        cfg = config("sst2", data, tok_dir, tmp_path / str(micro), micro_batch_size=micro, dropout=0.0, eval_every=0)
        cfg.overrides["classifier_dropout"] = 0.0
        outputs.append(TaskOutputs.load(finetune(cfg)["files"]["outputs_dev"]).arrays["logits"])
    np.testing.assert_allclose(outputs[0], outputs[1], rtol=1e-4, atol=1e-5)


def test_same_seed_reproduces_the_run_and_another_seed_differs(tmp_path, tok_dir):
    data = write_sst2(tmp_path, n_train=32, n_dev=16, test=False)

    def logits(seed, name):
        run = finetune(config("sst2", data, tok_dir, tmp_path / name, seed=seed, eval_every=0))
        return TaskOutputs.load(run["files"]["outputs_dev"]).arrays["logits"]

    a, b, c = logits(1, "a"), logits(1, "b"), logits(2, "c")
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c)


def test_pretrained_backbone_is_loaded_under_a_new_head(tmp_path, tok_dir, tok):
    pretrained = AlbertForPreTraining(tiny(tok.vocab_size))
    save_model(tmp_path / "ckpt", pretrained)
    tok.save(tmp_path / "ckpt")
    data = write_sst2(tmp_path, n_train=16, n_dev=8, test=False)
    cfg = FinetuneConfig("sst2", str(data), checkpoint=str(tmp_path / "ckpt"), overrides=dict(SMALL))
    h = cfg.hyperparams()
    model = build_model(cfg, load_task_data(cfg, tok, h), h, tok.vocab_size)
    expected = {k: v for k, v in state_dict_of(pretrained).items() if k.startswith("albert.")}
    got = state_dict_of(model)
    assert all(torch.equal(got[k], v) for k, v in expected.items())
    assert model.classifier_dropout.p == 0.1


def test_pooling_mean_reaches_the_task_model_and_its_saved_config(tmp_path, tok_dir, tok):
    save_model(tmp_path / "ckpt", AlbertForPreTraining(tiny(tok.vocab_size)))  # pretrained with [CLS] pooling
    tok.save(tmp_path / "ckpt")
    data = write_sst2(tmp_path, n_train=16, n_dev=8, test=False)
    cfg = FinetuneConfig(
        "sst2", str(data), checkpoint=str(tmp_path / "ckpt"), overrides=dict(SMALL), pooling="mean",
        eval_every=0, output_dir=str(tmp_path / "out"), save_model=True,
    )  # fmt: skip
    h = cfg.hyperparams()
    assert build_model(cfg, load_task_data(cfg, tok, h), h, tok.vocab_size).albert.config.pooling == "mean"
    finetune(cfg)
    saved = json.loads((tmp_path / "out" / "model" / "config.json").read_text())
    assert saved["pooling"] == "mean"
    with pytest.raises(ValueError, match="FinetuneConfig.pooling: expected None or one of cls, mean, got 'max'"):
        FinetuneConfig("sst2", str(data), checkpoint=str(tmp_path / "ckpt"), pooling="max")


def test_race_max_qa_length_must_leave_room_for_the_article(tmp_path, tok_dir):
    with pytest.raises(ValueError, match="FinetuneConfig.max_qa_length"):
        finetune(config("race", race_dir(tmp_path), tok_dir, tmp_path, max_qa_length=128))


def test_a_vocabulary_smaller_than_the_tokenizer_is_rejected(tmp_path, tok_dir):
    data = write_sst2(tmp_path, n_train=16, n_dev=8, test=False)
    with pytest.raises(ValueError, match="vocab_size 50"):
        finetune(config("sst2", data, tok_dir, tmp_path, model=tiny(50)))


# --- other GLUE shapes ---------------------------------------------------------------------------------------


def test_stsb_regression_reports_pearson_spearman_and_writes_scores(tmp_path, tok_dir):
    rng = random.Random(3)
    header = ["index", "genre", "filename", "year", "old_index", "source1", "source2", "sentence1", "sentence2"]

    def rows(n, labelled):
        out = []
        for i in range(n):
            a, b = (" ".join(rng.choice(WORDS) for _ in range(5)) for _ in range(2))
            row = [str(i), "main-captions", "MSRvid", "2012test", str(i), "none", "none", a, b]
            out.append(row + [f"{rng.uniform(0, 5):.3f}"] if labelled else row)
        return out

    folder = tmp_path / "STS-B"
    write_tsv(folder / "train.tsv", header + ["score"], rows(24, True))
    write_tsv(folder / "dev.tsv", header + ["score"], rows(12, True))
    write_tsv(folder / "test.tsv", header, rows(5, False))
    result = finetune(config("stsb", folder, tok_dir, tmp_path))
    assert set(result["dev"]) == {"pearson", "spearman", "corr"}
    lines = (tmp_path / "out" / "STS-B.tsv").read_text().splitlines()
    assert lines[0] == "index\tprediction" and len(lines) == 6
    assert all(len(line.split("\t")[1].split(".")[1]) == 3 for line in lines[1:])


def test_mnli_is_scored_on_matched_and_mismatched_dev_and_writes_both_submissions(tmp_path, tok_dir):
    rng = random.Random(4)
    labels = ("contradiction", "entailment", "neutral")
    labelled = ["index", "promptID", "pairID", "genre", "sentence1", "sentence2", "gold_label"]
    test_header = ["index", "promptID", "pairID", "genre", "sentence1", "sentence2"]

    def row(i, label=None):
        a, b = (" ".join(rng.choice(WORDS) for _ in range(5)) for _ in range(2))
        return [str(i), "1", f"{i}n", "fiction", a, b] + ([label] if label else [])

    folder = tmp_path / "MNLI"
    write_tsv(folder / "train.tsv", labelled, [row(i, labels[i % 3]) for i in range(24)])
    for name in ("dev_matched.tsv", "dev_mismatched.tsv"):
        write_tsv(folder / name, labelled, [row(i, labels[i % 3]) for i in range(9)])
    for name in ("test_matched.tsv", "test_mismatched.tsv"):
        write_tsv(folder / name, test_header, [row(i) for i in range(4)])
    result = finetune(config("mnli", folder, tok_dir, tmp_path))
    assert set(result["dev"]) == {"acc", "dev_mismatched_acc"}
    for name in ("MNLI-m.tsv", "MNLI-mm.tsv"):
        lines = (tmp_path / "out" / name).read_text().splitlines()
        assert lines[0] == "index\tprediction" and {line.split("\t")[1] for line in lines[1:]} <= set(labels)


def test_polarity_split_holds_out_25_sentences_of_each_label_the_same_way_every_time(tmp_path):
    path = tmp_path / "pang_lee_polarity.cor"
    path.write_text("".join(f"__label__{'neg' if i < 100 else 'pos'} sentence number {i} . \n" for i in range(200)))
    examples = read_polarity(path)
    train, held = polarity_split(examples)
    assert (len(train), len(held)) == (150, 50)
    assert sum(e.label for e in held) == 25
    assert {e.guid for e in train}.isdisjoint(e.guid for e in held)
    assert [e.guid for e in polarity_split(examples)[1]] == [e.guid for e in held]


def test_polarity_task_trains_on_the_fasttext_file_and_writes_sst2_format_predictions(tmp_path, tok_dir):
    rows = keyword_rows(200, 5)
    lines = [f"__label__{'pos' if y else 'neg'} {s} \n" for s, y in rows]
    (tmp_path / "pang_lee_polarity.cor").write_text("".join(lines))
    result = finetune(config("polarity", tmp_path, tok_dir, tmp_path))
    assert result["metric"] == "acc" and 0.0 <= result["dev"]["acc"] <= 1.0
    predictions = (tmp_path / "out" / "predictions_dev.tsv").read_text().splitlines()
    assert predictions[0] == "index\tprediction" and len(predictions) == 51


# --- SQuAD -------------------------------------------------------------------------------------------------


def squad_dir(tmp_path: Path, version: str, document: dict | None = None) -> Path:
    folder = tmp_path / f"squad{version}"
    folder.mkdir()
    text = SQUAD_V1.read_text() if document is None else json.dumps(document)
    for split in ("train", "dev"):
        (folder / f"{split}-v{version}.json").write_text(text)
    return folder


def test_squad_v1_on_the_allennlp_fixture_scores_and_writes_official_predictions(tmp_path, tok_dir):
    folder = squad_dir(tmp_path, "1.1")
    result = finetune(config("squad1", folder, tok_dir, tmp_path, overrides={**SMALL, "max_seq_length": 128}))
    assert set(result["dev"]) == {"exact", "f1"} and 0.0 <= result["dev"]["f1"] <= 100.0
    predictions = json.loads((tmp_path / "out" / "predictions_dev.json").read_text())
    qids = [q["id"] for a in json.loads(SQUAD_V1.read_text())["data"] for p in a["paragraphs"] for q in p["qas"]]
    assert sorted(predictions) == sorted(qids)
    contexts = [p["context"] for a in json.loads(SQUAD_V1.read_text())["data"] for p in a["paragraphs"]]
    assert all(any(answer in c for c in contexts) for answer in predictions.values())


def test_squad_v1_learns_to_answer_its_training_questions(tmp_path, tok_dir):
    folder = squad_dir(tmp_path, "1.1")
    overrides = {"lr": 3e-3, "batch_size": 8, "train_steps": 60, "warmup_steps": 5, "max_seq_length": 128}
    result = finetune(config("squad1", folder, tok_dir, tmp_path, overrides=overrides, eval_every=20, dropout=0.0))
    assert result["dev"]["f1"] >= 60.0  # memorizing 5 questions: far above an untrained model


def test_squad_v2_tunes_the_null_threshold_and_writes_null_odds(tmp_path, tok_dir):
    folder = squad_dir(tmp_path, "2.0", SQUAD_V2)
    result = finetune(config("squad2", folder, tok_dir, tmp_path))
    dev = result["dev"]
    assert {"exact", "f1", "HasAns_f1", "NoAns_f1", "null_threshold"} <= set(dev)
    predictions = json.loads((tmp_path / "out" / "predictions_dev.json").read_text())
    odds = json.loads((tmp_path / "out" / "null_odds_dev.json").read_text())
    assert set(predictions) == set(odds) == {"q-answerable", "q-unanswerable"}
    for qid, answer in predictions.items():
        assert (answer == "") == (odds[qid] > dev["null_threshold"])
    # the tuned threshold is at least as good as answering nothing (which gets the unanswerable one right)
    assert dev["f1"] >= 50.0


# --- RACE --------------------------------------------------------------------------------------------------


def race_dir(tmp_path: Path) -> Path:
    root = tmp_path / "RACE"
    for split in ("train", "dev", "test"):
        for level, record in RACE_RECORDS.items():
            path = root / split / level / f"{record['id'][-5]}.txt"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(record))
    return root


def test_race_reports_middle_high_and_all_accuracy_on_dev_and_test(tmp_path, tok_dir):
    cfg = config("race", race_dir(tmp_path), tok_dir, tmp_path, overrides={**SMALL, "batch_size": 2}, max_qa_length=24)
    result = finetune(cfg)
    assert set(result["dev"]) == {"acc", "acc_middle", "acc_high"}
    assert set(result["test"]) == {"acc", "acc_middle", "acc_high"}
    assert result["dev"]["acc"] in (0.0, 1 / 3, 2 / 3, 1.0)
    predictions = json.loads((tmp_path / "out" / "predictions_test.json").read_text())
    assert set(predictions) == {"middle1.txt-0", "middle1.txt-1", "high7.txt-0"}
    assert set(predictions.values()) <= {"A", "B", "C", "D"}


def test_race_learns_its_three_training_questions(tmp_path, tok_dir):
    overrides = {"lr": 3e-3, "batch_size": 3, "train_steps": 40, "warmup_steps": 4, "max_seq_length": 64}
    cfg = config("race", race_dir(tmp_path), tok_dir, tmp_path, overrides=overrides, eval_every=10, max_qa_length=24)
    result = finetune(cfg)
    assert result["dev"]["acc"] == 1.0


# --- seeds and ensembles -----------------------------------------------------------------------------------


def outputs(logits, ids=("a", "b", "c")) -> TaskOutputs:
    return TaskOutputs("sst2", "dev", list(ids), {"logits": np.asarray(logits, dtype=np.float32)})


def test_ensemble_averages_the_logits_of_each_row():
    merged = ensemble([outputs([[0, 2], [1, 1], [4, 0]]), outputs([[2, 0], [3, 1], [0, 0]])])
    np.testing.assert_allclose(merged.arrays["logits"], [[1, 1], [2, 1], [2, 0]])
    assert merged.ids == ["a", "b", "c"]


def test_ensemble_refuses_outputs_on_different_rows():
    with pytest.raises(ValueError, match="different rows"):
        ensemble([outputs([[0, 1]] * 3), outputs([[0, 1]] * 3, ids=("a", "c", "b"))])


def test_task_outputs_round_trip_through_npz(tmp_path):
    original = outputs([[0.5, -1.0], [2.0, 0.0], [1.0, 1.0]])
    loaded = TaskOutputs.load(original.save(tmp_path / "o.npz"))
    assert (loaded.task, loaded.split, loaded.ids) == ("sst2", "dev", ["a", "b", "c"])
    np.testing.assert_array_equal(loaded.arrays["logits"], original.arrays["logits"])


def test_ensemble_of_two_runs_is_scored_on_the_task_data(tmp_path, tok_dir):
    data = write_sst2(tmp_path, n_train=32, n_dev=16, test=False)
    cfgs = [config("sst2", data, tok_dir, tmp_path / str(s), seed=s, eval_every=0) for s in (1, 2)]
    dirs = [Path(finetune(c)["files"]["outputs_dev"]).parent for c in cfgs]
    merged = ensemble([TaskOutputs.load(d / "outputs_dev.npz") for d in dirs])
    labels = np.array([y for _, y in keyword_rows(48, 1)[32:]])
    expected = float(np.mean(merged.arrays["logits"].argmax(1) == labels))
    assert score_ensemble(cfgs[0], dirs)["dev"] == {"acc": expected}


def test_score_ensemble_averages_saved_runs_and_writes_the_ensemble_submission(tmp_path, tok_dir):
    data = write_sst2(tmp_path, n_train=32, n_dev=16)
    cfgs = [config("sst2", data, tok_dir, tmp_path / str(s), seed=s, eval_every=0) for s in (1, 2)]
    dirs = [Path(finetune(c)["files"]["outputs_dev"]).parent for c in cfgs]
    result = score_ensemble(cfgs[0], dirs, tmp_path / "ensemble")
    merged = ensemble([TaskOutputs.load(d / "outputs_dev.npz") for d in dirs])
    labels = np.array([y for _, y in keyword_rows(48, 1)[32:]])
    assert result["dev"] == {"acc": float(np.mean(merged.arrays["logits"].argmax(1) == labels))}
    merged_test = ensemble([TaskOutputs.load(d / "outputs_test.npz") for d in dirs])
    lines = (tmp_path / "ensemble" / "SST-2.tsv").read_text().splitlines()[1:]
    assert [int(line.split("\t")[1]) for line in lines] == merged_test.arrays["logits"].argmax(1).tolist()


def test_score_ensemble_refuses_a_directory_without_outputs(tmp_path, tok_dir):
    data = write_sst2(tmp_path, n_train=16, n_dev=8, test=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="outputs_"):
        score_ensemble(config("sst2", data, tok_dir, tmp_path), [tmp_path / "empty"])


def run_result(seed, **dev):
    return {"task": "mrpc", "seed": seed, "metric": "acc_and_f1", "dev": dev}


def test_median_of_seeds_takes_the_median_of_each_metric_separately():
    results = [run_result(s, acc=a, f1=f) for s, a, f in [(1, 0.8, 0.1), (2, 0.6, 0.9), (3, 0.7, 0.5)]]
    summary = median_of_seeds(results)
    assert summary["median"] == {"acc": pytest.approx(0.7), "f1": pytest.approx(0.5)}
    assert summary["seeds"] == [1, 2, 3] and summary["runs"] == 3


def test_median_of_seeds_refuses_mixed_tasks():
    with pytest.raises(ValueError, match="several tasks"):
        median_of_seeds([run_result(1, acc=0.5), {**run_result(2, acc=0.5), "task": "rte"}])


def test_markdown_table_has_a_row_per_seed_and_a_median_row_in_percent():
    table = markdown_table(median_of_seeds([run_result(s, acc=a) for s, a in [(1, 0.5), (2, 0.75)]]))
    lines = table.splitlines()
    assert lines[0] == "| seed | acc |"
    assert lines[2:] == ["| 1 | 50.00 |", "| 2 | 75.00 |", "| **median** | **62.50** |"]
