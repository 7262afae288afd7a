"""The demo (simulated serving, every entry verified) at tiny sizes, and its checker's failure path."""

import pytest

from dsv4_compressor.demo import MTP_STEP, LayerRun, Schedule, Step, check_cache, format_result, run_demo

TINY = dict(requests=2, max_prompt=300, decode_steps=6, seed=3, backend="reference", device="cpu", progress=False)


def test_schedule_follows_the_streaming_contract():
    sched = Schedule(3, 300, 10, seed=3)
    length = {}
    for step in sched:
        assert len(set(step.request_ids)) == len(step.request_ids)
        for rid, start, n, what in zip(step.request_ids, step.starts, step.num_rows, step.what):
            if what == "first":
                assert rid not in length and start == 0
            else:
                assert length[rid] - MTP_STEP <= start <= length[rid]
            if what == "decode":
                assert n == MTP_STEP + 1
            length[rid] = start + n
    assert sched.tokens == sum(s.rows for s in sched)
    assert sched.rewinds > 0
    assert any("decode" in s.what and ("first" in s.what or "chunk" in s.what) for s in sched)
    assert any(sum(w in ("first", "chunk") for w in s.what) >= 2 for s in sched)
    assert all(length[rid] >= p for rid, p in enumerate(sched.prompts))


def test_demo_verifies_every_entry():
    result = run_demo(**TINY)
    assert result.ok, format_result(result)
    assert [layer.kind for layer in result.layers] == ["hca", "csa", "indexer"]
    hca, csa = result.layers[0].check, result.layers[1].check
    assert hca.entries >= 2  # seed 3: prompts of 158 and 226 tokens, one HCA entry each
    assert csa.requests == 2 and csa.entries > 20 and csa.unexplained == 0
    assert csa.exact_fraction > 0.99
    text = format_result(result)
    assert f"all {result.entries} entries verified" in text


def _corrupt_first_csa_entry(runs):
    cache = runs["csa"].cache
    page = int(cache.pool.page_table[0, 0])
    cache.pool.pages[page, 3] ^= 0x40  # an FP8 byte of entry 0 of request 0: its exponent jumps


def test_demo_reports_a_corrupted_byte():
    result = run_demo(**{**TINY, "kinds": ("csa",)}, before_check=_corrupt_first_csa_entry)
    assert not result.ok
    check = result.layers[0].check
    assert check.unexplained >= 1 and "request 0" in check.failures[0]
    assert "FAILED" in format_result(result)


@pytest.mark.parametrize("kind", ["hca", "indexer"])
def test_check_cache_flags_wrong_rows(kind):
    """Entries checked against rows other than those supplied (a wrong window) fail; the right rows pass."""
    run = LayerRun(kind, requests=1, max_seq_len=300, backend="reference", device="cpu", seed=2)
    run.step(Step([0], [0], [300], ["first"]))
    rows = run.current_rows()
    assert check_cache(run.cache, rows).ok
    rows[0] = rows[0].clone()
    rows[0][130] += 0.5  # one position of HCA group 1 / indexer group 32 (and 33, by overlap)
    bad = check_cache(run.cache, rows)
    assert not bad.ok and bad.unexplained > 0


def test_demo_with_nothing_to_check_fails():
    """A run where no request reaches a full group checks nothing: that is not a success."""
    result = run_demo(**{**TINY, "max_prompt": 2, "decode_steps": 0, "kinds": ("hca",)})
    assert result.entries == 0 and not result.ok
    assert "no entry was checked" in format_result(result)
