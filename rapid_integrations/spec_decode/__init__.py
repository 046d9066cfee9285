"""Speculation: the proposers that draft, and the gamma schedules that size each draft."""
