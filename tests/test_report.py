"""Run reports: plots + markdown from the metrics log; the live view follows the log into TensorBoard."""

import json
import time

import pytest

from services.rundir.log import read_metrics
from services.rundir.report import LiveView, write_report


def _write(run_dir, records):
    with (run_dir / "metrics.jsonl").open("a") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def _train(step, loss):
    return {"kind": "train", "step": step, "loss": loss, "mlm_acc": 0.1 + step / 1000, "pair_acc": 0.5}


def test_report_has_plots_eval_table_and_events(tmp_path):
    _write(tmp_path, [_train(s, 10 - s / 100) for s in range(10, 110, 10)])
    _write(tmp_path, [{"kind": "eval", "step": 50, "mlm_acc": 0.21, "sop_acc": 0.6, "nsp_acc": 0.55}])
    _write(tmp_path, [{"kind": "event", "step": 60, "event": "dropout_removed"}])
    report = write_report(tmp_path).read_text()
    assert (tmp_path / "loss.png").stat().st_size > 1000 and (tmp_path / "accuracy.png").stat().st_size > 1000
    assert "| 50 | 0.2100 | 0.6000 | 0.5500 |" in report
    assert "step 60: dropout_removed" in report
    assert "final train loss 9.0000" in report


def test_a_step_logged_twice_after_resume_is_reported_once(tmp_path):
    _write(tmp_path, [_train(10, 5.0), _train(20, 4.0), _train(20, 4.0), _train(30, 3.0)])
    write_report(tmp_path)
    assert [r["step"] for r in read_metrics(tmp_path)] == [10, 20, 20, 30]
    assert "Steps 10..30" in (tmp_path / "report.md").read_text()


def test_partial_last_line_is_not_read(tmp_path):
    _write(tmp_path, [_train(10, 5.0)])
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"kind": "train", "step": 2')
    assert len(read_metrics(tmp_path)) == 1


def test_report_without_training_metrics_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="no training metrics"):
        write_report(tmp_path)


def test_live_view_writes_tensorboard_events_for_lines_appended_while_running(tmp_path):
    with LiveView(tmp_path, total_steps=30, progress=False):
        for step in (10, 20, 30):
            _write(tmp_path, [_train(step, 1.0 / step)])
            time.sleep(0.2)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [10, 20, 30]
