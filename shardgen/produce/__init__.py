"""Making shards: run the generator per date, cut windows, write a date's shard files, build many dates in parallel."""
