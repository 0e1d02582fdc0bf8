"""What a run shows its user: a live progress bar and TensorBoard events while it trains, a report when it ends.

All of it reads the run's metrics log (services.rundir.log). Nothing here touches the training itself.
"""

from __future__ import annotations

import contextlib
import io
import logging
import threading
from pathlib import Path
from typing import Any

from albert_core.files import atomic_write_bytes, atomic_write_text, is_disk_full
from services.rundir import schedules
from services.rundir.evaluations import markdown_cell
from services.rundir.log import METRICS_FILE, follow, last_per_step, read_metrics
from services.terminal import printable

__all__ = ["LiveView", "write_report"]

log = logging.getLogger(__name__)


class LiveView:
    """Follows metrics.jsonl in a thread: a rich progress bar on the terminal and TensorBoard event files."""

    def __init__(self, run_dir: str | Path, total_steps: int, *, progress: bool = True, tensorboard: bool = True):
        self.run_dir = Path(run_dir)
        self.total_steps = total_steps
        self.show_progress = progress
        self.tensorboard = tensorboard
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="albert-live-view", daemon=True)

    def __enter__(self) -> LiveView:
        self._excepthook = threading.excepthook
        threading.excepthook = self._full_disk_in_a_thread
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        threading.excepthook = self._excepthook

    def _full_disk_in_a_thread(self, args) -> None:
        """TensorBoard's writer thread meets a full disk: no traceback (its next write fails too, and `_add_scalars`
        says so in one line). Anything else as before."""
        if args.exc_value is not None and is_disk_full(args.exc_value):
            log.debug("thread %s: %s", getattr(args.thread, "name", "?"), args.exc_value)
            return
        self._excepthook(args)

    def _run(self) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        writer = _tensorboard(self.run_dir / "tensorboard") if self.tensorboard else None
        columns = [
            TextColumn("[bold]pretrain"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            TimeRemainingColumn(),
        ]
        with Progress(*columns, disable=not self.show_progress, transient=False) as progress:
            task = progress.add_task("pretrain", total=self.total_steps, status="starting workers")
            seen_step = -1
            for record in follow(self.run_dir, self._stop, poll_s=0.5):
                step = int(record.get("step", 0))
                if writer is not None:
                    writer = _add_scalars(writer, record, step)
                if record.get("kind") == "train" and step > seen_step:
                    seen_step = step
                    progress.update(task, completed=step, status=_status_line(record))
                elif record.get("kind") == "eval":
                    _say(progress, f"eval @ step {step}: {_fmt(record, EVAL_KEYS)}")
                elif record.get("kind") == "event":
                    for line in event_lines(record):
                        _say(progress, line)
        if writer is not None:
            with contextlib.suppress(OSError):  # a full disk: said once already
                writer.close()


def _tensorboard(log_dir: Path):
    """TensorBoard's event writer, or None when the disk is full already (one warning line)."""
    from torch.utils.tensorboard import SummaryWriter

    try:
        return SummaryWriter(log_dir=str(log_dir))
    except OSError as err:
        if not is_disk_full(err):
            raise
        log.warning("%s: TensorBoard events stopped at the start: the disk is full (%s)", log_dir, err)
        return None


def _add_scalars(writer, record: dict[str, Any], step: int):
    """The record's numbers as TensorBoard scalars; the writer, or None once the disk is full (TensorBoard stops,
    the view and the run go on: the metrics log holds the same numbers)."""
    try:
        for key, value in record.items():
            if isinstance(value, (int, float)) and key not in ("step", "time"):
                writer.add_scalar(f"{record.get('kind', 'train')}/{key}", value, step)
    except OSError as err:
        if not is_disk_full(err):
            raise
        log.warning("%s: TensorBoard events stopped at step %d: the disk is full (%s)", writer.log_dir, step, err)
        return None
    return writer


def event_lines(record: dict[str, Any]) -> list[str]:
    """What the console says of a run event: health events with their remedy, warnings (from the workers, whose own
    logs a local run does not show) and config changes in full, other events by name."""
    event, step = record.get("event"), record.get("step", 0)
    if event in HEALTH_EVENTS:
        return [f"{event} @ step {step}: {record.get('message')}", f"  remedy: {record.get('remedy')}"]
    if event == "warning":
        return [f"warning @ step {step}: {record.get('message')}"]
    if event == "config_changed":
        changed = record.get("changed") or {}
        return [f"config changed @ step {step}: " + "; ".join(f"{k}: {v[0]!r} -> {v[1]!r}" for k, v in changed.items())]
    return [f"event @ step {step}: {event}"]


def _say(progress, line: str) -> None:
    """A line above the progress bar, as text: rich markup off, terminal escapes shown (services.terminal)."""
    progress.console.print(printable(line), markup=False, highlight=False)


EVAL_KEYS = ("mlm_acc", "sop_acc", "nsp_acc", "mlm_loss", "unigram_acc", "mlm_margin")
HEALTH_EVENTS = ("plateau", "divergence", "stalled")


def _fmt(record: dict[str, Any], keys: tuple[str, ...]) -> str:
    parts = []
    for key in keys:
        value = record.get(key)
        if isinstance(value, float):
            parts.append(f"{key} {value:.4g}")
        elif value is not None:
            parts.append(f"{key} {value}")
    return "  ".join(parts)


def _status_line(record: dict[str, Any]) -> str:
    return _fmt(record, ("loss", "mlm_acc", "pair_acc", "tokens_per_s"))


def write_report(run_dir: str | Path, *, title: str | None = None) -> Path:
    """report.md with loss and accuracy plots (PNG) from the metrics log; returns the markdown path."""
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    train = last_per_step([r for r in records if r.get("kind") == "train"])
    evals = last_per_step([r for r in records if r.get("kind") == "eval"])
    events = [r for r in records if r.get("kind") == "event"]
    if not train:
        raise ValueError(f"{run_dir / METRICS_FILE}: no training metrics to report")
    _plot_losses(run_dir / "loss.png", train, events)
    _plot_accuracy(run_dir / "accuracy.png", train, evals, events)
    first, last = train[0], train[-1]
    lines = [
        f"# {title or run_dir.name}",
        "",
        f"Steps {first['step']}..{last['step']}; final train loss {last.get('loss', float('nan')):.4f} "
        f"(first logged {first.get('loss', float('nan')):.4f}).",
        "",
        *[line for e in events if e.get("event") == "initialized_from" for line in (f"{e['message']}.", "")],
        *_floor_summary(evals),
        "![loss](loss.png)",
        "",
        "![accuracy](accuracy.png)",
        "",
        *_eval_table(evals),
        *_schedules_section(run_dir, records),
    ]
    health = [e for e in events if e.get("event") in HEALTH_EVENTS]
    if health:
        lines += ["## Training health", ""]
        lines += [f"- step {e['step']}, {e['event']}: {e.get('message')}. Remedy: {e.get('remedy')}" for e in health]
        lines.append("")
    if events:
        lines += ["## Events", ""] + [f"- step {e['step']}: {e.get('event')}" for e in events] + [""]
    path = run_dir / "report.md"
    atomic_write_text(path, "\n".join(lines))
    return path


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt, *plt.subplots(figsize=(7, 4))


def _save(plt, fig, ax, path: Path, ylabel: str) -> None:
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    image = io.BytesIO()
    fig.savefig(image, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(path, image.getvalue())


def _plot_losses(path: Path, train: list[dict[str, Any]], events: list[dict[str, Any]]) -> None:
    plt, fig, ax = _figure()
    steps = [r["step"] for r in train]
    for key in ("loss", "mlm_loss", "pair_loss"):
        values = [r.get(key) for r in train]
        if any(v is not None for v in values):
            ax.plot(steps, values, label=key)
    _mark_events(ax, events)
    _save(plt, fig, ax, path, "loss")


def _plot_accuracy(path: Path, train: list[dict[str, Any]], evals, events: list[dict[str, Any]]) -> None:
    plt, fig, ax = _figure()
    steps = [r["step"] for r in train]
    for key in ("mlm_acc", "pair_acc"):
        ax.plot(steps, [r.get(key) for r in train], label=f"train {key}", alpha=0.6)
    for key in EVAL_KEYS[:3]:
        points = [(r["step"], r[key]) for r in evals if r.get(key) is not None]
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", label=f"held-out {key}")
    floor = [(r["step"], r["unigram_acc"]) for r in evals if r.get("unigram_acc") is not None]
    if floor:  # the same masked positions predicted from piece frequencies alone
        ax.plot(*zip(*floor, strict=True), color="black", linestyle=":", label="held-out MLM, unigram baseline")
    _mark_events(ax, events)
    ax.set_ylim(0, 1)
    _save(plt, fig, ax, path, "accuracy")


def _eval_table(evals: list[dict[str, Any]], heading: str = "## Held-out evaluation") -> list[str]:
    if not evals:
        return []
    keys = [k for k in EVAL_KEYS if any(k in r for r in evals)]
    extra = sorted({k for r in evals for k in r if k.startswith("task/")})
    lines = [heading, "", "| step | " + " | ".join(keys + extra) + " |"]
    lines.append("|" + "---|" * (len(keys) + len(extra) + 1))
    for r in evals:
        lines.append(f"| {r['step']} | " + " | ".join(markdown_cell(r.get(k)) for k in keys + extra) + " |")
    return [*lines, ""]


def _schedules_section(run_dir: Path, records: list[dict[str, Any]]) -> list[str]:
    """Each evaluation schedule's results (services.eval.schedule): one curve per schedule, a table each, and the
    matching steps it could not evaluate."""
    by_name: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        if record.get("kind") == schedules.RESULT_KIND:
            by_name.setdefault(str(record.get("schedule")), []).append(record)
    if not by_name:
        return []
    by_name = {name: last_per_step(rows) for name, rows in sorted(by_name.items())}
    plt, fig, ax = _figure()
    for name, rows in by_name.items():
        for key in ("mlm_acc", "sop_acc"):
            points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=f"{name}: held-out {key}")
    ax.set_ylim(0, 1)
    _save(plt, fig, ax, run_dir / "schedules.png", "accuracy")
    lines = ["## Evaluation schedules", "", "![schedules](schedules.png)", ""]
    states = {s["name"]: s for s in schedules.summaries(run_dir)}
    for name, rows in by_name.items():
        lines += _eval_table(rows, heading=f"### {name}")
        for step, why in states.get(name, {}).get("missing_steps", {}).items():
            lines.append(f"- step {step} not evaluated: {why}")
        lines.append("")
    return lines


def _floor_summary(evals: list[dict[str, Any]]) -> list[str]:
    """The last evaluation against the unigram baseline on the same masked positions."""
    last = next((r for r in reversed(evals) if r.get("unigram_acc") is not None), None)
    if last is None:
        return []
    return [
        f"Held-out MLM accuracy at step {last['step']}: {last['mlm_acc']:.4f}; the unigram baseline on the same masked "
        f"positions (each piece predicted from training frequencies alone): {last['unigram_acc']:.4f}; margin "
        f"{last['mlm_acc'] - last['unigram_acc']:+.4f}.",
        "",
    ]


def _mark_events(ax, events: list[dict[str, Any]]) -> None:
    """Vertical lines at the run's turning points (dropout removal, ...); checkpoint bookkeeping is left out."""
    for event in events:
        if str(event.get("event", "")).startswith("checkpoint"):
            continue
        ax.axvline(event["step"], color="grey", linestyle="--", alpha=0.6)
        ax.annotate(str(event.get("event")), (event["step"], ax.get_ylim()[1]), fontsize=7, rotation=90, va="top")
