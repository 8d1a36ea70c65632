"""Where a net's step goes, for nets_cpu.py --profile: each framework's costliest op
types of a training step and of an inference, and the kernel choices minigraph made on
this machine, so that one run on another CPU says which ops lose there.

minigraph: net.profile (each kernel timed) on the training net and on its optimized
inference net; PyTorch: torch.profiler's self CPU time per aten op over as many steps.
Both take `steps` steps after the worker's warm-up; times are ms per step.
"""
from __future__ import annotations

import re

TOP = 6                     # op types shown per step
STEPS = 10                  # steps timed, after the worker's warm-up


def top_rows(rows, top=TOP):
    """[(name, ms per step, share of the step)] -> the `top` costliest, as
    [[name, ms, share]] (JSON), the executor's or framework's rest left out."""
    kept = sorted((r for r in rows if not r[0].startswith("(")), key=lambda r: -r[1])
    return [[name, round(ms, 3), round(share, 3)] for name, ms, share in kept[:top]]


def recording_choices():
    """From now on, the (kind, key) of every kernel choice this process looks up is
    added to the set returned (choices.pick wrapped; choose calls it), so that
    mg_profile lists this net's choices, not every one kept for the machine."""
    from minigraph.kernels.cpu import choices

    used, pick = set(), choices.pick

    def recorded(kind, key, options, default):
        used.add(f"{kind}|{key}")
        return pick(kind, key, options, default)
    choices.pick = recorded
    return used


def mg_profile(net, loss, fast, logits_name, feed, steps, used):
    """{"train": top rows, "infer": top rows, "choices": {kind|key: option}} of
    minigraph's training net (fetching `loss`), of its inference net `fast`, and the
    choices among `used` (recording_choices) in effect."""
    from minigraph.kernels.cpu import choices

    train = net.profile(feed, steps=steps, mode="train", fetch=[loss])
    infer = fast.profile({"image": feed["image"]}, steps=steps, mode="infer",
                         fetch=[logits_name])
    return {"train": top_rows([(r.name, r.ms, r.share) for r in train.by_type]),
            "infer": top_rows([(r.name, r.ms, r.share) for r in infer.by_type]),
            "choices": {k: v for k, v in choices.chosen().items() if k in used}}


def torch_profile(step, infer, steps):
    """{"train": top rows, "infer": top rows} of PyTorch's `step` and `infer` (functions
    of no arguments): self CPU time per aten op, ms per step."""
    from torch.profiler import ProfilerActivity, profile

    out = {}
    for what, run in (("train", step), ("infer", infer)):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                run()
        events = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in events) or 1.0
        out[what] = top_rows([(e.key, e.self_cpu_time_total / 1e3 / steps,
                               e.self_cpu_time_total / total) for e in events])
    return out


def profile_lines(net, mine, theirs):
    """The lines nets_cpu.py prints for one net: each framework's top op types per
    step, then minigraph's kernel choices of this net's shapes."""
    def ops(rows):
        return ", ".join(f"{name} {ms:.2f} ({100 * share:.0f}%)" for name, ms, share in rows)
    lines = [f"{net} {fw} {what}, ms per step: {ops(side[what])}"
             for what in ("train", "infer") for fw, side in (("minigraph", mine),
                                                              ("pytorch", theirs))]
    picks = ", ".join(f"{choice_label(key)}: {pick}"
                      for key, pick in sorted(mine["choices"].items()))
    lines.append(f"{net} minigraph kernel choices (kind, shape, threads: option): "
                 f"{picks or 'none made'}")
    return lines


def choice_label(key):
    """A choice's key (choices.py: kind|shape...|tN|b<build digest>) as words: its
    fields without the build's digest and the empty ones."""
    fields = key.split("|")
    if re.fullmatch(r"b[0-9a-f]{8,}", fields[-1]):
        fields = fields[:-1]
    return " ".join(f for f in fields if f)
