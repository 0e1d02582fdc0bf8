"""Fine-tuning: its config (`config`), the training loop with task heads, seeds and ensembles (`finetuning`), and
the downstream tasks' readers and features (`tasks`: GLUE, SQuAD, RACE, the user's own tables)."""
