import numpy as np
import pytest

import minigraph as mg
from minigraph.schema import get_schema, registered_ops


def _vars(scope, *names):
    return [scope.new_var(n) for n in names]


def test_unknown_op_type_lists_registered_ops():
    with pytest.raises(mg.OpError, match=r"unknown op type 'batchnorm'; registered: .*batch_norm"):
        mg.Operator("batchnorm")


def test_every_registered_op_has_a_cpu_kernel_and_valid_schema():
    for op_type in registered_ops():
        schema = get_schema(op_type)
        assert "cpu" in schema.kernels, op_type
        if not op_type.startswith("test_"):              # ops the tests register for themselves
            assert "gpu" in schema.kernels, f"{op_type} has no GPU kernel"
        names = [s.name for s in schema.inputs + schema.outputs] + [a.name for a in schema.attrs]
        assert len(names) == len(set(names)), op_type
        for out_slot, in_slot in schema.inplace.items():
            assert schema.slot(out_slot) in schema.outputs and schema.slot(in_slot) in schema.inputs


def test_attrs_are_read_only():
    scope = mg.Scope()
    x, y, out = _vars(scope, "x", "y", "out")
    op = mg.Operator("elementwise_add", x=x, y=y, out=out, axis=1)
    with pytest.raises(TypeError, match="elementwise_add: attributes are immutable"):
        op.attrs["axis"] = 0
    with pytest.raises(TypeError, match="immutable"):
        del op.attrs["axis"]
    with pytest.raises(AttributeError):
        op.attrs = {"axis": 0}
    assert op.attrs["axis"] == 1 and dict(op.attrs) == {"axis": 1}


def test_slot_binding_errors_name_the_slot():
    scope = mg.Scope()
    x, y, out = _vars(scope, "x", "y", "out")
    with pytest.raises(mg.OpError, match=r"elementwise_add: missing slot 'y'; valid names: x, y, out, axis"):
        mg.Operator("elementwise_add", x=x, out=out)
    with pytest.raises(mg.OpError, match="slot 'x' takes a Variable, got ndarray"):
        mg.Operator("elementwise_add", x=np.zeros(2), y=y, out=out)
    with pytest.raises(mg.OpError, match="slot 'x' takes a list of Variables"):
        mg.Operator("sum", x=[x, "y"], out=out)
    op = mg.Operator("sum", x=x, out=out)          # a single Variable is a list of one
    assert op.inputs["x"] == [x]


def test_attribute_type_and_value_errors():
    scope = mg.Scope()
    x, y, out = _vars(scope, "x", "y", "out")
    with pytest.raises(mg.OpError, match="attribute 'axis' must be int, got str"):
        mg.Operator("elementwise_add", x=x, y=y, out=out, axis="1")
    with pytest.raises(mg.OpError, match="attribute 'axis' must be int, got bool"):
        mg.Operator("elementwise_add", x=x, y=y, out=out, axis=True)
    with pytest.raises(mg.OpError, match="attribute 'axis' must be -1"):
        mg.Operator("elementwise_add", x=x, y=y, out=out, axis=-3)
    op = mg.Operator("elementwise_add", x=x, y=y, out=out, axis=np.int64(2))
    assert type(op.attrs["axis"]) is int


def test_outputs_get_declared_shape_and_dtype_from_inference():
    scope = mg.Scope()
    x, y, out = _vars(scope, "x", "y", "out")
    x.declare((-1, 4, 5), "float32")
    y.declare((4,), "float32")
    mg.Operator("elementwise_add", x=x, y=y, out=out, axis=1)
    assert out.shape == (-1, 4, 5) and out.dtype == np.float32
    z = scope.new_var("z")
    z.declare((3,), "float32")
    with pytest.raises(mg.OpError, match="elementwise_add: input 'y' must have shape \\(4,\\)"):
        mg.Operator("elementwise_add", x=x, y=z, out=scope.new_var("o2"), axis=1)


def test_as_operator_builds_from_an_op_desc_and_refuses_anything_else():
    """Net.append_op / insert_op / replace_op take an Operator or an OpDesc."""
    from minigraph.operator import as_operator
    from minigraph.schema import OpDesc

    x = mg.Variable("x")
    op = mg.Operator("relu", x=x, out=mg.Variable("y"))
    assert as_operator(op) is op
    built = as_operator(OpDesc("relu", {"x": x, "out": mg.Variable("z")}))
    assert isinstance(built, mg.Operator) and built.type == "relu"
    with pytest.raises(TypeError, match="expected an Operator or an OpDesc, got str"):
        as_operator("relu")
