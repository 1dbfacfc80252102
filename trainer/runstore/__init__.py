"""A run's storage: the run directory, update records, which checkpoints are kept and how others are rebuilt, and garbage collection."""
