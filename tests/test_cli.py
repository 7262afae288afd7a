"""The command line: info, a tiny demo, and bench without a GPU."""

import pytest
import torch

from dsv4_compressor.cli import NO_CUDA, main


def test_info(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "triton" in out
    for text in ("hca", "csa", "indexer", "1,728", "37,440", "540,672"):
        assert text in out


def test_demo_tiny(capsys):
    argv = ["demo", "--backend", "reference", "--device", "cpu", "--requests", "2", "--max-prompt", "200"]
    assert main(argv + ["--decode-steps", "4", "--kinds", "csa,indexer", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "entries verified" in out and "hca " not in out


def test_demo_rejects_unknown_kind(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--kinds", "hca,mla"])
    assert exc.value.code == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_bench_without_cuda(capsys):
    assert main(["bench", "--anything", "goes"]) == 2
    assert NO_CUDA in capsys.readouterr().err


def test_bench_module_missing(monkeypatch, capsys):
    from dsv4_compressor import cli

    def missing(name):
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    monkeypatch.setattr(cli, "_cuda_available", lambda: True)
    monkeypatch.setattr(cli.importlib, "import_module", missing)
    assert main(["bench"]) == 2
    assert "bench: not available in this build" in capsys.readouterr().err


def test_demo_backend_missing(monkeypatch, capsys):
    from dsv4_compressor import cli

    monkeypatch.setitem(cli.BACKEND_MODULES, "online", "dsv4_compressor.backends.not_there")
    assert main(["demo", "--backend", "online", "--device", "cpu", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "backend 'online' is not available in this build" in err and "--backend reference" in err


def test_info_memory_table_matches_the_cache(capsys):
    """``info``'s memory table is what a cache of that configuration allocates (``cache.memory_bytes()``)."""
    import dsv4_compressor as dc
    from dsv4_compressor.cli import main

    assert main(["info", "--max-requests", "3", "--max-seq-len", "1024", "--mtp-step", "1"]) == 0
    lines = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines() if line.strip()}
    for kind, cfg in (("hca", dc.CompressorConfig.hca()), ("csa", dc.CompressorConfig.csa())):
        params = dc.CompressorParams.random(cfg, max_positions=1024)
        cache = dc.CompressedKVCache(cfg, params, max_requests=3, max_seq_len=1024, mtp_step=1)
        mem = cache.memory_bytes()
        assert int(lines[kind][2].replace(",", "")) == mem["pool"], lines[kind]
        assert int(lines[kind][3].replace(",", "")) == mem["state"], lines[kind]


def test_info_says_where_the_triton_backends_can_run(capsys):
    """On a CPU the Triton backends import but run only under the interpreter; ``info`` says so, not ``ok``."""
    from dsv4_compressor.cli import backend_summary

    assert backend_summary("reference", cuda=False, interpreting=False) == "ok"
    for name in ("triton", "online"):
        off = backend_summary(name, cuda=False, interpreting=False)
        assert "no GPU" in off and "TRITON_INTERPRET=1" in off and not off.startswith("ok")
        assert "interpreter" in backend_summary(name, cuda=False, interpreting=True)
        assert backend_summary(name, cuda=True, interpreting=False) == "ok"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what info says without a GPU")
def test_info_without_the_interpreter_says_no_kernel_runs_here():
    """``dsv4-compressor info`` as a user runs it on a CPU (``TRITON_INTERPRET`` unset)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "dsv4_compressor", "info"], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    lines = {line.split(":")[0].strip(): line for line in out.stdout.splitlines() if line.startswith("  ")}
    assert lines["reference"].endswith(": ok")
    for name in ("triton", "online"):
        assert "no GPU: its kernels run only under TRITON_INTERPRET=1" in lines[name], out.stdout


def test_demo_on_cpu_reruns_itself_under_the_interpreter(monkeypatch, capsys):
    """Triton's own ``@jit`` helpers are decorated when triton is imported, so turning the interpreter on later
    is too late: the demo reruns its command line in a child with ``TRITON_INTERPRET=1`` (the README test runs the
    real thing)."""
    from dsv4_compressor import cli

    calls = []
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(cli, "_rerun_under_interpreter", lambda argv: calls.append(argv) or 7)
    argv = ["demo", "--backend", "online", "--device", "cpu", "--requests", "1", "--no-progress"]
    assert main(argv) == 7
    assert calls == [argv]
    assert "TRITON_INTERPRET=1" in capsys.readouterr().out
