"""KernelContext: the one object through which the runner tells a kernel anything
besides its op and its input arrays (minigraph.schema re-exports it)."""
from __future__ import annotations


class KernelContext:
    """What the runner tells a kernel besides its op and inputs (one object, never
    extra keyword arguments).

    place: the place the kernel runs on (CPUPlace, GPUPlace or a test double).
    donated: input slots whose arrays the kernel may write its outputs into
      (OpSchema.reuse): a training step hands an input over only when its value
      dies at this op and nothing else refers to its memory (minigraph.handover).
      The kernel must give the same bits as without it.
    room: bytes of work memory the kernel may take without raising the training
      step's peak (OpSchema.work_room; minigraph.work_room), or None: keep lean.
    spares: {in-place output slot: an array of its input's shape and dtype (for a
      list slot, a list with None where the input is written in place)} that a
      kernel whose schema declares `spares` writes that output's new values into
      instead of its input (a training step on the CPU offers them); empty: in place.
    comm: the process's communicator (minigraph.distributed), made on first use;
      only collective ops and sync_batch_norm ask for it.
    """

    __slots__ = ("place", "donated", "room", "spares")

    def __init__(self, place=None, donated=(), room=None, spares=None):
        self.place, self.donated, self.room = place, donated, room
        self.spares = spares or {}

    @property
    def comm(self):
        from minigraph.distributed.world import get_comm

        return get_comm()

    def with_donated(self, donated):
        """This context with `donated` input slots (a new object)."""
        return KernelContext(self.place, donated, self.room, self.spares)

    def with_spares(self, spares):
        """This context with `spares` for in-place outputs (a new object)."""
        return KernelContext(self.place, self.donated, self.room, spares)

    def __repr__(self):
        return f"KernelContext(donated={self.donated!r}, room={self.room!r})"
