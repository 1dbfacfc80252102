"""TEE evidence providers and signed round reports (arrives with the trust-path issue)."""
