"""Training one net on K processes as if it were one process with K times the batch.

    comm = mg.distributed.init()              # MPI on CPUs; init(place="gpu") -> NCCL
    net = build_net(place=comm.place)          # layers.batch_norm(..., sync=True), or:
    mg.distributed.convert_sync_batchnorm(net)
    mg.optimizer.SGD(0.1).minimize(net, loss)
    mg.distributed.data_parallel(net, batch_size_from="label")   # check, broadcast, average
    net.train(feed={"image": my_slice, ...})   # my_slice may have 0 rows: its loss is 0
    mg.distributed.save(net, "ckpt.npz")       # written by rank 0 only

Communicators (rank, size, allreduce, allgather, broadcast, barrier):
`mpi` (mpi4py; numpy arrays, GPU arrays staged through the host), `nccl`
(nccl4py; GPU arrays) and `local` (one process, no MPI). Launch with the
`mpiexec` next to the Python interpreter: `mpiexec -n 4 python train.py`.

Nothing hangs: every collective has a deadline (init(timeout=...) or
MINIGRAPH_COLLECTIVE_TIMEOUT, 60 s by default), past which every rank still
alive raises CollectiveTimeoutError naming the ranks that did not arrive and
the collective; the order check (on unless MINIGRAPH_CHECK_ORDER=0) makes a
rank that runs different collectives a CollectiveMismatchError naming each
rank's call; data_parallel refuses nets whose persistables differ across ranks
(NetMismatchError naming the first differing variable).

A rank with no rows: its loss (a mean over nothing) is 0 and its gradients are
zeros; with data_parallel(net, batch_size_from=...) each rank's gradient is
weighted by its share of the batch, so the step equals one process on the
other ranks' rows, and sync_batch_norm takes its statistics from those rows.
"""
from minigraph.distributed.agree import SettingsMismatchError
from minigraph.distributed.comm import (
    CollectiveError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    Communicator,
)
from minigraph.distributed.parallel import (
    NetMismatchError,
    broadcast_persistables,
    data_parallel,
    is_writer,
    save,
)
from minigraph.distributed.world import get_comm, init, is_initialized, rank, world_size
from minigraph.passes.sync_bn import convert_sync_batchnorm

__all__ = ["CollectiveError", "CollectiveMismatchError", "CollectiveTimeoutError",
           "Communicator", "NetMismatchError", "SettingsMismatchError", "broadcast_persistables",
           "convert_sync_batchnorm", "data_parallel", "get_comm", "init", "is_initialized",
           "is_writer", "rank", "save", "world_size"]
