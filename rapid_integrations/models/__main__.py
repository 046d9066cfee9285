"""`python -m rapid_integrations.models`: convert the embedded SmolLM2 once and print its path."""

from rapid_integrations.models.loading import ensure_default_model

print(ensure_default_model())
