import numpy as np
import pytest

import minigraph as mg


def test_new_var_find_var_walks_up_to_parents():
    root = mg.Scope()
    x = root.new_var("x")
    child = root.new_scope()
    grandchild = child.new_scope()
    assert child.find_var("x") is x
    assert grandchild.find_var("x") is x
    assert child.find_local_var("x") is None
    assert root.find_var("nope") is None


def test_child_var_shadows_parent_and_is_invisible_to_parent():
    root = mg.Scope()
    outer = root.new_var("h")
    kid = root.new_scope()
    inner = kid.new_var("h")
    assert kid.find_var("h") is inner
    assert root.find_var("h") is outer


def test_creating_a_name_twice_in_one_scope_is_an_error():
    scope = mg.Scope()
    scope.new_var("x")
    with pytest.raises(ValueError, match="'x' already exists"):
        scope.new_var("x")
    scope.new_scope().new_var("x")          # another scope may reuse it


def test_drop_kids_forgets_child_scopes():
    root = mg.Scope()
    root.new_scope()
    root.new_scope()
    assert len(root.kids) == 2
    root.drop_kids()
    assert root.kids == []


def test_variable_value_shape_dtype_and_flags():
    scope = mg.Scope()
    v = scope.new_var("w", persistable=True, trainable=True)
    assert v.persistable and v.trainable
    assert v.shape is None and v.dtype is None
    with pytest.raises(ValueError, match="has no value"):
        v.get()
    v.declare((-1, 3), "float32")
    assert v.shape == (-1, 3) and v.dtype == np.float32
    v.set(np.zeros((2, 3), np.float64))
    assert v.shape == (2, 3) and v.dtype == np.float64
    assert isinstance(v.get(), np.ndarray)
    assert scope.new_var("e").persistable is False
