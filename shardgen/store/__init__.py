"""A store: its file names, manifest and snapshots, publishing, the writer's locks, reader leases,
gc, verify and status."""
