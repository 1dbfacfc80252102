"""The process runtime of a worker: devices, local process groups, pipeline stages, and giving memory back."""
