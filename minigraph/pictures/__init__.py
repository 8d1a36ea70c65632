"""Pictures of a net, and where its time goes.

render.py: `to_dot` / `render` (what `net.to_dot` and `net.render` call),
choosing a view: the op view (op_view.py), the layer view (layer_view.py),
the backward ladder (backward_view.py), drawn with the DOT building blocks of
dot.py; layer_map.py says which layer each op belongs to; dot_runner.py runs
Graphviz (or graphviz-pure). profile.py is `net.profile` (time per op type
and per layer), summary.py `net.summary` (the table of layers). Nothing here
imports minigraph.net: the Net calls in.
"""
