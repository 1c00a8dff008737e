"""The one batch splitter the coordinator's outbox and the engines' replies share."""

from __future__ import annotations

from service.bus.batches import BATCH_OVERHEAD, fits_alone, split_batches


def test_batches_stay_under_the_limit_and_keep_order() -> None:
    sizes = [400, 300, 300, 500, 100]
    batches = list(split_batches(sizes, lambda size: size, max_payload=1000 + BATCH_OVERHEAD))
    assert [size for batch in batches for size in batch] == sizes
    assert all(sum(batch) <= 1000 for batch in batches)
    assert batches == [[400, 300, 300], [500, 100]]


def test_an_oversized_item_is_left_to_the_caller_and_travels_alone() -> None:
    max_payload = 100 + BATCH_OVERHEAD
    assert not fits_alone(101, max_payload) and fits_alone(100, max_payload)
    assert list(split_batches([50, 150, 50], lambda size: size, max_payload)) == [[50], [150], [50]]


def test_nothing_in_nothing_out() -> None:
    assert list(split_batches([], lambda size: size, 1_000_000)) == []
