"""Undoing a build: what Net.building saves before a layer builds and puts back when
it raises (the sections' lengths, the scopes' variables, the names, the data
declarations, the fork, the twins and the layer records)."""
from __future__ import annotations


def snapshot(net):
    """What `restore` needs to put `net`'s build state back as it is now."""
    scopes = (net.scope, *net.scopes.values())
    return ({s: len(ops) for s, ops in net._sections.items()},
            [(s, dict(s.vars)) for s in scopes], dict(net._name_counts),
            dict(net.data_vars), net.forked, dict(net._twins), len(net.layers))


def restore(net, snap):
    """Put `net`'s build state back to `snap` (from `snapshot`), dropping its plans."""
    sizes, scopes, counts, data, forked, twins, layers = snap
    for s, n in sizes.items():
        del net._sections[s][n:]
    for scope, vars_ in scopes:
        scope.vars = vars_
    net._name_counts, net.data_vars, net.forked, net._twins = counts, data, forked, twins
    del net.layers[layers:]
    net._changed()
