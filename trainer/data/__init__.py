"""The data: the byte corpus, tokenizers, prepared token directories, a run's dataset and its held-out evaluation."""
