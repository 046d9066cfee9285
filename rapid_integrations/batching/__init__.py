"""Continuous batching: many calls' feeds packed into one pass, and the worker that steps them."""
