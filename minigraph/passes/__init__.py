"""Graph rewrites. Each pass changes a net only through the Net's own API
(append_op, insert_op, replace_op, remove_op) and records itself with
net.mark_applied; the ops it looks at are known only by what their schemas
declare (roles, OpSchema.weight, sync_variant, presummed, replication).

    convert_sync_batchnorm(net)   batch_norm -> sync_batch_norm, in place
    fold_batch_norm(net)          a new infer-only net with batch norms folded into conv/fc
    optimize_for_inference(net)   fold_batch_norm, remove_dropout, then fuse_conv2d
                                  (conv+bias+residual+relu+2x2 max pool) and fuse_fc
                                  (mul+bias+residual+relu or gelu; also the infer branch
                                  of a training net, in place), then fuse_separable_conv2d
                                  (a depthwise fused conv + a 1x1 one, NCHW)
    remove_dropout(net)           an inference net's dropouts removed, in place
    fuse_batch_norm_relu(net)     batch_norm + relu -> batch_norm_relu, in place, in both
                                  branches (and their grad ops after minimize)
    merge_updates(net)            the optimizer's per-parameter update ops -> one merged op
                                  per run (momentum -> merged_momentum), in place
    data_parallel.rewrite(net)    gradient averaging (see minigraph.distributed.data_parallel)
"""
from minigraph.passes.fold_bn import FoldNote, fold_batch_norm
from minigraph.passes.fuse import FuseNote, fuse_conv2d, fuse_fc, optimize_for_inference
from minigraph.passes.fuse_bn_relu import FusedPair, fuse_batch_norm_relu
from minigraph.passes.fuse_separable import fuse_separable_conv2d
from minigraph.passes.merge_updates import MergedRun, merge_updates
from minigraph.passes.remove_dropout import remove_dropout
from minigraph.passes.sync_bn import convert_sync_batchnorm

__all__ = ["FoldNote", "FuseNote", "FusedPair", "MergedRun", "convert_sync_batchnorm",
           "fold_batch_norm", "fuse_batch_norm_relu", "fuse_conv2d", "fuse_fc",
           "fuse_separable_conv2d", "merge_updates", "optimize_for_inference",
           "remove_dropout"]
