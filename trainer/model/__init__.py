"""The model: the GPT, the Hugging Face families, weights to start from, and how a model is cut into pipeline stages."""
