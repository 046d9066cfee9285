"""What a call returns: outputs and stats, stream deltas, and log probabilities."""
