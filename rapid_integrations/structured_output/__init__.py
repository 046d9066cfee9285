"""Structured output: grammars, tools, the reasoning and answer sections, and their masks."""
