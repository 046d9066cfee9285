"""Sampling and verification: the retrieval-augmented target p_hat, and keep or resample."""
