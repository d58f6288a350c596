"""What the C++ call paths' carved outputs must be (tests/test_callpath.py, tests/test_callpath_internode.py)."""
from __future__ import annotations

import torch


def check_carved(mine: dict, theirs: dict, offsets: dict) -> None:
    """Outputs carved from one allocation (csrc/callpath.h carve): each as the Python path's own tensor
    (shape, strides, dtype, contiguous, not a view of another tensor), at its byte offset in one storage
    that each of them holds (so any one of them keeps it alive). Empties ``mine``: pass the only references."""
    storage = next(iter(mine.values())).untyped_storage()
    base = storage.data_ptr()
    for k, t in mine.items():
        py = theirs[k]
        assert (t.shape, t.stride(), t.dtype, t.is_contiguous(), t._base) == \
               (py.shape, py.stride(), py.dtype, py.is_contiguous(), None), k
        assert t.untyped_storage().data_ptr() == base and t.data_ptr() - base == offsets[k], k
        assert t.storage_offset() * t.element_size() == offsets[k], k
        assert storage.nbytes() >= offsets[k] + t.numel() * t.element_size(), k
    del t
    # one reference per output (and one for ``storage`` here); the last one left still holds it
    assert torch._C._storage_Use_Count(storage._cdata) == len(mine) + 1
    last = mine.popitem()[1]
    mine.clear()
    assert torch._C._storage_Use_Count(storage._cdata) == 2 and last.untyped_storage().data_ptr() == base
