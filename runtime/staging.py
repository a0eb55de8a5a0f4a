"""Pinned host buffers for one device: the arguments a call reads in place and the outputs it
writes in place, reused from call to call (runtime/module.py's host transfer contract;
docs/architecture.md, "Host time of a step")."""

from __future__ import annotations

import numpy as np


class Staging:
    """Pinned host buffers (HOST_LOCAL | DEVICE_VISIBLE) for one device: arguments the device reads
    in place and outputs it writes in place, reused from call to call.

    An argument buffer is rewritten `DEPTH` arguments of its shape and dtype later. A call's
    arguments must stay intact while it may run: at most two of this runtime's calls are ever in
    flight (`decode_ahead` queues one step ahead; every other call returns when its work is done)
    and a call passes at most three arguments of one shape (`draft`: three int64 [1]), so 8 slots
    keep every argument that may still be read.
    """

    DEPTH = 8

    def __init__(self, device):
        import iree.runtime as rt

        self.device, self._rt = device, rt
        self._memory = int(rt.MemoryType.HOST_LOCAL | rt.MemoryType.DEVICE_VISIBLE)
        self._args: dict[tuple, list] = {}  # (shape, dtype) -> [buffer views, next slot]
        self._outs: dict[tuple, object] = {}  # (shape, dtype, slot) -> pinned buffer calls write into

    def arg(self, array: np.ndarray, constant: bool = False):
        """`array` (any numpy array; copied) in a pinned buffer, as an iree.runtime DeviceArray of the
        same shape and dtype to pass to a function. `constant`: a buffer of its own, never reused
        (for values that stay the same, like `pages` and the sampling parameters)."""
        rt = self._rt
        array = np.ascontiguousarray(array)
        key = (array.shape, array.dtype.str)
        ring = None if constant else self._args.setdefault(key, [[], 0])
        if ring is None or len(ring[0]) < self.DEPTH:
            usage = int(rt.BufferUsage.DEFAULT | rt.BufferUsage.MAPPING)
            view = self.device.allocator.allocate_buffer_copy(memory_type=self._memory, allowed_usage=usage,
                                                              device=self.device, buffer=array,
                                                              element_type=rt.array_interop.map_dtype_to_element_type(array.dtype))
            if ring is not None:
                ring[0].append(view)
        else:
            view = ring[0][ring[1] % self.DEPTH]
            ring[1] += 1
            mapped = view.map()
            mapped.asarray(array.shape, array.dtype)[...] = array
            del mapped
        return rt.DeviceArray(self.device, view, override_dtype=array.dtype)

    def out(self, shape: tuple, dtype, slot: int = 0):
        """Pinned buffer `slot` of `shape` and `dtype` for a call to write an output into (an argument
        in the manifest's `writes`), kept and reused; `value` reads it once the call is done. Entry
        points with outputs of one shape share it (prefill and decode, draft and draft_topk): safe
        because every call but `decode_ahead`'s steps returns when done, `value` copies, and
        `decode_ahead` runs alone, alternating two slots."""
        key = (tuple(shape), np.dtype(dtype).str, slot)
        if key not in self._outs:
            self._outs[key] = self.arg(np.zeros(shape, dtype), constant=True)
        return self._outs[key]

    @staticmethod
    def value(array) -> np.ndarray:
        """The contents of a pinned buffer (`out`, `arg`) as a new numpy array of its shape and dtype,
        read in place: for one a call writes, once the call is done."""
        mapped = array._buffer_view.get_buffer().map()
        out = np.array(mapped.asarray(tuple(array.shape), array.dtype))
        del mapped
        return out
