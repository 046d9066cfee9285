"""Turn benchmark records into results.json, a Markdown report and PNG plots.

Everything here reads plain record dicts (the `records` of results.json), so a report can be
rebuilt from a saved run: `write_report(out, meta, json.load(...)["records"])`. Aggregation is
in `summary`, the judged figures in `figures`, the Markdown in `tables`, the plots in `plots`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .figures import speed_figures
from .plots import write_plots
from .summary import Record, accuracy_cells, summarize
from .tables import markdown

SCHEMA_VERSION = 1


def write_report(out: Path, meta: dict[str, Any], records: list[Record], plots: bool) -> None:
    """Write results.json and results.md under `out` (and the plots when `plots`)."""
    out.mkdir(parents=True, exist_ok=True)
    summary, cells = summarize(records), accuracy_cells(records)
    figures = speed_figures(records, summary, meta)
    written = write_plots(out, records, summary) if plots else []
    payload = {
        "schema_version": SCHEMA_VERSION,
        **meta,
        "summary": summary,
        "accuracy_cells": cells,
        "speed_figures": figures,
        "records": records,
    }
    (out / "results.json").write_text(json.dumps(payload, indent=1) + "\n")
    (out / "results.md").write_text(markdown(meta, summary, figures, written, cells))
