"""The README's (and docs/INTEGRATION.md's) commands, as written.

Every command line of their ``bash`` blocks is either run here (the ``dsv4-compressor`` commands a CPU can
run: through the installed console script, with ``TRITON_INTERPRET`` unset as a user's shell has it) or checked
for what can be checked without a GPU or an engine (a make target exists, a script or module exists, an
environment switch is one the package reads). A command the test cannot place fails it, so a new README command
gets a check with it.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dsv4_compressor

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: The pages whose ``bash`` blocks this test follows.
PAGES = (README, ROOT / "docs" / "INTEGRATION.md")
SRC = Path(dsv4_compressor.__file__).resolve().parents[1]

#: Programs the README starts that belong to an engine (checked for their switches, not run).
ENGINE_PROGRAMS = ("vllm", "python -m sglang.launch_server")
#: ``dsv4-compressor`` subcommands that need a GPU (checked to exist, not run).
GPU_ONLY = ("bench",)
#: Switches the README may set that belong to tools, not to the adapters.
TOOL_VARIABLES = {"DSV4_COMMIT", "TRITON_INTERPRET", "DSV4_PDL", "OUT"}


def readme_commands(page: Path = README) -> list[str]:
    """The command lines of a page's ``bash`` blocks, comments stripped."""
    text = page.read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            if words:
                commands.append(shlex.join(words))
    return commands


def _split_env(words: list[str]) -> tuple[dict[str, str], list[str]]:
    env = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        name, value = words[0].split("=", 1)
        env[name] = value
        words = words[1:]
    return env, words


def _package_literals() -> str:
    return "\n".join(p.read_text() for p in (SRC / "dsv4_compressor").rglob("*.py"))


def _console_script() -> list[str]:
    script = Path(sys.executable).parent / "dsv4-compressor"
    return [str(script)] if script.exists() else [sys.executable, "-m", "dsv4_compressor"]


def _user_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


COMMANDS = readme_commands()
ALL_COMMANDS = list(dict.fromkeys(c for page in PAGES for c in readme_commands(page)))


def test_readme_has_the_commands_this_test_follows():
    cli = [c for c in COMMANDS if c.startswith("dsv4-compressor ")]
    assert any(c.startswith("dsv4-compressor demo --backend triton") for c in cli), COMMANDS
    assert any(c.startswith("dsv4-compressor demo --backend online") for c in cli), COMMANDS
    assert any(c == "dsv4-compressor info" for c in cli), COMMANDS


def test_readme_is_under_250_lines():
    assert len(README.read_text().splitlines()) < 250


@pytest.mark.parametrize("command", ALL_COMMANDS)
def test_readme_command(command):
    env, words = _split_env(shlex.split(command))
    literals = _package_literals()
    for name in env:
        # a switch the README tells users to set is one the package (or a tool) reads, by that exact name
        assert name in TOOL_VARIABLES or f'"{name}"' in literals, f"{name} is read nowhere in the package"
    line = shlex.join(words)

    if words[0] == "make":
        makefile = (ROOT / "Makefile").read_text()
        for target in words[1:]:
            assert re.search(rf"^{re.escape(target)}:", makefile, flags=re.M), f"no make target {target!r}"
        return
    if words[0] == "bash" or (words[0] == "python" and words[1].startswith("scripts/")):
        assert (ROOT / words[1]).is_file(), f"{words[1]} does not exist"
        return
    if words[:2] == ["python", "-m"] and words[2].startswith("dsv4_compressor."):
        assert importlib.util.find_spec(words[2]) is not None, f"no module {words[2]}"
        if words[2] == "dsv4_compressor.integrations.lightllm" and "--dsv4c" in words:
            from dsv4_compressor.integrations import lightllm

            assert words[words.index("--dsv4c") + 1] in (*lightllm.MODES, lightllm.OFF)
        return
    if any(line.startswith(program + " ") for program in ENGINE_PROGRAMS):
        assert env, f"an engine command without the adapter's switch: {command!r}"
        return
    assert words[0] == "dsv4-compressor", f"the README test does not know how to check {command!r}"

    if words[1] in GPU_ONLY and "--dry-run" not in words and "--help" not in words:
        pytest.skip(f"{command!r} needs a CUDA GPU")
    if words[1] == "demo" and "--help" not in words and torch.cuda.is_available():
        pytest.skip("a CPU command: on a GPU machine the demo runs compiled kernels instead")
    out = subprocess.run(
        _console_script() + words[1:], env={**_user_env(), **env}, cwd=ROOT, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, f"{command!r} exited {out.returncode}:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
    if words[1] == "demo" and "--help" not in words:
        assert re.search(r"^all \d+ entries verified$", out.stdout, flags=re.M), out.stdout[-2000:]
    if words[1] == "info":
        assert "backends:" in out.stdout and "dsv4-compressor" in out.stdout
