"""batch_norm gradients (x, scale, bias) against finite differences."""
import numpy as np
import pytest
from helpers import helper_test_op
from references import batch_norm

rng = np.random.default_rng(0)


def bn_reference(x, estimated_mean, estimated_var, scale, bias, num_batches=None,
                 data_layout="NCHW", **attrs):
    """references.batch_norm's y, called as helper_test_op calls a reference."""
    return {"y": batch_norm(x, estimated_mean, estimated_var, scale, bias, num_batches,
                            data_layout, **attrs)["y"]}


def bn_inputs(shape, layout, counter=True):
    c = shape[1] if layout == "NCHW" else shape[-1]
    ins = {"x": 3.0 + 2.0 * rng.standard_normal(shape),
           "estimated_mean": rng.standard_normal(c), "estimated_var": rng.uniform(0.5, 2.0, c),
           "scale": rng.uniform(0.5, 1.5, c), "bias": rng.standard_normal(c)}
    if counter:
        ins["num_batches"] = np.array(3, dtype=np.int64)
    return ins


@pytest.mark.parametrize("shape, layout", [
    ((3, 2, 3, 2), "NCHW"), ((3, 2, 3, 2), "NHWC"), ((6, 3), "NCHW"), ((6, 3), "NHWC"),
])
@pytest.mark.parametrize("use_global_est", [False, True])
def test_batch_norm_grads(shape, layout, use_global_est):
    attrs = {"data_layout": layout, "use_global_est": use_global_est, "epsilon": 1e-3}
    helper_test_op("batch_norm", bn_inputs(shape, layout, counter=not use_global_est), attrs,
                   bn_reference, grad_wrt=("x", "scale", "bias"), outputs=("y",),
                   grad_atol=1e-6, grad_rtol=1e-5)
