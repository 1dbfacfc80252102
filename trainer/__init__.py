"""DiLoCo training: model, data, the dual optimiser, aggregation, and the coordinator/worker processes."""
