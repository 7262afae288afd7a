"""The docs say what is true: references resolve inside the repository, the README's headline figures are the
ones of docs/PERF.md's run, and the engine switches the README and docs/INTEGRATION.md name behave as written."""

from __future__ import annotations

import importlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the test environments run 3.11
    tomllib = None


def _git_grep(pattern: str) -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout")
    out = subprocess.run(
        ["git", "grep", "-n", "-P", pattern], cwd=ROOT, capture_output=True, text=True, check=False
    )  # fmt: skip
    assert out.returncode in (0, 1), out.stderr
    return out.stdout.splitlines()


def test_no_reference_to_documents_outside_the_repository():
    """The specification and the engine facts are docs/SPEC.md and docs/INTEGRATION.md. A tracked file may name
    ``SPEC.md`` only as ``docs/SPEC.md`` (or, inside docs/, as a sibling), and nothing names ``ENGINES.md``
    (the notes it came from are not shipped)."""
    hits = _git_grep(r"ENGINES\.md|(?<!docs/)\bSPEC\.md")
    this = Path(__file__).relative_to(ROOT).as_posix()
    bad = []
    for hit in hits:
        path, _, text = hit.split(":", 2)
        if path == this:
            continue
        if "ENGINES.md" in text or not path.startswith("docs/") or re.search(r"\.\./[\w./]*SPEC\.md", text):
            bad.append(hit)
    assert not bad, "references to documents outside the repository:\n" + "\n".join(bad)


def test_spec_keeps_the_section_numbers_the_code_cites():
    spec = (ROOT / "docs" / "SPEC.md").read_text()
    numbers = [int(n) for n in re.findall(r"^## (\d+)\. ", spec, flags=re.M)]
    assert numbers == list(range(1, 10)), numbers
    cited = {int(n) for n in _cited_sections()}
    assert cited <= set(numbers), cited - set(numbers)


def _cited_sections() -> list[str]:
    out = []
    for hit in _git_grep(r"SPEC (?:section|sections|s\.) ?\d"):
        out += re.findall(r"SPEC (?:section|sections|s\.) ?(\d+)", hit.split(":", 2)[2])
    return out


def _perf_commit() -> str:
    match = re.search(r"^- Commit: `([0-9a-f]+)`", (ROOT / "docs" / "PERF.md").read_text(), flags=re.M)
    assert match, "docs/PERF.md names no commit"
    return match.group(1)


def test_readme_headline_figures_are_perf_md_s():
    """The README's performance section cites docs/PERF.md's run, and every figure in it is on that page."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Backends and performance") :]
    section = section[: section.index("\n## ", 1)]
    commits = re.findall(r"commit ([0-9a-f]{7,40})", section)
    assert commits and all(c.startswith(_perf_commit()[:7]) for c in commits), (commits, _perf_commit())
    perf = (ROOT / "docs" / "PERF.md").read_text().replace(",", "")
    figures = set(re.findall(r"(?<![\w.])\d+\.\d+(?![\w.])", section))
    assert len(figures) > 20, figures
    missing = sorted(f for f in figures if not re.search(rf"(?<![\d.]){re.escape(f)}(?![\d])", perf))
    assert not missing, f"README figures not in docs/PERF.md: {missing}"


# ----------------------------------------------------------------------------------------------------------------
# The engine switches, through the entry points this package declares
# ----------------------------------------------------------------------------------------------------------------
def _entry_point(group: str):
    if tomllib is None:
        pytest.skip("needs tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    target = project["entry-points"][group]["dsv4_compressor"]
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def _recording(monkeypatch, module: str) -> list[dict]:
    calls: list[dict] = []
    monkeypatch.setattr(importlib.import_module(module), "install", lambda **kw: calls.append(kw) or "installed")
    return calls


def test_vllm_switch_is_as_documented(monkeypatch):
    """``VLLM_DSV4C`` (alias ``DSV4C_VLLM``): unset or ``off`` does nothing, ``tiled`` installs, ``online``
    installs the online HCA banks (README, docs/INTEGRATION.md)."""
    register = _entry_point("vllm.general_plugins")
    calls = _recording(monkeypatch, "dsv4_compressor.integrations.vllm.patching")
    for name in ("VLLM_DSV4C", "DSV4C_VLLM"):
        monkeypatch.delenv(name, raising=False)
    assert register() is None and calls == []
    for name in ("VLLM_DSV4C", "DSV4C_VLLM"):
        monkeypatch.setenv(name, "off")
        assert register() is None and calls == []
        monkeypatch.setenv(name, "tiled")
        register()
        assert calls.pop() == {"hca": "tiled"}
        monkeypatch.setenv(name, "online")
        register()
        assert calls.pop() == {"hca": "online"}
        monkeypatch.delenv(name)


def test_sglang_switch_is_as_documented(monkeypatch):
    """``DSV4C_SGLANG``: unset or ``off`` does nothing, ``ring`` / ``single`` / ``online`` install;
    ``DSV4C_SGLANG_PROJECTION=engine`` keeps SGLang's GEMM."""
    register = _entry_point("sglang.srt.plugins")
    calls = _recording(monkeypatch, "dsv4_compressor.integrations.sglang.patching")
    monkeypatch.delenv("DSV4C_SGLANG", raising=False)
    monkeypatch.delenv("DSV4C_SGLANG_PROJECTION", raising=False)
    register()
    monkeypatch.setenv("DSV4C_SGLANG", "off")
    register()
    assert calls == []
    monkeypatch.setenv("DSV4C_SGLANG", "ring")
    register()
    assert calls.pop() == {"hca_kernel": "tiled", "projection": "auto"}
    monkeypatch.setenv("DSV4C_SGLANG", "single")
    monkeypatch.setenv("DSV4C_SGLANG_PROJECTION", "engine")
    register()
    assert calls.pop() == {"hca_kernel": "single", "projection": "engine"}
    monkeypatch.setenv("DSV4C_SGLANG", "online")
    monkeypatch.delenv("DSV4C_SGLANG_PROJECTION")
    register()
    assert calls.pop() == {"hca": "online", "hca_kernel": "tiled", "projection": "auto"}


def test_lightllm_launcher_modes_are_as_documented():
    """``--dsv4c`` takes tiled, single, online, off and defaults to ``$DSV4C_LIGHTLLM``, else tiled."""
    from dsv4_compressor.integrations import lightllm

    assert set(lightllm.MODES) | {lightllm.OFF} == {"tiled", "single", "online", "off"}
    assert lightllm.ENV_VAR == "DSV4C_LIGHTLLM" and lightllm.PROJECTION_ENV == "DSV4C_LIGHTLLM_PROJECTION"
    integration = (ROOT / "docs" / "INTEGRATION.md").read_text()
    assert "`--dsv4c` (default `$DSV4C_LIGHTLLM`, else `tiled`)" in integration


def test_relative_links_of_the_docs_resolve():
    """Every relative link of README.md and docs/*.md names a file or folder of the tree (runs pruned from
    docs/runs must not stay linked)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    bad = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+://|#|mailto:", target):
                continue
            path = (page.parent / target.split("#", 1)[0]).resolve()
            if not path.exists():
                bad.append(f"{page.relative_to(ROOT)}: {target}")
    assert not bad, "links to nothing:\n" + "\n".join(bad)
