"""The staging budget and pool: buffers are page aligned, reused within and across saves but
never while anything still reads them, and never more than the budget in all."""

import threading

import numpy as np
import pytest

from ckpt._save.host_copy import SaveBudget, StagingAborted, StagingPool


def test_buffers_are_page_aligned_and_reused_once_unreferenced():
    pool = StagingPool()
    budget = SaveBudget(1 << 20, pool=pool)
    lease = budget.acquire(10_000, buffer=True)
    assert lease.buffer.ctypes.data % 4096 == 0 and lease.nbytes == lease.buffer.nbytes == 12_288
    address = lease.buffer.ctypes.data
    budget.release(lease)
    assert pool.free_bytes == 12_288 and budget.held == 0
    again = budget.acquire(9_000, buffer=True)  # a free buffer of at least the size is reused
    assert again.buffer.ctypes.data == address and pool.free_bytes == 0

    still_read = again.buffer[:100].view(np.uint8)  # e.g. a storage engine still holding the chunk
    still_read[:] = 7
    budget.release(again)
    assert pool.free_bytes == 0  # not pooled: it could be overwritten under the reader
    fresh = budget.acquire(9_000, buffer=True)
    assert not np.shares_memory(fresh.buffer, still_read) and (still_read == 7).all()


def test_budget_bounds_leases_and_pool_and_wakes_waiters():
    pool = StagingPool()
    budget = SaveBudget(3 * 4096, pool=pool)
    held = [budget.acquire(4096, buffer=True) for _ in range(3)]
    assert budget.acquire(1, buffer=False, block=False) is None
    got = []
    waiter = threading.Thread(target=lambda: got.append(budget.acquire(4096, buffer=True)))
    waiter.start()
    budget.release(held.pop())
    waiter.join(30)
    assert got and got[0].buffer is not None
    assert budget.high_water == 3 * 4096 and budget.waited
    # Free buffers of another size make room instead of blocking.
    for lease in held + got:
        budget.release(lease)
    assert pool.free_bytes == 3 * 4096
    big = budget.acquire(2 * 4096 + 1, buffer=True)
    assert big.nbytes == 3 * 4096 and pool.free_bytes == 0 and budget.high_water == 3 * 4096


def test_a_later_budget_trims_the_pool_and_a_chunk_over_budget_is_staged_alone():
    pool = StagingPool()
    first = SaveBudget(8 * 4096, pool=pool)
    leases = [first.acquire(4096, buffer=True) for _ in range(8)]
    for lease in leases:
        first.release(lease)
    assert pool.free_bytes == 8 * 4096
    second = SaveBudget(2 * 4096, pool=pool)
    assert pool.free_bytes == 2 * 4096 and second.high_water == 2 * 4096
    huge = second.acquire(5 * 4096, buffer=True)  # nothing else held: allowed, alone
    assert huge.nbytes == 5 * 4096 and pool.free_bytes == 0
    assert second.acquire(1, buffer=False, block=False) is None
    second.release(huge)
    assert pool.free_bytes == 0  # larger than the budget: not kept
    assert pool.release() == 0


def test_abort_wakes_a_waiting_acquire():
    budget = SaveBudget(4096, pool=StagingPool())
    budget.acquire(4096, buffer=True)
    errors = []

    def wait():
        try:
            budget.acquire(4096, buffer=True)
        except StagingAborted as e:
            errors.append(e)

    waiter = threading.Thread(target=wait)
    waiter.start()
    budget.abort(OSError("disk full"))
    waiter.join(30)
    assert errors and isinstance(errors[0].__cause__, OSError)
    with pytest.raises(StagingAborted):
        budget.acquire(1, buffer=False)


def test_a_buffer_still_referenced_after_its_write_stays_counted_until_let_go():
    pool = StagingPool()
    budget = SaveBudget(2 * 4096, pool=pool)
    lease = budget.acquire(4096, buffer=True)
    reader = lease.buffer[:16]  # e.g. an engine letting go of the chunk a moment late
    budget.release(lease)
    assert budget.held == 4096 and budget.high_water == 4096  # still counted
    assert budget.acquire(2 * 4096, buffer=False, block=False) is None
    del reader
    again = budget.acquire(4096, buffer=True)  # the let-go buffer, pooled and reused
    assert budget.held == 4096 and again.buffer is not None and budget.written_off == 0
    budget.release(again)
    assert budget.held == 0 and pool.free_bytes == 4096


def test_with_no_room_for_a_new_buffer_a_larger_free_one_serves():
    # A save whose chunk sizes alternate (small chunks of one leaf, large of the next) keeps its
    # large buffers for the small chunks instead of trading them for new memory.
    pool = StagingPool()
    budget = SaveBudget(8 * 4096, pool=pool)
    large = [budget.acquire(4 * 4096, buffer=True) for _ in range(2)]
    addresses = {lease.buffer.ctypes.data for lease in large}
    for lease in large:
        budget.release(lease)
    assert pool.free_bytes == 8 * 4096
    small = budget.acquire(4096, buffer=True)
    assert small.buffer.ctypes.data in addresses and small.nbytes == 4 * 4096  # counted whole
    assert budget.high_water == 8 * 4096
    other = budget.acquire(4096, buffer=True)
    assert other.buffer.ctypes.data in addresses and other.buffer.ctypes.data != small.buffer.ctypes.data
    assert budget.acquire(4096, buffer=True, block=False) is None  # the budget is spent
    budget.release(small)
    budget.release(other)
