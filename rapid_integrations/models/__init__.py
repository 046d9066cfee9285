"""Model loading: the embedded SmolLM2 and MiniLM packages, conversion, and weight-only copies.

`load_default`, `ensure_default_model` and `default_embedder_path` are the public loaders.
"""
