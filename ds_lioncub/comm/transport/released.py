"""A CPU collective returns only once the backend's worker threads have let go of its tensors.

Why: gloo (and torch's MPI backend) run a collective on a worker thread of their own, which keeps a
reference to every tensor it was given until it drops the finished work, a moment after it wakes the
waiting caller. If the caller has dropped the tensor by then, the worker's release frees the tensor's
Python object, which takes the GIL. If the caller has meanwhile reached interpreter exit, the worker finds
the interpreter finalizing inside ``take_gil`` and CPython ends the thread with ``pthread_exit``; the
unwinding meets a ``noexcept`` C++ frame and the process dies with "terminate called without an active
exception" (SIGABRT, exit code -6) after its work is done. Measured (``python -m benchmarks.gloo_release_race``,
torch 2.13, 2 ranks, this 2-core machine under load): 17-18% of plain ``all_reduce`` calls returned before
the worker had let go; in every such case whose tensor the caller then dropped, its Python object was
still alive after the caller had held the GIL for 50 ms, and gone within 1 ms of letting it go.

So every collective LionCub issues on CPU tensors gets private views of its tensors
(:class:`HandedOver`): views made for that call alone, which no one else can reference, so their
reference counts go back to what they were exactly when the backend has let go of them. After the
collective completes, :meth:`HandedOver.wait_until_released` waits for that, yielding the CPU and the
GIL meanwhile; the views are still alive then, so the release frees no Python object. Then no worker
holds a tensor of LionCub's once the collective has returned, and none can touch Python later. It costs
a view per tensor and a reference count read (the worker has usually let go already). CUDA tensors are
not waited on: NCCL's watchdog keeps finished works for a while by design, and ``destroy_process_group``
shuts it down.
"""

from __future__ import annotations

import time

import torch

from ds_lioncub._logging import get_logger

#: How long to wait for a worker to let go before going on (with a warning): a reference taken by
#: someone else than the backend would otherwise hold the caller forever.
RELEASE_WAIT_S = 30.0

_warned = False


def references(tensor: torch.Tensor) -> int:
    """How many C++ references ``tensor``'s implementation has (its Python object holds one)."""
    return int(tensor._use_count())  # type: ignore[attr-defined]  # torch's own, not in its stubs


class HandedOver:
    """Private views of the tensors one collective is given (``tensors``: pass these, not the originals)."""

    def __init__(self, *originals: torch.Tensor) -> None:
        self.tensors = [tensor.view(tensor.shape) for tensor in originals]
        self._counts = [(view, references(view)) for view in self.tensors if view.device.type == "cpu"]

    def still_held(self) -> list[torch.Tensor]:
        """The views that something besides this object (a backend's worker) still holds."""
        return [view for view, count in self._counts if references(view) > count]

    def wait_until_released(self) -> None:
        """Return once no one but this object holds the views (at once, as a rule)."""
        global _warned
        start = time.monotonic()
        while self.still_held():
            if time.monotonic() - start > RELEASE_WAIT_S:
                if not _warned:
                    _warned = True
                    get_logger().warning(
                        f"LionCub: a collective's tensors were still referenced {RELEASE_WAIT_S:.0f} s after it "
                        "completed; going on (a process exiting now could abort with SIGABRT)."
                    )
                return
            time.sleep(0)  # yields the CPU (and the GIL) to the worker, which may be waiting for either
        self._counts = []


__all__ = ["RELEASE_WAIT_S", "HandedOver", "references"]
