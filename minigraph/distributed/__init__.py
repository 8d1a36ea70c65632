"""Training one net on K processes as if it were one process with K times the batch.

    comm = mg.distributed.init()              # MPI on CPUs; init(place="gpu") -> NCCL
    net = build_net(place=comm.place)          # layers.batch_norm(..., sync=True), or:
    mg.distributed.convert_sync_batchnorm(net)
    mg.optimizer.SGD(0.1).minimize(net, loss)
    mg.distributed.data_parallel(net)          # broadcast from rank 0, average gradients
    net.train(feed={"image": my_slice, ...})
    mg.distributed.save(net, "ckpt.npz")       # written by rank 0 only

Communicators (rank, size, allreduce, allgather, broadcast, barrier):
`mpi` (mpi4py; numpy arrays, GPU arrays staged through the host), `nccl`
(nccl4py; GPU arrays) and `local` (one process, no MPI). Launch with the
`mpiexec` next to the Python interpreter: `mpiexec -n 4 python train.py`.
MINIGRAPH_CHECK_ORDER=1 verifies that every rank makes the same collective
calls in the same order and fails with a message instead of hanging.
"""
from minigraph.distributed.comm import CollectiveMismatchError, Communicator
from minigraph.distributed.parallel import (
    broadcast_persistables,
    data_parallel,
    is_writer,
    save,
)
from minigraph.distributed.world import get_comm, init, is_initialized, rank, world_size
from minigraph.passes.sync_bn import convert_sync_batchnorm

__all__ = ["CollectiveMismatchError", "Communicator", "broadcast_persistables",
           "convert_sync_batchnorm", "data_parallel", "get_comm", "init", "is_initialized",
           "is_writer", "rank", "save", "world_size"]
