"""GPU check: the engine-named indexer packs against each engine's own kernel, byte for byte, on one GPU.

On the same random inputs at each batch size it runs

* ``hadamard_f32`` (SGLang): SGLang 0.5.23's ``fused_norm_rope_indexer`` (``fused_norm_rope_v2.cuh``, built here
  with nvcc from the wheel's JIT headers and the flags SGLang's JIT uses: ``-DSGL_CUDA_ARCH -std=c++20 -O3
  --expt-relaxed-constexpr``, the GPU's arch, no fast math; launched through a small C wrapper as SGLang's
  ``forward`` does: decode plans, 256-thread blocks of 8 keys, page 64, fp32 input) against our finish
  (``entry_pack.finish_values``: the kernels' RMSNorm, rope and pack) from the same pooled vectors;
* ``hadamard_bf16`` (LightLLM): LightLLM's Triton ``hadamard_transform`` then ``destindex_copy_indexer_k_dsv4``
  (the fetched source files) against our pack (``entry_pack.pack_values``) of the same bf16 keys;

and reports the records that differ (0 expected), with the scale and FP8 bytes of the first few. An engine whose
kernel cannot be built or run here is reported as ``not run: <reason>``; the others still run. Writes
``engine_pack_check.json`` and ``engine_pack_check.log`` under ``--out`` (default ``$OUT``, else ``out``).

    bash scripts/engine_pack_sources.sh           # on the machine with the wheels: fills engine_src/
    PYTHONPATH=src python3 scripts/engine_pack_check.py --src engine_src   # on the GPU machine (carry engine_src)

``--ring-decode`` runs another check instead: SGLang 0.5.23's C128 ring decode (its
``flash_c128_decode`` from ``c128_v2.cuh``, built with ``-use_fast_math`` as ``compress.py`` does, then its
``fused_norm_rope_flashmla`` store, V4 584-byte records at page 2, and its ``plan_compress_decode``; fp32 state, input
and output, PDL on sm90) against our tiled C128 kernel (``ops.compress(kind="hca", scratch=...)`` as the bench's
``decode/hca/triton-tiled/B*/S1/*`` cases call it) on 4B = 64, 256, 1024 requests of one row, every request or every
4th closing a group. Both sides get the same ring history (SGLang's rows ``[kv | score]``, ours ``[kv | score +
ape]``), input rows and poisoned pages; the records are compared byte by byte, decoded, and against a float64
reference; each side is timed as a CUDA graph of ``--instances`` layers (warm; cold after an L2 flush), SGLang's
plan apart. ``--variants`` times ours with other ``launch_c128_tiled`` settings. Writes ``ring_decode.json``,
``ring_decode.md`` and ``ring_decode.log``; ``--device cpu`` runs it host-side (SGLang emulated in PyTorch, ours
under ``TRITON_INTERPRET=1``); ``--ring-compile-only`` only builds the CUDA wrappers (no device needed).

Modules (``scripts/engine_pack_check.py`` is the entry point; ``--help`` lists the options):

- :mod:`.common`: what both checks share: the poison byte, the run's log (:func:`~.common.log`, written to the
  ``.log`` files) and the nvcc command that builds a C wrapper around an SGLang kernel with SGLang's JIT flags.
- :mod:`.indexer_packs`: the default check's parts: the inputs, the record comparison, our finish and pack, SGLang's
  indexer kernel (built and launched), LightLLM's kernels (loaded and run) and the rsqrt probe.
- :mod:`.sglang_ring`: ``--ring-decode``'s SGLang side: the ring shapes, the C wrappers of SGLang's C128 decode,
  latent store and decode plan, their build, their launches (:class:`~.sglang_ring.SglangRing`) and the same three
  steps emulated in PyTorch (:class:`~.sglang_ring.SglangRingEmulated`).
- :mod:`.ring_case`: one ``--ring-decode`` case on both sides (:class:`~.ring_case.RingCase`) and the comparison
  of the 584-byte records (:func:`~.ring_case.compare_latent`).
- :mod:`.ring_decode`: the ``--ring-decode`` run: our launch variants, the graph timing, each case's checks, the
  table and the report (:func:`~.ring_decode.ring_main`), and ``--ring-compile-only``.
- :mod:`.cli`: the command line and the default check's run (:func:`~.cli.main`).

Running it on the GPU, ``scripts/engine_pack_check.py`` drops ``TRITON_INTERPRET`` before triton is imported
(unless ``--device cpu``), so that the packs run compiled.
"""
