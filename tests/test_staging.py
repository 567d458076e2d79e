"""The staging pool: buffers are reused from save to save, never while anything still reads them."""

import numpy as np

from ckpt._staging import POOL, owned_copy


def test_pooled_copy_is_exact_and_page_aligned():
    x = np.random.default_rng(0).standard_normal((64, 48)).astype(np.float32)
    buffers: list = []
    copy = owned_copy(x, buffers)
    assert np.array_equal(copy, x) and not np.shares_memory(copy, x)
    assert copy.ctypes.data % 4096 == 0 and len(buffers) == 1


def test_pool_reuses_a_buffer_only_once_nothing_references_it():
    x = np.arange(64 * 1024, dtype=np.float32)
    buffers: list = []
    still_read = owned_copy(x, buffers)  # e.g. a storage engine still holding the chunk
    POOL.give_back(buffers)
    del buffers
    fresh = POOL.take(x.nbytes)
    assert not np.shares_memory(fresh, still_read)
    assert np.array_equal(still_read, x)

    buffers = []
    done = owned_copy(x, buffers)
    address = done.ctypes.data
    del done  # every view gone: the next save gets the same memory back
    POOL.give_back(buffers)
    del buffers
    assert POOL.take(x.nbytes).ctypes.data == address
