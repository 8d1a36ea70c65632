"""minigraph.handover: which dying inputs a kernel may write into."""
import numpy as np

import minigraph as mg
from minigraph import handover


def donors_of(**values):
    scope = mg.Scope()
    found = []
    for slot, value in values.items():
        var = scope.new_var(slot)
        var.value = value
        found.append((slot, var))
    return tuple(found), found


def test_an_array_only_its_variable_holds_is_handed_over():
    donors, _ = donors_of(x=np.ones((4, 5)))
    assert handover.handed_over(donors) == ("x",)


def test_a_reshaped_temporary_is_handed_over():
    donors, _ = donors_of(x=(np.ones((4, 5)) @ np.ones((5, 6))).reshape(2, 12))
    assert handover.handed_over(donors) == ("x",)


def test_an_array_seen_elsewhere_is_kept():
    a = np.ones((4, 5))
    donors, _ = donors_of(x=a)                       # `a` here refers to it too
    assert handover.handed_over(donors) == ()
    del a
    assert handover.handed_over(donors) == ("x",)


def test_an_array_another_variable_holds_is_kept():
    shared = np.ones(6)
    donors, found = donors_of(x=shared, y=shared)
    del shared
    assert handover.handed_over(donors) == ()
    found[1][1].value = None                         # y released: x alone holds it
    assert handover.handed_over(donors) == ("x",)


def test_an_array_with_a_live_view_is_kept():
    donors, found = donors_of(x=np.ones((3, 4)))
    view = found[0][1].value[1:]
    assert handover.handed_over(donors) == ()
    donors2, _ = donors_of(v=found[0][1].value.reshape(12))
    found[0][1].value = None
    assert handover.handed_over(donors2) == ()      # `view` still sees its memory
    del view
    assert handover.handed_over(donors2) == ("v",)


def test_read_only_partial_and_foreign_memory_are_kept():
    ro = np.ones(4)
    ro.flags.writeable = False
    part = np.ones(8)[:4]                            # a view of part of a temporary
    donors, _ = donors_of(r=ro, p=part, b=np.frombuffer(bytearray(32)),
                          s=np.broadcast_to(np.zeros(()), (3,)))
    del ro, part
    assert handover.handed_over(donors) == ()


def test_donors_are_the_dying_inputs_read_through_one_slot():
    """relu reads its input once: a donor when the input dies there; an add of a value
    with itself, or an input that lives on, is not."""
    net = mg.Net(seed=0)
    x = mg.layers.data(net, "x", shape=(-1, 3))
    h = mg.layers.relu(net, x)
    s = mg.layers.add(net, h, h)
    relu_op, add_op = net.ops("train")[-2:]
    assert relu_op.type == "relu" and add_op.type == "add"
    assert handover.donors(relu_op, [x]) == (("x", x),)
    assert handover.donors(relu_op, []) == ()
    assert handover.donors(add_op, [h]) == ()
    assert s is not None
