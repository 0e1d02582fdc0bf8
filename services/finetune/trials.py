"""Fine-tuning runs as Ray Tune trials: the one orchestrator of `albert finetune`'s seeds and sweeps, and of the
fine-tuning that evaluation runs (services.finetune.seeds.run_downstream).

Each FinetuneConfig is one trial (`tune.grid_search` over their indices), a function trainable holding the run's
resources (`tune.with_resources`: num_cpus, num_gpus; torch limited to that many threads), that runs
`albert_core.finetune.finetuning.finetune` exactly as one run in its own process would, and reports its primary dev
metric at each dev evaluation (what `--early-stop asha` stops on). A run's files are its config's output_dir
(result.json when it finished); Tune's own state is the experiment directory `storage` (<output>/tune).

A run whose process dies while the command runs (its node lost, the process killed) runs again from its start, up to
TRIAL_RETRIES times (Tune's FailureConfig); a run that fails by itself (an error of its own) is also tried TRIAL_RETRIES
more times before the command names it.

Resume: when `storage` holds an experiment Tune can restore (a Ctrl-C, a SIGTERM, a lost node or driver) of the same
runs (their configs, recorded in RUNS_FILE; state of other runs is removed and they start anew), the trials are
restored (`Tuner.restore`, unfinished and errored trials run again, finished ones kept) and the outcome
says how many finished runs it reused. Ctrl-C (SIGINT) and SIGTERM stop the trials still running and save Tune's
state, then raise SeedsInterrupted with the runs that finished.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.cluster import connect

if TYPE_CHECKING:
    from albert_core.finetune.config import FinetuneConfig

TUNE_DIR = "tune"  # Tune's experiment directory in a command's output folder
TRIAL_RETRIES = 2  # a run whose process dies (its node lost, killed) runs again from its start, up to this often
RUNS_FILE = "albert_runs.json"  # in TUNE_DIR: the runs' configs; Tune's state is restored only for the same ones
RESULT_FILE = "result.json"  # what albert_core.finetune.finetuning.finetune writes last, in a run's output_dir
EARLY_STOPS = ("asha",)
SCORE = "score"  # the reported key: the task's primary dev metric at an evaluation (non-finite: LOW_SCORE)
LOW_SCORE = -1e9


class SeedsInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM while runs went on as Tune trials; `results` are the runs that had finished (in config
    order). Tune's state was saved: the same command resumes the rest."""

    def __init__(self, results: list[dict[str, Any]]):
        super().__init__(f"{len(results)} run(s) had finished")
        self.results = results


@dataclass
class TrialsOutcome:
    """What the trials left: `results[i]` is config i's result (None where it did not finish: --early-stop ended
    it), `reused` how many finished results a resume took from an earlier start."""

    results: list[dict[str, Any] | None]
    reused: int = 0


def _trial(params: dict[str, Any], configs: Sequence[FinetuneConfig], num_threads: int, cwd: str) -> None:
    """One Tune trial: config params["trial"] fine-tuned, its primary dev metric reported at each evaluation."""
    import torch
    from ray import tune

    from albert_core.finetune.finetuning import finetune

    if os.path.isdir(cwd):  # the command's relative paths (Tune starts a trial in its own directory)
        os.chdir(cwd)
    config = configs[params["trial"]]
    if config.output_dir is not None:  # a run restarted after a stop: its earlier result is not this run's
        (Path(config.output_dir) / RESULT_FILE).unlink(missing_ok=True)
    torch.set_num_threads(max(1, num_threads))
    last = config.hyperparams().train_steps

    def report(step: int, value: float) -> None:
        if step >= last:  # ASHA would stop the run at its last evaluation, before it writes its result
            return
        finite = value == value and abs(value) != float("inf")
        tune.report({"step": step, SCORE: float(value) if finite else LOW_SCORE})

    finetune(config, on_evaluation=report)


def finished_result(config: FinetuneConfig) -> dict[str, Any] | None:
    """The result a run wrote when it finished (its result.json), None when it has none or was interrupted."""
    return _read_result(config.output_dir)


def _console_callback(labels: Sequence[str], configs: Sequence[FinetuneConfig], progress: bool):
    """A Tune callback printing a line per finished run ("seed 12346 finished (2/3): dev acc ..."), and with
    progress a bar over the runs; it is pickled with the experiment, so it keeps only what a restore can use."""
    from ray import tune

    from services.finetune.console import seed_line

    class Console(tune.Callback):
        def __init__(self) -> None:
            self.outputs = [c.output_dir for c in configs]
            self.labels, self.progress = list(labels), progress

        def setup(self, **info: Any) -> None:
            self.done = sum(_finished_dir(d) for d in self.outputs)
            self.bar = None
            if self.progress:
                from tqdm.auto import tqdm

                desc = "runs" if any(self.labels) else "seeds"  # a sweep's runs; a plain command's seeds, as before
                self.bar = tqdm(total=len(self.outputs), initial=self.done, desc=desc, unit="run")

        def on_trial_complete(self, iteration: int, trials: list, trial, **info: Any) -> None:
            index = trial.config["trial"]
            result = _read_result(self.outputs[index])
            if result is None:
                return  # stopped by the scheduler: the summary lists it
            self.done += 1
            line = self.labels[index] + seed_line(result, self.done, len(self.outputs))
            if self.bar is not None:
                self.bar.update(1)
                self.bar.write(line)
            else:
                print(line, flush=True)

        def on_experiment_end(self, trials: list, **info: Any) -> None:
            if self.bar is not None:
                self.bar.close()

        def __getstate__(self) -> dict[str, Any]:
            return {"outputs": self.outputs, "labels": self.labels, "progress": self.progress}

    return Console()


def _read_result(output_dir: str | None) -> dict[str, Any] | None:
    if output_dir is None:
        return None
    try:
        result = json.loads((Path(output_dir) / RESULT_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return None if result.get("interrupted") else result


def _finished_dir(output_dir: str | None) -> bool:
    return _read_result(output_dir) is not None


def _scheduler(early_stop: str | None, configs: Sequence[FinetuneConfig]):
    """ASHA on the reported dev metric at the evaluation steps (the step is its time), or None."""
    if early_stop is None:
        return None
    if early_stop not in EARLY_STOPS:
        raise ValueError(f"--early-stop: expected one of {', '.join(EARLY_STOPS)}, got {early_stop!r}")
    from ray.tune.schedulers import ASHAScheduler

    grace, max_t = asha_steps(configs)
    return ASHAScheduler(time_attr="step", metric=SCORE, mode="max", max_t=max_t, grace_period=grace)


def asha_steps(configs: Sequence[FinetuneConfig]) -> tuple[int, int]:
    """ASHA's grace period and its end, in steps: the earliest dev evaluation of any run, and the last step of the
    longest run."""
    from albert_core.finetune.finetuning import eval_steps

    schedules = [eval_steps(c.hyperparams().train_steps, c.eval_every) for c in configs]
    return min(min(s) for s in schedules), max(max(s) for s in schedules)


def _tuner(configs, storage: Path, *, num_cpus: float, num_gpus: float, progress: bool, early_stop, labels):
    """A new Tuner over the configs, or the one whose state `storage` holds (restored)."""
    from ray import tune

    threads = int(max(1, num_cpus))
    trainable = tune.with_parameters(_trial, configs=list(configs), num_threads=threads, cwd=os.getcwd())
    trainable = tune.with_resources(trainable, {"cpu": num_cpus, "gpu": num_gpus})
    record = storage / RUNS_FILE
    runs = json.dumps([dataclasses.asdict(c) for c in configs], default=str, sort_keys=True)
    if tune.Tuner.can_restore(str(storage)) and record.is_file() and record.read_text() == runs:
        return tune.Tuner.restore(str(storage), trainable, resume_unfinished=True, restart_errored=True), True
    if storage.is_dir():  # the state of runs of other settings (a plain run again with another --lr): start anew
        shutil.rmtree(storage)
    storage.mkdir(parents=True)
    record.write_text(runs)
    names = [f"run_{i:04d}" for i in range(len(configs))]
    tune_config = tune.TuneConfig(
        scheduler=_scheduler(early_stop, configs),
        reuse_actors=True,  # a trial's process (torch imported) runs the next trial
        trial_name_creator=lambda trial: names[trial.config["trial"]],
        trial_dirname_creator=lambda trial: names[trial.config["trial"]],
    )
    run_config = tune.RunConfig(
        storage_path=str(storage.parent),
        name=storage.name,
        verbose=0,
        callbacks=[_console_callback(labels, configs, progress)],
        failure_config=tune.FailureConfig(max_failures=TRIAL_RETRIES),
    )
    space = {"trial": tune.grid_search(list(range(len(configs))))}
    return tune.Tuner(trainable, param_space=space, tune_config=tune_config, run_config=run_config), False


def run_trials(
    configs: Sequence[FinetuneConfig],
    storage: str | Path,
    *,
    num_cpus: float = 1,
    num_gpus: float = 0,
    progress: bool = False,
    early_stop: str | None = None,
    labels: Sequence[str] | None = None,
    address: str | None = None,
) -> TrialsOutcome:
    """Run each config as a Tune trial of num_cpus CPUs (and num_gpus GPUs), Tune's state in `storage` (restored
    from there when it holds this experiment). `labels` prefix each run's line (a sweep's point). Ctrl-C or SIGTERM:
    SeedsInterrupted with the finished runs; a run that failed: RuntimeError naming it and its error."""
    storage = Path(storage).resolve()
    started = time.time()
    connect(address)
    _quiet_tune()
    labels = list(labels) if labels is not None else [""] * len(configs)
    tuner, restored = _tuner(
        configs,
        storage,
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        progress=progress,
        early_stop=early_stop,
        labels=labels,
    )
    stop = _StopSignals()
    with stop:
        grid = tuner.fit()
    results = [finished_result(c) for c in configs]
    reused = sum(r is not None and r.get("started", started) < started for r in results) if restored else 0
    for result in grid:
        if result.error is not None:
            index = result.config["trial"]
            raise RuntimeError(f"fine-tuning run {labels[index]}seed {configs[index].seed} failed: {result.error}")
    if stop.received is not None:
        interrupt = SeedsInterrupted([r for r in results if r is not None])
        if stop.received == "SIGTERM":
            from services.terminal import Terminated

            raise interrupt from Terminated("terminated (SIGTERM)")
        raise interrupt
    return TrialsOutcome(results, reused=reused)


def _quiet_tune() -> None:
    """Tune's own console (its experiment box, a status table, a line per state save) off: the command prints its
    runs' lines and summary as before. Tune's warnings stay."""
    import logging

    os.environ["RAY_AIR_NEW_OUTPUT"] = "0"  # read by Tune when the run starts; verbose=0 then prints nothing
    os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = "1"  # _StopSignals handles Ctrl-C (and tells the command)
    logging.getLogger("ray.tune").setLevel(logging.WARNING)
    # after a stop: "Failed to fetch metrics" of each trial that had not reported yet (the summary says which ran)
    logging.getLogger("ray.tune.analysis.experiment_analysis").setLevel(logging.ERROR)


class _StopSignals:
    """While Tune runs: Ctrl-C (SIGINT) and SIGTERM ask Tune to stop (SIGUSR1, Tune's own stop: running trials
    stopped, its state saved) instead of unwinding through it; `received` names the signal that came (Tune's own
    SIGINT handler is off: TUNE_DISABLE_SIGINT_HANDLER, so that the command knows it was stopped)."""

    def __init__(self) -> None:
        self.received: str | None = None
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> _StopSignals:
        import threading

        if threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGUSR1"):
            for signum in (signal.SIGINT, signal.SIGTERM):
                self.previous[signum] = signal.signal(signum, self._on_signal)
        return self

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name
            os.kill(os.getpid(), signal.SIGUSR1)

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)


def reused_line(reused: int, total: int) -> str:
    """ "resumed: 3 of 12 runs reused from the earlier start, 9 run now"."""
    return f"resumed: {reused} of {total} runs reused from the earlier start, {total - reused} run now"


__all__ = [
    "EARLY_STOPS",
    "TUNE_DIR",
    "SeedsInterrupted",
    "TrialsOutcome",
    "finished_result",
    "reused_line",
    "run_trials",
]
