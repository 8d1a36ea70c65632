"""GradientMerge under data_parallel: merged gradients are per rank until they are averaged.

Between two updates each rank of a data-parallel net adds its own gradients
into `gradient_merge_<i>.<param>.merged_grad`; the ranks' sums are averaged
only on the step that updates (minigraph.passes.data_parallel). A checkpoint taken mid-accumulation
must therefore not hold one rank's sums: loaded on rank 0 and broadcast, they
would replace every other rank's, and the resumed run would drift from the
uninterrupted one.

`mg.distributed.save` makes the sums global first (`average_merged`): one
`c_allreduce_avg` of the merged gradients, in place on every rank, so every
rank then holds what the file holds. Averaging is linear, so the next update
(the average of each rank's sum plus its later gradients) is the same sum up
to float rounding, and a run resumed from the file (loaded on rank 0, then
broadcast; or loaded on every rank) is bit for bit the run that saved and went
on. The file is the state of the whole job, independent of the world size: it
resumes on any number of ranks, or in one process.

`mg.io.save` of such a net on several ranks mid-accumulation, when the ranks
may hold different sums (they trained since distributed.save averaged them or
broadcast_persistables gave every rank rank 0's), is refused
(`check_saveable`): the file would hold one rank's sums only.
"""
from __future__ import annotations

import weakref

from minigraph.operator import Operator

# net -> the GradientMerge step count at which its merged gradients were last made the
# same on every rank (averaged, or broadcast)
_AVERAGED_AT = weakref.WeakKeyDictionary()


def merged_gradients(net):
    """(GradientMerge, [merged-gradient Variables]) of `net`, or (None, [])."""
    from minigraph.optimizer.gradient_merge import GradientMerge

    merge = getattr(net, "optimizer", None)
    if not isinstance(merge, GradientMerge) or merge.counter is None:
        return None, []
    return merge, list(merge.merged)


def _per_rank(net, size):
    """The step count when `net` is mid-accumulation under data_parallel on `size` > 1
    ranks and its sums have not been averaged since; else None."""
    from minigraph.passes import data_parallel as dp_pass

    if size <= 1 or dp_pass.NAME not in net.applied:
        return None
    merge, sums = merged_gradients(net)
    if merge is None or not sums:
        return None
    count = int(merge.counter.get())
    if count % merge.k_steps == 0 or _AVERAGED_AT.get(net) == count:
        return None
    return count


def average_merged(net, comm):
    """On every rank of `comm`: when `net` (data-parallel, minimised by GradientMerge)
    is mid-accumulation, replace each rank's merged gradients by their average over
    the ranks (one c_allreduce_avg, the net's own collective, under the net's lock).
    Every rank must call it (mg.distributed.save does); the ranks agree on whether
    anything is sent, since the step count is the same on every rank. Returns the
    number of merged gradients averaged (0 when there was nothing to do)."""
    with net._lock:
        count = _per_rank(net, comm.size)
        if count is None:
            return 0
        _, sums = merged_gradients(net)
        net.executor.run([Operator("c_allreduce_avg", x=sums, out=sums)])
        _AVERAGED_AT[net] = count
        return len(sums)


def mark_same(net):
    """Record that every rank now holds the same merged gradients (a broadcast of
    every persistable made them rank 0's): a file written now is what every rank
    holds."""
    merge, sums = merged_gradients(net)
    if merge is not None and sums:
        _AVERAGED_AT[net] = int(merge.counter.get())


def check_saveable(net, what):
    """A ValueError naming `what` when a file written now would hold this rank's merged
    gradients only (see the module doc); mg.io.save calls it."""
    from minigraph.distributed import world

    if not world.is_initialized():
        return
    count = _per_rank(net, world.get_comm().size)
    if count is None:
        return
    merge, _ = merged_gradients(net)
    raise ValueError(
        f"{what}: this data-parallel net is in the middle of a GradientMerge accumulation "
        f"(step {count % merge.k_steps} of {merge.k_steps}), and each rank holds its own "
        "merged gradients: a file written on one rank would resume the others with that "
        "rank's sums. Call mg.distributed.save(net, path) on every rank instead (it averages "
        "them over the ranks first, then rank 0 writes), or save after an update step.")
