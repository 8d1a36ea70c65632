"""The registry (minigraph/schema.py): kernels by (op, device, float dtypes), the kernel
context, exporters, roles."""
import numpy as np
import pytest
from helpers import call_kernel

import minigraph as mg
from minigraph.schema import (
    ROLES,
    KernelContext,
    Meta,
    OpSchema,
    Slot,
    get_schema,
    kernel,
    op_for_role,
    ops_with_role,
    register,
    registered_ops,
)

register(OpSchema(type="test_two_kernels", inputs=(Slot("x"), Slot("y")), outputs=(Slot("out"),),
                  infer=lambda ins, attrs: {"out": Meta(ins["x"].shape, ins["x"].dtype)},
                  no_export="a test op"))
kernel("test_two_kernels", "cpu", lambda op, ins, ctx: {"out": ins["x"] + 1},
       dtypes=("float32",))
kernel("test_two_kernels", "cpu", lambda op, ins, ctx: {"out": ins["x"] + 2},
       dtypes=("float32", "float64"))
kernel("test_two_kernels", "gpu", lambda op, ins, ctx: {"out": ins["x"]}, dtypes=("float32",))


def two_kernels_op():
    scope = mg.Scope()
    return mg.Operator("test_two_kernels", **{n: scope.new_var(n) for n in ("x", "y", "out")})


def test_the_first_kernel_that_takes_every_float_input_runs():
    op = two_kernels_op()
    f32, f64 = np.zeros(2, np.float32), np.zeros(2)
    assert call_kernel(op, {"x": f32, "y": f32})["out"].tolist() == [1, 1]
    assert call_kernel(op, {"x": f32, "y": f64})["out"].tolist() == [2, 2]    # y: float64
    assert call_kernel(op, {"x": f64, "y": np.zeros(2, np.int64)})["out"].tolist() == [2, 2]


def test_no_kernel_for_the_dtypes_or_the_device_is_an_error_naming_them():
    op, f16 = two_kernels_op(), np.zeros(2, np.float16)
    with pytest.raises(mg.OpError, match=r"test_two_kernels: input 'x' has dtype float16; the "
                                         r"CPU kernels take float32 or float64$"):
        call_kernel(op, {"x": f16, "y": f16})
    with pytest.raises(mg.OpError, match=r"input 'y' has dtype float64; the GPU kernels take "
                                         r"float32 \(run float16 on the CPU\)"):
        op.schema.kernel_for("gpu", {"x": np.zeros(1, np.float32), "y": np.zeros(1)})
    with pytest.raises(mg.OpError, match="test_two_kernels: no kernel for TPU places; it has "
                                         "CPU, GPU"):
        op.schema.kernel_for("tpu", {"x": f16, "y": f16})


def test_the_runner_picks_the_kernel_for_each_new_signature():
    scope = mg.Scope()
    x, y, out = (scope.new_var(n) for n in ("x", "y", "out"))
    op = mg.Operator("test_two_kernels", x=x, y=y, out=out)
    ex = mg.Executor()
    x.set(np.zeros(2, np.float32))
    y.set(np.zeros(2, np.float32))
    assert ex.run([op], scope, fetch=[out])[0].tolist() == [1, 1]
    y.set(np.zeros(2))
    assert ex.run([op], scope, fetch=[out])[0].tolist() == [2, 2]


def test_the_kernel_context_says_what_the_runner_gives():
    ctx = KernelContext(mg.CPUPlace(), room=100)
    given = ctx.with_donated(("x",))
    assert (given.donated, given.room, given.place) == (("x",), 100, ctx.place)
    assert ctx.donated == () and KernelContext().room is None
    assert KernelContext().comm.size == 1            # made on first use: a world of one


def library_ops():
    """The registered ops of minigraph's op library (the tests register test_* ops)."""
    return [t for t in registered_ops() if not t.startswith("test_")]


def test_every_op_exports_or_says_why_not():
    for op_type in library_ops():
        schema = get_schema(op_type)
        assert (schema.export is None) == bool(schema.no_export), op_type
        if op_type.endswith("_grad"):
            assert schema.export is None, op_type


def test_the_ops_of_an_inference_graph_export():
    """Every forward op a layer builds for inference has an exporter."""
    for op_type in ("relu", "sigmoid", "tanh", "gelu", "leaky_relu", "silu", "softmax",
                    "conv2d", "fused_conv2d", "pool2d", "mul", "fused_fc", "elementwise_add", "add",
                    "multiply", "batch_norm", "sync_batch_norm", "batch_norm_relu",
                    "sync_batch_norm_relu", "dropout", "concat",
                    "reshape", "flatten", "transpose", "mean", "sum", "argmax", "accuracy",
                    "softmax_with_cross_entropy", "fill_constant"):
        assert get_schema(op_type).export is not None, op_type


def test_roles_are_declared_and_shared():
    for op_type in library_ops():
        assert set(get_schema(op_type).roles) <= set(ROLES), op_type
    assert ops_with_role("batch_norm") == ["batch_norm", "batch_norm_relu", "sync_batch_norm",
                                           "sync_batch_norm_relu"]
    assert ops_with_role("batch_norm_relu") == ["batch_norm_relu", "sync_batch_norm_relu"]
    assert ops_with_role("linear") == ["conv2d", "mul"]
    assert op_for_role("accumulate") == "sum" and op_for_role("fused_conv") == "fused_conv2d"
    assert op_for_role("matrix_product") == "mul" and op_for_role("fused_fc") == "fused_fc"
    with pytest.raises(mg.OpError, match="role 'batch_norm' needs exactly one op, found "
                                         "batch_norm, batch_norm_relu, sync_batch_norm"):
        op_for_role("batch_norm")
    with pytest.raises(mg.OpError, match="unknown role 'bn'; roles: accumulate, add"):
        ops_with_role("bn")
    for op_type in ops_with_role("linear"):
        slot, _, _ = get_schema(op_type).weight
        assert get_schema(op_type).slot(slot) is not None, op_type


def test_registering_an_undeclared_role_or_a_type_twice_is_an_error():
    with pytest.raises(ValueError, match="unknown role 'fuse_me'"):
        register(OpSchema(type="test_bad_role", inputs=(), outputs=(), roles=("fuse_me",)))
    with pytest.raises(ValueError, match="'relu' is already registered"):
        register(OpSchema(type="relu", inputs=(), outputs=()))
    assert "test_bad_role" not in registered_ops()
