"""``ops.rows_from_requests`` (kernels/request_rows.py): per-row positions and request slots from per-request
tensors, against a plain Python loop and against torch's ops (the path large batches take)."""

import pytest
import torch

from dsv4_compressor import ops
from dsv4_compressor.ops import planning


def _loop(req, seq, ext, rows, pad):
    """Row by row in Python: the definition."""
    positions, row_req = [0] * rows, [-1] * rows
    t = 0
    for b in range(len(req)):
        n = 1 if ext is None else int(ext[b])
        for k in range(n):
            if t < rows:
                positions[t] = int(seq[b]) - n + k
                row_req[t] = -1 if pad is not None and int(req[b]) == pad else int(req[b])
            t += 1
    return torch.tensor(positions, dtype=torch.int64), torch.tensor(row_req, dtype=torch.int64)


def _case(gen, batch, dtype, decode):
    req = torch.randint(0, 6, (batch,), generator=gen)  # slot 0 appears: SGLang's padding request
    ext = None if decode else torch.randint(0, 9, (batch,), generator=gen)
    before = torch.randint(0, 300, (batch,), generator=gen)
    seq = before + (1 if decode else ext)
    pad_rows = 0 if decode else int(torch.randint(0, 6, (1,), generator=gen))
    rows = batch if decode else int(ext.sum()) + pad_rows
    cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    return cast(req), cast(seq), cast(ext), rows


@pytest.mark.parametrize("decode", [False, True], ids=["packed", "decode"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("pad", [0, None])
def test_against_a_loop_and_torch(decode, dtype, pad):
    gen = torch.Generator().manual_seed(7 + decode)
    for batch in (1, 3, 17, 40):
        req, seq, ext, rows = _case(gen, batch, dtype, decode)
        got = ops.rows_from_requests(req, seq, ext, rows, pad_request=pad)
        want = _loop(req, seq, ext, rows, pad)
        torch_path = planning._rows_from_requests_torch(req, seq, ext, rows, pad)
        for g, w, tp, name in zip(got, want, torch_path, ("positions", "row_req"), strict=True):
            assert g.dtype == torch.int64 and g.shape == (rows,)
            assert torch.equal(g, w), f"{name}, batch {batch}: {g.tolist()} != {w.tolist()}"
            assert torch.equal(tp, w), f"torch path {name}, batch {batch}"


def test_rows_past_the_requests_and_an_empty_batch_are_padding():
    req, seq, ext = torch.tensor([3, 5]), torch.tensor([10, 4]), torch.tensor([2, 1])
    positions, row_req = ops.rows_from_requests(req, seq, ext, 6)
    assert positions.tolist() == [8, 9, 3, 0, 0, 0] and row_req.tolist() == [3, 3, 5, -1, -1, -1]
    empty = torch.zeros(0, dtype=torch.int64)
    positions, row_req = ops.rows_from_requests(empty, empty, empty, 4, pad_request=0)
    assert positions.tolist() == [0] * 4 and row_req.tolist() == [-1] * 4


def test_large_batches_take_torchs_ops(monkeypatch):
    gen = torch.Generator().manual_seed(3)
    req, seq, ext, rows = _case(gen, 9, torch.int64, False)
    monkeypatch.setattr(planning, "ROWS_FROM_REQUESTS_MAX_BATCH", 4)
    monkeypatch.setattr(planning._request_rows, "launch_rows_from_requests", None)  # would raise if launched
    got = ops.rows_from_requests(req, seq, ext, rows, pad_request=0)
    want = _loop(req, seq, ext, rows, 0)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize(
    "args,match",
    [
        ((torch.tensor([1, 2]), torch.tensor([3]), None, 2), "seq_lens has 1 entries for 2 requests"),
        ((torch.tensor([1, 2]), torch.tensor([3, 4]), None, 3), "one row per request"),
        ((torch.tensor([1.0]), torch.tensor([3]), None, 1), "req_pool_indices must be"),
        ((torch.tensor([1]), torch.tensor([3]), torch.tensor([1, 1]), 2), "extend_lens has 2 entries"),
        ((torch.tensor([1]), torch.tensor([3]), torch.tensor([1]), -1), "rows must be an integer >= 0"),
    ],
)
def test_bad_input_is_refused(args, match):
    with pytest.raises(ops.OpError, match=match):
        ops.rows_from_requests(*args)
