"""A run's folder as the tools after training see it: the facts it records, loading its checkpoints,
the lock that keeps two runs out of one folder, the checkpoint manifest."""
