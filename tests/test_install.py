"""Installing: the import paths users expect, the pinned test suites, and the Hugging Face
integrations users migrate from.

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
from packaging.requirements import Requirement
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


def test_llamaindex_import_path_works_from_the_installed_distribution(tmp_path):
    """`from llama_index.llms.rapid import RapidLLM`, as LlamaIndex's integrations are imported,
    beside `llamaindex_rapid`, in a fresh interpreter outside the checkout (-I: no current
    folder on the path), so only the installed distribution can provide it; the namespace
    keeps the other integrations importable."""
    code = (
        "from llama_index.llms.rapid import RapidLLM, RapidRetrieverAdapter\n"
        "import llamaindex_rapid, llama_index.core, llama_index.llms.openai_like\n"
        "assert RapidLLM is llamaindex_rapid.RapidLLM\n"
        "assert RapidRetrieverAdapter is llamaindex_rapid.RapidRetrieverAdapter\n"
    )
    done = subprocess.run(
        [sys.executable, "-I", "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr


def test_langchain_tests_is_pinned_to_the_installed_minor_release():
    """The standard suites change between minor releases (new tests, new properties), so the
    dev extra pins the minor release they pass with, and the installed one is in it."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with (ROOT / "pyproject.toml").open("rb") as file:
        dev = tomllib.load(file)["project"]["optional-dependencies"]["dev"]
    [pin] = [r for r in map(Requirement, dev) if canonicalize_name(r.name) == "langchain-tests"]
    installed = Version(importlib.metadata.version("langchain-tests"))
    assert installed in pin.specifier
    assert Version(f"{installed.major}.{installed.minor + 1}") not in pin.specifier
