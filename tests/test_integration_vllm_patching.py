"""The vLLM adapter's ``install()`` / ``uninstall()`` / ``register()`` (``integrations/vllm/patching.py``) on the
stand-ins of vLLM's classes of ``tests/test_integration_vllm.py`` (written from vLLM 0.33's code; its
:class:`~test_integration_vllm.VllmWorld` for the layers install() does not cover), CPU.

What runs here: importing the adapter imports no vLLM; ``install()`` without vLLM is a clear ``ImportError``;
``register()`` (the ``vllm.general_plugins`` hook) is inert unless ``$VLLM_DSV4C`` opts in, and installs when it
does; ``install(hca="online")`` checks what vLLM must provide and the block size; install() patches the
builder and the forward, a second install replaces the first, uninstall() restores vLLM's own; the layers the
adapter does not cover (an MXFP4 indexer cache, a non-uint8 k cache, a builder not patched) keep vLLM's forward.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch
from test_integration_vllm import (
    POISON,
    POISON_F32,
    AttentionCGSupport,
    CompressorMetadata,
    VllmWorld,
    make_vllm,
    vllm_config,
)

from dsv4_compressor.errors import OpError
from dsv4_compressor.integrations import vllm as dsv4_vllm


def test_importing_the_adapter_does_not_import_vllm():
    import subprocess

    code = "import sys, dsv4_compressor.integrations.vllm; assert 'vllm' not in sys.modules, 'vllm imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_install_without_vllm_raises_a_clear_error(monkeypatch):
    """(Runs whether or not vLLM is installed: the module list points at modules that do not exist.)"""
    missing = ("vllm_missing_for_test.models.deepseek_v4.compressor",)
    monkeypatch.setattr(dsv4_vllm.patching, "COMPRESSOR_MODULES", missing)
    with pytest.raises(dsv4_vllm.VllmNotAvailableError, match="vllm_missing_for_test.models.deepseek_v4"):
        dsv4_vllm.install()
    with pytest.raises(ImportError):  # it is an ImportError, for callers that probe
        dsv4_vllm.install()


def _clear_env(monkeypatch):
    for name in (dsv4_vllm.ENV_VAR, dsv4_vllm.ENV_VAR_ALIAS):
        monkeypatch.delenv(name, raising=False)


def test_register_is_inert_unless_opted_in(monkeypatch):
    """``register()`` (vLLM's ``vllm.general_plugins`` hook, called unguarded in every process for every model)
    does nothing, and imports nothing, with ``$VLLM_DSV4C`` unset, empty or ``off``."""
    _clear_env(monkeypatch)

    def no_import():
        raise AssertionError("register() imported vLLM without the opt-in")

    monkeypatch.setattr(dsv4_vllm.patching, "_import_vllm", no_import)
    assert dsv4_vllm.register() is None
    for value in ("", "off", " OFF "):
        monkeypatch.setenv(dsv4_vllm.ENV_VAR, value)
        assert dsv4_vllm.register() is None
    monkeypatch.setenv(dsv4_vllm.ENV_VAR_ALIAS, "tiled")  # the alias counts only when VLLM_DSV4C is unset
    assert dsv4_vllm.register() is None


def test_register_opted_in(monkeypatch):
    """Opted in (``VLLM_DSV4C=tiled``, VLLM_-prefixed so vLLM forwards it to Ray workers, or the old
    ``DSV4C_VLLM``) it installs, ``online`` too; a setup it cannot serve is a clear error: a bad value, no
    vLLM."""
    _clear_env(monkeypatch)
    assert dsv4_vllm.ENV_VAR.startswith("VLLM_")
    monkeypatch.setenv(dsv4_vllm.ENV_VAR, "fast")
    with pytest.raises(ValueError, match="VLLM_DSV4C"):
        dsv4_vllm.register()
    monkeypatch.setenv(dsv4_vllm.ENV_VAR, "tiled")
    monkeypatch.setattr(dsv4_vllm.patching, "COMPRESSOR_MODULES", ("vllm_missing_for_test.compressor",))
    with pytest.raises(dsv4_vllm.VllmNotAvailableError):
        dsv4_vllm.register()
    fake = make_vllm()
    found = (fake.DeepseekCompressor, fake.CompressorMetadataBuilder, lambda: None)
    monkeypatch.setattr(dsv4_vllm.patching, "_import_vllm", lambda: found)
    for name in (dsv4_vllm.ENV_VAR, dsv4_vllm.ENV_VAR_ALIAS):
        _clear_env(monkeypatch)
        for hca in ("tiled", "online"):
            monkeypatch.setenv(name, hca)
            installation = dsv4_vllm.register()
            try:
                assert installation.hca == hca and fake.DeepseekCompressor.forward.__wrapped__ is not None
            finally:
                installation.uninstall()


def test_online_on_vllms_classes_is_checked_at_install(monkeypatch):
    """``install(hca="online")`` on classes from vLLM's module (or given a ``VllmConfig``) checks what vLLM must
    provide (a vLLM without ``CircularBufferSpec`` is refused, the case of this module's environments without
    vLLM) and refuses a config whose block size is not a multiple of 128 (nothing patched); a patched builder
    refuses a C128 state group that is still a sliding window (its state cache built before install), before
    any forward."""
    from dsv4_compressor.integrations.vllm import online as vllm_online

    fake = make_vllm()
    ctx = SimpleNamespace(attn_metadata=None)
    kwargs = dict(compressor_cls=fake.DeepseekCompressor, builder_cls=fake.CompressorMetadataBuilder)
    bad = SimpleNamespace(scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False),
                          cache_config=SimpleNamespace(block_size=64))  # fmt: skip
    good = SimpleNamespace(scheduler_config=bad.scheduler_config, cache_config=SimpleNamespace(block_size=256))
    monkeypatch.setattr(vllm_online, "circular_buffer_spec_cls", lambda: None)
    with pytest.raises(dsv4_vllm.VllmModeNotSupported, match="no CircularBufferSpec"):
        dsv4_vllm.install(hca="online", get_forward_context=lambda: ctx, vllm_config=good, **kwargs)
    assert "_dsv4c_installation" not in vars(fake.DeepseekCompressor)
    monkeypatch.setattr(vllm_online, "circular_buffer_spec_cls", lambda: object)  # a vLLM that has one
    with pytest.raises(dsv4_vllm.VllmModeNotSupported, match="block size 64 is not a multiple of 128"):
        dsv4_vllm.install(hca="online", get_forward_context=lambda: ctx, vllm_config=bad, **kwargs)
    assert "_dsv4c_installation" not in vars(fake.DeepseekCompressor)
    with dsv4_vllm.install(hca="online", get_forward_context=lambda: ctx, **kwargs):
        spec = SimpleNamespace(block_size=8, sliding_window=128)
        with pytest.raises(OpError, match="sliding_window=128"):
            fake.CompressorMetadataBuilder(spec, ["x"], vllm_config(), "cpu")


def test_install_patches_and_uninstall_restores():
    fake = make_vllm()
    cls, builder = fake.DeepseekCompressor, fake.CompressorMetadataBuilder
    originals = (cls.forward, builder.__init__, builder.build)
    compressor_init = cls.__init__
    ctx = SimpleNamespace(attn_metadata=None)
    kwargs = dict(compressor_cls=cls, builder_cls=builder, get_forward_context=lambda: ctx)
    with pytest.raises(ValueError, match="hca"):
        dsv4_vllm.install(hca="fast", **kwargs)
    first = dsv4_vllm.install(**kwargs)
    assert (cls.forward.__wrapped__, builder.__init__.__wrapped__, builder.build.__wrapped__) == originals
    assert builder._cudagraph_support is AttentionCGSupport.ALWAYS
    second = dsv4_vllm.install(hca="online", **kwargs)  # replaces the first, does not stack on it
    assert cls.forward.__wrapped__ is originals[0] and second.hca == "online"
    layer = cls(prefix="x")
    assert layer.forward(torch.zeros(1, 8), torch.zeros(1), None) is None  # profiling run: no attn_metadata dict
    assert layer.original_calls == 0
    second.uninstall()
    assert (cls.forward, builder.__init__, builder.build) == originals
    assert "_dsv4c_installation" not in vars(cls) and first.hca == "tiled" and cls.__init__ is compressor_init
    with dsv4_vllm.install(**kwargs):
        assert cls.forward is not originals[0]
    assert cls.forward is originals[0]


def test_uncovered_layers_keep_vllms_forward():
    """An MXFP4 indexer cache, a non-uint8 k cache and a builder that was not patched run vLLM's own forward."""
    world = VllmWorld("indexer", seed=9)
    layer = world.layers[0]
    try:
        world.begin("A")
        layer.module.use_fp4_cache = True
        world.step([("A", 0, 5)], vllm_forward=True)
        layer.module.use_fp4_cache = False
        plain = layer.kv_cache.view(torch.int8)  # e.g. a plain full-cache layout: not the uint8 one
        layer.module._static_forward_context[world.k_cache_prefix].kv_cache = plain
        layer.module.original_calls = 0
        world.step([("A", 5, 3)], vllm_forward=True)
    finally:
        world.installation.uninstall()
    assert (layer.kv_memory == POISON).all() and (layer.state_memory.view(torch.int32) == POISON_F32).all()
    with pytest.raises(OpError, match="not patched"):
        metadata = CompressorMetadata(torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1), 4)
        dsv4_vllm.compressor_forward(
            layer.module, torch.zeros(1, world.width), torch.zeros(1), layer.rotary_emb,
            attn_metadata={world.state_prefix: metadata},
        )  # fmt: skip
