"""The forward-pass runtime: KV caches, feeds, the prefix cache, attention, compiled passes
and torch's thread count. It knows models and tensors, never a call or a batch.
"""
