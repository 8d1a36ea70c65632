"""net.summary(): a table of what each layer built."""
from __future__ import annotations


def summary(net):
    """Per layer: name, op types (train path), output shape, parameter count;
    then the totals of trainable and non-trainable values the layers created
    (optimizer state is not counted)."""
    rows = [("layer", "ops", "output shape", "params")]
    for rec in net.layers:
        ops = ", ".join(dict.fromkeys(rec.op_types)) or "-"
        shape = "?" if rec.output_shape is None else _shape(rec.output_shape)
        rows.append((f"{rec.name} ({rec.kind})", ops, shape,
                     f"{rec.trainable + rec.non_trainable:,}"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    rule = "-" * (sum(widths) + 6)

    def line(r):
        return "  ".join(c.ljust(w) if i < 3 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(r, widths))).rstrip()

    trainable = sum(r.trainable for r in net.layers)
    frozen = sum(r.non_trainable for r in net.layers)
    out = [line(rows[0]), rule] + [line(r) for r in rows[1:]] + [rule,
           f"trainable parameters:     {trainable:,}",
           f"non-trainable values:     {frozen:,}",
           f"total:                    {trainable + frozen:,}"]
    return "\n".join(out)


def _shape(shape):
    return "(" + ", ".join("N" if d < 0 else str(d) for d in shape) + ("," if len(shape) == 1
                                                                        else "") + ")"
