"""From token ids to training batches: what an example looks like (`shape`, declared once), SOP/NSP pairs (`pairs`),
the Parquet shard format (`shards`), the run's seeded example order for exact resume on any worker count (`order`),
the n-gram masks (`masking`, their definition, a batch at once; `draws`, the counter-based generator keyed per example
it draws from) and model batches (`batch`)."""
