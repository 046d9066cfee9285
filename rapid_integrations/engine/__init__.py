"""The engine: `RapidEngine`, a call's options, and the draft prompt it builds from C^S.

Everything a call passes through before and after the speculation loop lives here; the
loop's parts are in `spec_decode`, `sample` and `runtime` (docs/architecture.md).
"""
