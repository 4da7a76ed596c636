"""The training data order: a function of (seed, step) alone."""
import numpy as np
import pytest
import torch

from tcal.data.recall import recall_rows, recall_source, with_recall
from tcal.train.sampler import WindowOrder, batch_for_step
from tcal.utils.errors import TcalError

SEQ = 16


def test_data_order_is_a_function_of_seed_and_step():
    tokens = np.arange(10 * SEQ, dtype=np.uint16)  # 10 windows
    order = WindowOrder(10, seed=3)
    seen = [order.window(i) for i in range(20)]
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:]) == list(range(10))  # epochs are permutations
    assert seen[:10] != seen[10:]
    b = batch_for_step(tokens, WindowOrder(10, seed=3), SEQ, step=3, batch_size=4)
    assert torch.equal(b, batch_for_step(tokens, order, SEQ, step=3, batch_size=4))
    assert [int(r[0]) // SEQ for r in b] == seen[12:16]
    assert all(torch.equal(r, torch.arange(int(r[0]), int(r[0]) + SEQ)) for r in b)  # whole windows, no padding
    assert [WindowOrder(10, seed=4).window(i) for i in range(10)] != seen[:10]
    assert b.dtype == torch.long and b.shape == (4, SEQ)


def test_a_prefix_starts_every_window_and_the_stream_is_cut_around_it():
    # Gemma's BOS (id 2) before SEQ - 1 stream tokens; the stream's windows still tile it without overlap
    body = SEQ - 1
    tokens = np.arange(10 * body, dtype=np.uint16) + 100
    order = WindowOrder(10, seed=3)
    b = batch_for_step(tokens, order, SEQ, step=0, batch_size=10, prefix=(2,))
    assert b.shape == (10, SEQ) and bool((b[:, 0] == 2).all())
    starts = sorted(int(r[1]) - 100 for r in b)
    assert starts == [i * body for i in range(10)]
    assert all(torch.equal(r[1:], torch.arange(int(r[1]), int(r[1]) + body)) for r in b)


def test_no_full_window_is_an_error():
    with pytest.raises(TcalError, match="no full window"):
        WindowOrder(0, seed=0)


# ---------------------------------------------------------------------------------------------
# the recall mix
# ---------------------------------------------------------------------------------------------


def test_with_recall_repeats_an_earlier_span_at_the_end():
    window = np.arange(100, 132)
    out = with_recall(window, source=5, span=8)
    assert list(out[-8:]) == list(range(105, 113))  # the copy
    assert list(out[:-8]) == list(range(100, 124))  # everything before it as it was
    assert list(window) == list(range(100, 132))  # the input is not changed
    assert list(with_recall(window, source=16, span=8)[-8:]) == list(range(116, 124))  # the latest source that fits
    for source, span in ((17, 8), (-1, 8), (0, 0), (0, 17)):
        with pytest.raises(ValueError, match="does not fit"):
            with_recall(window, source, span)


def test_recall_source_is_a_function_of_seed_and_sample():
    picks = [recall_source(3, i, 64, 0.5, 16) for i in range(400)]
    assert picks == [recall_source(3, i, 64, 0.5, 16) for i in range(400)]
    assert picks != [recall_source(4, i, 64, 0.5, 16) for i in range(400)]
    used = [s for s in picks if s is not None]
    assert 0.4 < len(used) / len(picks) < 0.6
    assert min(used) == 0 and max(used) == 64 - 2 * 16  # sources spread over every start that fits
    assert all(recall_source(3, i, 64, 0.0, 16) is None for i in range(100))
    assert all(recall_source(3, i, 64, 1.0, 16) is not None for i in range(100))


def test_recall_mix_in_a_batch():
    tokens = np.arange(10 * SEQ, dtype=np.uint16)
    order = WindowOrder(10, seed=3)
    plain = batch_for_step(tokens, order, SEQ, step=3, batch_size=4)
    assert torch.equal(plain, batch_for_step(tokens, order, SEQ, step=3, batch_size=4, recall_frac=0.0,
                                             recall_span=4))
    mixed = batch_for_step(tokens, order, SEQ, step=3, batch_size=4, recall_frac=1.0, recall_span=4)
    for b in range(4):
        source = recall_source(3, 3 * 4 + b, SEQ, 1.0, 4)
        assert torch.equal(mixed[b, :-4], plain[b, :-4])
        assert torch.equal(mixed[b, -4:], plain[b, source:source + 4])
    # one rank's rows are that rank's rows of the whole batch, copies included
    half = batch_for_step(tokens, order, SEQ, step=3, batch_size=4, rows=range(2, 4), recall_frac=1.0, recall_span=4)
    assert torch.equal(half, mixed[2:])


def test_recall_rows_is_the_mix_per_row():
    ids = torch.arange(6 * SEQ).reshape(6, SEQ)
    out = recall_rows(ids, seed=2, frac=0.5, span=4, first_sample=10)
    for n in range(6):
        source = recall_source(2, 10 + n, SEQ, 0.5, 4)
        want = ids[n] if source is None else torch.cat([ids[n, :-4], ids[n, source:source + 4]])
        assert torch.equal(out[n], want)
    assert not torch.equal(out, ids) and out.dtype == ids.dtype


def test_a_mixed_batch_takes_each_streams_rows_in_its_own_order_with_the_answer_mask():
    from tcal.train.sampler import Stream, mix_rows, mixed_batch_for_step

    seq = 4
    chat = np.arange(40, dtype=np.uint32)  # 10 windows
    mask = (np.arange(40) % 4 >= 2)
    raw = np.arange(1000, 1040, dtype=np.uint32)
    a = Stream(chat, WindowOrder(10, seed=3), mask)
    b = Stream(raw, WindowOrder(10, seed=4))
    assert mix_rows(4, 0.25) == 1 and mix_rows(4, 0.0) == 0 and mix_rows(4, 0.9) == 3 and mix_rows(2, 0.1) == 1
    ids, m = mixed_batch_for_step([(a, 3), (b, 1)], seq, step=2)
    assert ids.shape == (4, seq) and m.shape == (4, seq)
    # the chat rows are samples 6, 7, 8 of the chat order; the raw row is sample 2 of its own
    for r, sample in enumerate((6, 7, 8)):
        w = a.order.window(sample)
        assert ids[r].tolist() == list(range(w * seq, w * seq + seq))
        assert m[r].tolist() == mask[w * seq:(w + 1) * seq].tolist()
    w = b.order.window(2)
    assert ids[3].tolist() == list(range(1000 + w * seq, 1000 + w * seq + seq)) and bool(m[3].all())
    # one rank's rows are the same rows
    part, part_mask = mixed_batch_for_step([(a, 3), (b, 1)], seq, step=2, rows=range(2, 4))
    assert torch.equal(part, ids[2:]) and torch.equal(part_mask, m[2:])
    # no mask anywhere: none comes back
    assert mixed_batch_for_step([(b, 2)], seq, step=0)[1] is None
