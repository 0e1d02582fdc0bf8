"""Pretraining on Ray Train: data-parallel ALBERT + LAMB, exactly resumable.

Where things are:
- cli.py         `albert pretrain`: its flags and handler
- pretrain.py    the job: Ray, the run's coordinator, the trainer, the live view, the report
- coordinator.py the run's coordinator actor: its ledger (services.rundir) and its evaluation schedule (services.eval)
- interrupt.py   Ctrl-C on the driver: a graceful stop first, at once on the second
- driver.py      the one path from a command to the workers: `prepare_run` (a finished run, a resume's config
                 changes, the plan) and `launch(plan)` (one TorchTrainer), the result
- dry_run.py     `albert pretrain --dry-run`: prepare_run's plan, printed
- plan.py        what the driver decides (make_plan): vocabulary, shard files, PJRT runtime, the frozen WorkerPlan
- worker.py      the loop each worker runs (resume, input, step, after-step hooks)
- data.py        a worker's input: its slice of each global batch in the run's example order, masked
- input.py       that input ahead of the loop: in a thread, or in input processes (train.input_workers)
- follow.py      the data stream over a shard set that grows (data.follow)
- step.py        one training step in plain torch (no Ray): masking, accumulation, all-reduce, clip, update
- backends.py    step backends (eager CPU/CUDA, XLA) behind one interface; xla.py holds the XLA primitives
- record.py      where rank 0 keeps the run's record (the coordinator, or a ledger of its own)
- state.py       training checkpoints: model, optimizer, scheduler, data position, RNG, in plain files
"""
