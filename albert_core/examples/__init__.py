"""From token ids to training batches: what an example looks like (`shape`, declared once), SOP/NSP pairs (`pairs`),
the Parquet shard format (`shards`), the run's seeded example order for exact resume on any worker count (`order`),
the n-gram masks (`masking`, the per-row definition; `masking_batch`, the batch masker; `pcg64`, the generator they
share) and model batches (`batch`)."""
