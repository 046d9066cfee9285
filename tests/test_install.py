"""Installing beside the Hugging Face integrations users migrate from.

langchain-huggingface caps huggingface-hub below 2. Where pip may pick hub 2.x, it falls back
to langchain-huggingface 0.3 and quietly downgrades langchain-core to 0.3 (seen with
`pip install langchain-huggingface "huggingface-hub>=2"`). The `huggingface` extra pins the
set so that it resolves with langchain-core 1.x. Resolving needs PyPI: skipped without it.
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent


def _pypi_unreachable() -> str | None:
    """Why PyPI cannot be asked, or None when it answers."""
    try:
        urllib.request.urlopen("https://pypi.org/simple/langchain-huggingface/", timeout=10)
    except (urllib.error.URLError, OSError) as exc:
        return f"PyPI is unreachable ({exc}): the install set cannot be resolved here"
    return None


def dry_run(*requirements: str, report: Path) -> subprocess.CompletedProcess[str]:
    """`pip install --dry-run` of `requirements` here, its report written to `report`."""
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet"]
    command += ["--no-build-isolation", "--disable-pip-version-check", "--report", str(report)]
    return subprocess.run(
        [*command, *requirements], timeout=240, capture_output=True, text=True, check=False
    )


def resolve(*requirements: str, folder: Path) -> dict[str, Version]:
    """Versions `pip install` would use for `requirements` in this environment: those it would
    install (from its --dry-run report), else the installed ones it keeps."""
    report = folder / "report.json"
    done = dry_run(*requirements, report=report)
    assert done.returncode == 0, done.stderr
    versions = {}
    for item in json.loads(report.read_text())["install"]:
        meta = item["metadata"]
        versions[canonicalize_name(meta["name"])] = Version(meta["version"])
    for dist in importlib.metadata.distributions():
        versions.setdefault(canonicalize_name(dist.metadata["Name"]), Version(dist.version))
    return versions


@pytest.mark.slow
def test_the_huggingface_extra_keeps_langchain_core_1(tmp_path):
    if reason := _pypi_unreachable():
        pytest.skip(reason)
    versions = resolve(f"{ROOT}[huggingface]", folder=tmp_path)
    assert versions["langchain-core"] >= Version("1.0")
    assert versions["langchain-huggingface"] >= Version("1.0")
    assert versions["llama-index-core"] >= Version("0.14")
    assert "llama-index-llms-huggingface" in versions
    assert versions["huggingface-hub"] < Version("2")  # what langchain-huggingface 1.x needs
    # Where another package wants hub 2.x, pip now refuses instead of downgrading (without
    # the pins it resolves langchain-huggingface 0.3.1 with langchain-core 0.3).
    refused = dry_run(f"{ROOT}[huggingface]", "huggingface-hub>=2", report=tmp_path / "r2.json")
    assert refused.returncode != 0 and "ResolutionImpossible" in refused.stderr
