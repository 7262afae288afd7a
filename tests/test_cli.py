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
