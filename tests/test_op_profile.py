"""benchmarks/op_profile.py (nets_cpu.py --profile): the costliest op types of a step,
minigraph's kernel choices for the net's own shapes, and the lines printed."""
from __future__ import annotations

import argparse

import pytest
from benchmark_modules import import_benchmarks

import minigraph as mg
from minigraph.kernels.cpu import choices


@pytest.fixture(scope="module")
def bench():
    return import_benchmarks("nets_cpu", "op_profile")


def test_top_rows_are_the_costliest_without_the_rest(bench):
    _, op_profile = bench
    rows = [("mul", 2.0, 0.2), ("(executor)", 9.0, 0.5), ("adam", 5.0, 0.25),
            ("relu", 0.5, 0.05)]
    assert op_profile.top_rows(rows, top=2) == [["adam", 5.0, 0.25], ["mul", 2.0, 0.2]]


def test_a_choice_reads_as_its_fields_without_the_build(bench):
    _, op_profile = bench
    key = "conv2d_dw|NCHW|1024x1x8x8|16x3x3|s1x1|p1x1|d1x1||t2|b52ff55ffaf952a5e8f08"
    assert op_profile.choice_label(key) == "conv2d_dw NCHW 1024x1x8x8 16x3x3 s1x1 p1x1 d1x1 t2"
    assert op_profile.choice_label("fc|128x784x2048|bias1") == "fc 128x784x2048 bias1"


def test_the_lines_put_both_frameworks_side_by_side(bench):
    _, op_profile = bench
    mine = {"train": [["mul_grad", 16.75, 0.5]], "infer": [["fused_fc", 5.87, 0.98]],
            "choices": {"fc_dw|128x784x2048|t2|b0123456789abcdef": "blas"}}
    theirs = {"train": [["aten::mm", 17.34, 0.34]], "infer": [["aten::addmm", 10.51, 0.95]]}
    assert op_profile.profile_lines("mlp", mine, theirs) == [
        "mlp minigraph train, ms per step: mul_grad 16.75 (50%)",
        "mlp pytorch train, ms per step: aten::mm 17.34 (34%)",
        "mlp minigraph infer, ms per step: fused_fc 5.87 (98%)",
        "mlp pytorch infer, ms per step: aten::addmm 10.51 (95%)",
        "mlp minigraph kernel choices (kind, shape, threads: option): fc_dw 128x784x2048 "
        "t2: blas"]
    assert op_profile.profile_lines("x", {**mine, "choices": {}}, theirs)[-1].endswith(
        "none made")


def test_the_minigraph_profile_worker_times_its_ops_and_names_its_own_choices(bench,
                                                                              monkeypatch):
    """The worker of `nets_cpu.py --profile` on the digits net: kernel time in the
    training step's and the optimized inference's op types (the inference ran its
    kernels, not past the timers), and only choices the net itself looked up."""
    nets_cpu, op_profile = bench
    seen, pick, top_rows = set(), choices.pick, op_profile.top_rows
    # every op type kept: which ones rank in the top TOP depends on the machine
    monkeypatch.setattr(op_profile, "top_rows", lambda rows: top_rows(rows, top=1000))

    def looked_up(kind, key, options, default):
        seen.add(f"{kind}|{key}")
        return pick(kind, key, options, default)
    monkeypatch.setattr(choices, "pick", looked_up)     # recording_choices wraps it in turn
    other = "fc|1x2x3|t9|b0123456789abcdef"           # a choice kept for another net
    monkeypatch.setattr(choices, "chosen", lambda: {other: "blas",
                                                    **{k: "native" for k in seen}})
    args = argparse.Namespace(what="profile", net="digits", threads=1, warmup=2, repeat=2)
    threads = mg.get_num_threads()
    try:
        got = nets_cpu.mg_worker(args)
    finally:
        mg.set_num_threads(threads)
    train = {name: ms for name, ms, _ in got["train"]}
    infer = {name: ms for name, ms, _ in got["infer"]}
    assert len(train) > op_profile.TOP and {"conv2d_grad", "batch_norm_relu", "mul_grad"} <= set(train)
    assert all(ms > 0 for ms in train.values())
    assert "fused_fc" in infer and all(ms > 0 for ms in infer.values())
    assert seen and got["choices"] == {k: "native" for k in seen}
