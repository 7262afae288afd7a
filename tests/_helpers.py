"""Shared test helpers: small configs, random parameters and rows, and a model of the streaming invariant.

The model (:class:`StreamModel`) keeps, per request, the rows most recently supplied for positions ``0..L-1``
(SPEC section 5) and computes the expected entries one-shot in float64 with ``reference.compress_sequence``.
:func:`check_cache_against_model` compares a cache's stored bytes to those values with
:mod:`dsv4_compressor.verify`, which accepts only rounding-boundary differences.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import torch

from dsv4_compressor import reference
from dsv4_compressor.cache import CompressedKVCache
from dsv4_compressor.config import INDEXER, CompressorConfig, CompressorParams
from dsv4_compressor.layout import decode_latent
from dsv4_compressor.verify import check_indexer_fp8, check_indexer_keys, check_latent_records

HCA_SMALL = CompressorConfig(ratio=8, head_dim=128, rope_dim=64, overlap=False, name="hca_small")
CSA_SMALL = CompressorConfig(ratio=4, head_dim=128, rope_dim=64, overlap=True, name="csa_small")
INDEXER_CFG = CompressorConfig.indexer()  # the real one: r=4, H=128, FP8 pack on

#: The three small kinds every streaming test runs on.
SMALL_KINDS = {"hca_small": HCA_SMALL, "csa_small": CSA_SMALL, "indexer": INDEXER_CFG}

STREAMING_BACKENDS = ["reference", "triton", "online"]


def backend_missing(name: str) -> str | None:
    """Why backend ``name`` cannot run here (its module does not exist yet), or ``None``."""
    if name == "reference":
        return None
    if importlib.util.find_spec(f"dsv4_compressor.backends.{name}") is None:
        return f"backend {name!r}: module dsv4_compressor.backends.{name} does not exist yet"
    return None


def make_params(cfg: CompressorConfig, seed: int = 0, max_positions: int = 256, **kwargs) -> CompressorParams:
    """Random realistic parameters (ape ~ N(0, 0.5), norm weight ~ 1 + N(0, 0.1), DeepSeek YaRN tables)."""
    return CompressorParams.random(cfg, max_positions=max_positions, seed=seed, **kwargs)


def random_rows(n: int, cfg: CompressorConfig, gen: torch.Generator) -> torch.Tensor:
    """Fresh float32 ``[n, 2W]`` rows: values ~ N(0, 1), gate logits ~ N(0, 1.5^2) (peaked softmaxes)."""
    kv = torch.randn(n, cfg.width, generator=gen)
    score = 1.5 * torch.randn(n, cfg.width, generator=gen)
    return torch.cat([kv, score], dim=1).contiguous()


def make_cache(
    cfg: CompressorConfig,
    params: CompressorParams,
    backend: str,
    *,
    max_requests: int = 4,
    max_seq_len: int = 64,
    mtp_step: int = 0,
    **kwargs,
) -> CompressedKVCache:
    return CompressedKVCache(
        cfg,
        params,
        max_requests=max_requests,
        max_seq_len=max_seq_len,
        mtp_step=mtp_step,
        backend=backend,
        device="cpu",
        **kwargs,
    )


class StreamModel:
    """The SPEC section 5 invariant: per request, the current row of every position ``0..L-1``."""

    def __init__(self, cfg: CompressorConfig, params: CompressorParams):
        self.cfg = cfg
        self.params = params
        self.rows: dict[int, torch.Tensor] = {}

    def live(self) -> list[int]:
        return sorted(self.rows)

    def length(self, rid: int) -> int:
        return self.rows[rid].shape[0]

    def apply(self, rid: int, start: int, new_rows: torch.Tensor) -> None:
        """Positions ``>= start`` are discarded, then ``new_rows`` supply ``[start, start + n)``."""
        if start == 0:
            old = torch.zeros(0, self.cfg.row_width)
        else:
            old = self.rows[rid][:start]
        assert old.shape[0] == start, (rid, start, old.shape)
        self.rows[rid] = torch.cat([old, new_rows.clone()], dim=0)

    def release(self, rid: int) -> None:
        del self.rows[rid]

    def expected(self, rid: int) -> torch.Tensor:
        """float64 ``[L // r, H]``: the one-shot entries over the current rows."""
        return reference.compress_sequence(self.rows[rid], self.params, self.cfg, dtype=torch.float64)


def run_step(cache: CompressedKVCache, model: StreamModel, items) -> None:
    """One step for ``items = [(rid, start, rows), ...]`` (in ``kv_score`` order) on the cache and the model.

    The cache gets a clone of the rows: a backend may use the gate-logit half of ``kv_score`` as scratch.
    """
    cfg = cache.config
    ids = [rid for rid, _, _ in items]
    starts = [start for _, start, _ in items]
    counts = [rows.shape[0] for _, _, rows in items]
    if items:
        kv_score = torch.cat([rows for _, _, rows in items], dim=0)
    else:
        kv_score = torch.zeros(0, cfg.row_width)
    cache.step(ids, starts, counts, kv_score.clone().contiguous())
    for rid, start, rows in items:
        model.apply(rid, start, rows)


def check_cache_against_model(cache: CompressedKVCache, model: StreamModel, rid: int) -> None:
    """Assert request ``rid``'s stored entries are the one-shot float64 entries of its current rows."""
    cfg = cache.config
    length = model.length(rid)
    assert cache.length(rid) == length, f"request {rid}: cache L={cache.length(rid)}, model L={length}"
    values64 = model.expected(rid)
    groups = length // cfg.ratio
    assert values64.shape == (groups, cfg.head_dim)
    entries = cache.entries(rid)
    assert entries.dtype == torch.float32
    assert entries.shape == (groups, cfg.head_dim), f"request {rid}: entries {list(entries.shape)}, L={length}"
    if cfg.output == INDEXER:
        rep = check_indexer_keys(entries, values64)
        assert rep.ok, f"request {rid} (L={length}): {rep}"
        if cfg.indexer_fp8:
            packed = cache.packed_entries(rid)
            assert packed.dtype == torch.uint8 and packed.shape == (groups, cfg.indexer_fp8_bytes)
            rep = check_indexer_fp8(packed, entries.to(torch.bfloat16))
            assert rep.ok, f"request {rid} (L={length}): {rep}"
    else:
        packed = cache.packed_entries(rid)
        assert packed.dtype == torch.uint8 and packed.shape == (groups, cfg.entry_bytes)
        rep = check_latent_records(packed, values64, cfg)
        assert rep.ok, f"request {rid} (L={length}): {rep}"
        assert torch.equal(entries, decode_latent(packed, cfg)), f"request {rid}: entries() != decode(packed)"


def check_all(cache: CompressedKVCache, model: StreamModel) -> None:
    for rid in model.live():
        check_cache_against_model(cache, model, rid)
    for rid in range(cache.max_requests):
        assert cache.is_live(rid) == (rid in model.rows), f"request {rid}: liveness differs from the model"


def snapshot(cache: CompressedKVCache) -> dict:
    """Everything observable about a cache (and its ring, if the backend keeps one), for no-change checks."""
    snap = {"live": [rid for rid in range(cache.max_requests) if cache.is_live(rid)]}
    for rid in snap["live"]:
        snap[("len", rid)] = cache.length(rid)
        snap[("entries", rid)] = cache.entries(rid).clone()
        if cache.config.output != INDEXER or cache.config.indexer_fp8:
            snap[("packed", rid)] = cache.packed_entries(rid).clone()
        snap[("pages", rid)] = cache.page_table(rid).copy()
    snap["page_table_all"] = cache.pool.page_table.copy()  # pages of every slot, live or not
    ring = getattr(cache.backend, "ring", None)
    if isinstance(ring, torch.Tensor):
        snap["ring"] = ring.clone()
    return snap


def assert_unchanged(cache: CompressedKVCache, before: dict) -> None:
    after = snapshot(cache)
    assert after.keys() == before.keys(), (sorted(map(str, after)), sorted(map(str, before)))
    for key, value in before.items():
        got = after[key]
        if isinstance(value, torch.Tensor):
            assert got.shape == value.shape and torch.equal(_bytes(got), _bytes(value)), f"{key} changed"
        elif hasattr(value, "shape"):
            assert (got == value).all(), f"{key} changed"
        else:
            assert got == value, f"{key} changed: {value} -> {got}"


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor (NaN-safe equality)."""
    return t.contiguous().view(-1).view(torch.uint8)


def params_with(params: CompressorParams, **changes) -> CompressorParams:
    fields = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
    fields.update(changes)
    return CompressorParams(**fields)


def bad_params(cfg: CompressorConfig, p: CompressorParams):
    """``(name, invalid params, substrings the error must hold)`` for ``CompressorParams.validate``."""
    r, w, h = cfg.ratio, cfg.width, cfg.head_dim
    half = cfg.rope_dim // 2
    nan_ape = p.ape.clone()
    nan_ape[1, 5] = float("nan")
    inf_w = p.norm_weight.clone()
    inf_w[3] = float("inf")
    nan_cos = p.cos.clone()
    nan_cos[7, 1] = float("nan")
    yield "ape shape", params_with(p, ape=torch.randn(r, w + 1)), ["ape", f"[{r}, {w}]", f"[{r}, {w + 1}]"]
    yield "ape rows", params_with(p, ape=torch.randn(r + 1, w)), ["ape", f"[{r}, {w}]", f"[{r + 1}, {w}]"]
    yield "ape dtype", params_with(p, ape=p.ape.double()), ["ape", "float64"]
    yield "ape nan", params_with(p, ape=nan_ape), ["ape", "non-finite"]
    yield "norm shape", params_with(p, norm_weight=torch.ones(h - 2)), ["norm_weight", f"[{h}]", f"[{h - 2}]"]
    yield "norm dtype", params_with(p, norm_weight=p.norm_weight.half()), ["norm_weight", "float16"]
    yield "norm inf", params_with(p, norm_weight=inf_w), ["norm_weight", "non-finite"]
    yield "cos width", params_with(p, cos=p.cos[:, :-1].contiguous()), ["cos", str(half), str(half - 1)]
    yield "sin rows", params_with(p, sin=p.sin[:-3].contiguous()), ["sin", str(p.cos.shape[0] - 3)]
    yield "cos dtype", params_with(p, cos=p.cos.double()), ["cos", "float64"]
    yield "cos nan", params_with(p, cos=nan_cos), ["cos", "non-finite"]
    yield "ape not a tensor", params_with(p, ape=p.ape.numpy()), ["ape", "ndarray"]
    yield "norm on meta", params_with(p, norm_weight=torch.empty(h, device="meta")), ["norm_weight", "meta"]
    yield "eps zero", params_with(p, eps=0.0), ["eps", "0.0"]
    yield "eps too big", params_with(p, eps=1.5), ["eps", "1.5"]
    yield "tables shorter than a group", params_with(p, cos=p.cos[: r - 1], sin=p.sin[: r - 1]), [str(r - 1)]
