"""A quiet start: third-party log lines and progress bars nobody asked for, kept off stderr.

What is silenced, and how to see it again (docs/reliability.md, "A quiet start"):

* torch's `_pytree` deprecation warnings, logged while torchao registers its enums (transformers
  imports torchao with its models), and torchao's warnings for optional CUDA kernels it cannot
  load: shown again when the `rapid_integrations` logger is enabled for DEBUG.
* transformers' "Loading weights" bars while a model loads: shown again when the
  `rapid_integrations` logger is enabled for INFO, inside `loading_bars(True)`, and by
  `rapid ask/chat/serve --model ...` (a load a user waits for; `--no-progress` hides them).
  The embedded model's one-time conversion (models.py) shows its bar: a real wait.

Everything here is scoped to one logger name or one `with` block, never a global switch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

LOGGER = "rapid_integrations"
"""The package's logger: its level decides what third-party output is let through."""

_NOISE = {
    "torch.utils._pytree": "is an Enum subclass and is now natively supported",
    "torchao": "Failed to load",
}
"""Logger name -> a fragment of the records dropped from it (each one kind of message)."""


class _ThirdPartyNoise(logging.Filter):
    """Drops the records of one library that contain `fragment`, unless DEBUG was asked for."""

    def __init__(self, fragment: str) -> None:
        super().__init__()
        self.fragment = fragment

    def filter(self, record: logging.LogRecord) -> bool:
        if logging.getLogger(LOGGER).isEnabledFor(logging.DEBUG):
            return True
        return self.fragment not in record.getMessage()


def install() -> None:
    """Attach the filters; called once when the package is imported (imports nothing heavy)."""
    for name, fragment in _NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _ThirdPartyNoise) for f in logger.filters):
            logger.addFilter(_ThirdPartyNoise(fragment))
    # torchao logs through its own logger without a handler; with ours, Python does not fall back
    # to printing its other records on stderr, while an application's logging config sees them.
    torchao = logging.getLogger("torchao")
    if not any(isinstance(h, logging.NullHandler) for h in torchao.handlers):
        torchao.addHandler(logging.NullHandler())


_bars_asked: ContextVar[bool | None] = ContextVar("rapid_loading_bars", default=None)
"""What the innermost `loading_bars(True/False)` block asked for; None outside any."""


@contextmanager
def loading_bars(show: bool | None = None) -> Iterator[None]:
    """transformers' progress bars on (`show=True`) or off for the block, restored after it.

    `show=None`: what an enclosing block asked for, else on only when the `rapid_integrations`
    logger is enabled for INFO. The CLI asks for bars where a user waits for a named model."""
    from transformers.utils import logging as hf_logging

    if show is None:
        asked = _bars_asked.get()
        show = logging.getLogger(LOGGER).isEnabledFor(logging.INFO) if asked is None else asked
    before = hf_logging.is_progress_bar_enabled()
    token = _bars_asked.set(show)
    (hf_logging.enable_progress_bar if show else hf_logging.disable_progress_bar)()
    try:
        yield
    finally:
        _bars_asked.reset(token)
        (hf_logging.enable_progress_bar if before else hf_logging.disable_progress_bar)()
