"""benchmarks/nets_gpu.py without a GPU: its arguments, the alternating rounds and their
time budget, the markdown tables (the header gpu_check.py copies into RESULTS.md), the
gpu_check `nets` step that carries them (the GPT among its default cases), and the
minigraph worker's cases, the GPT's included, run end to end on the fake driver
(kernels that do nothing). Nothing here imports PyTorch."""
from __future__ import annotations

import importlib.util
import pathlib
import shutil
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
spec = importlib.util.spec_from_file_location("nets_gpu", ROOT / "benchmarks" / "nets_gpu.py")
ng = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ng)


def test_arguments():
    args = ng.parse_args([])
    assert args.cases == list(ng.CASES) and args.rounds == 3 and not args.quick
    assert ("resnet", 128) in args.cases and ("mlp", 1024) in args.cases
    assert {("digits", 64), ("resnet", 32), ("mnist", 64), ("mlp", 128)} <= set(args.cases)
    assert ("gpt", 32) in args.cases                # the example's GPT at its own batch
    assert ng.parse_args(["--cases", "gpt:8", "--profile-case", "gpt:4"]).cases == [("gpt", 8)]
    quick = ng.parse_args(["--quick", "--cases", "mlp:8"])
    assert (quick.rounds, quick.repeat, quick.cases) == (1, 3, [("mlp", 8)])
    with pytest.raises(SystemExit):
        ng.parse_args(["--cases", "vgg:8"])
    with pytest.raises(SystemExit):
        ng.parse_args(["--rounds", "0"])


def fake_result(scale):
    return {f"{name}:{n}:{t}": {"train": scale * n, "infer": scale * n / 2, "peak_mib": 10.0 * n}
            for name, n in ng.CASES for t in (0, 1)}


def test_rounds_alternate_and_stop_at_the_budget():
    args = ng.parse_args(["--rounds", "4", "--budget-s", "5"])
    order, now = [], [0.0]

    def run(kind, _):
        order.append(kind)
        now[0] += 2.0
        return fake_result(1.0 if kind == "minigraph" else 2.0)
    got = ng.rounds(args, run=run, clock=lambda: now[0])
    assert order == ["minigraph", "pytorch", "pytorch", "minigraph"]     # 8 s > 5 s: stop
    assert len(got) == 2


def test_the_tables_are_markdown_with_the_results_header():
    args = ng.parse_args([])
    got = [(fake_result(1.0), fake_result(2.0)), (fake_result(1.5), fake_result(2.0))]
    profile = {"step_ms": 3.0, "timed_step_ms": 4.0, "ops": [["backward:3 conv2d_grad", 1.5,
                                                             0.4]]}
    text = ng.markdown(args, got, profile, 2)
    lines = text.splitlines()
    header = "| net | batch | step | minigraph ms | PyTorch ms | ratio |"
    assert lines.count(header) == 2                         # TF32 off, then on
    assert "| resnet | 128 | train | 160.00 | 256.00 | 0.62 |" in lines
    assert "| mlp | 1024 | infer | 640.00 | 1024.00 | 0.62 |" in lines
    assert "| net | batch | minigraph MiB | PyTorch MiB | ratio |" in lines
    assert "| backward:3 conv2d_grad | 1.500 | 40.0% |" in lines
    rows = [line for line in lines if line.startswith("| ") and "train" in line]
    assert len(rows) == 2 * len(ng.CASES)


def test_gpu_check_runs_it_as_the_nets_step_and_keeps_its_tables(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" /
                                                  "gpu_check.py")
    gc = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = gc
    spec.loader.exec_module(gc)
    assert gc.STEP_NAMES[-2:] == ("bench", "nets")
    output = "\n".join(["warming", "TF32 off on both sides.", "", "| a | b |", "|---|---|",
                        "| 1 | 2 |", "", "written to docs/performance.md"])
    assert gc.nets_tables([output]) == ["TF32 off on both sides.", "", "| a | b |", "|---|---|",
                                        "| 1 | 2 |"]
    (nets,) = {s.name: s for s in gc.gpu_steps()}["nets"].commands
    assert nets[1] == "benchmarks/nets_gpu.py" and "--cases" not in nets   # every case: the GPT's
    step = gc.Step("nets", "tables", [[sys.executable, "-c", f"print({output!r})"]],
                   markdown=gc.nets_tables)
    results = tmp_path / "RESULTS.md"
    assert gc.run_steps([step], results, timeout=60) == 0
    text = results.read_text()
    assert "\n| 1 | 2 |\n" in text.split("````text")[0]        # a table, not inside the log


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ for the emulator")
def test_the_minigraph_worker_runs_its_cases_on_the_fake_driver():
    from kernel_emulator import fake_pycuda

    args = ng.parse_args(["--quick", "--cases", "digits:8", "mlp:16"])
    with fake_pycuda.FakeCuda(devices=1, run_kernels=False).install():
        got = ng.mg_worker(args)
    assert set(got) == {"digits:8:0", "digits:8:1", "mlp:16:0", "mlp:16:1"}
    for result in got.values():
        assert result["train"] > 0 and result["infer"] > 0 and result["peak_mib"] > 0


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ for the emulator")
def test_the_minigraph_worker_runs_the_gpt_on_the_fake_driver(monkeypatch):
    from kernel_emulator import fake_pycuda

    monkeypatch.setattr(ng, "TOP", 1000)     # every op: which ten cost most is the load's
    args = ng.parse_args(["--quick", "--cases", "gpt:2", "--profile-case", "gpt:2"])
    with fake_pycuda.FakeCuda(devices=1, run_kernels=False).install():
        got = ng.mg_worker(args)
        profile = ng.profile_worker(args)
    assert set(got) == {"gpt:2:0", "gpt:2:1"}
    for result in got.values():
        assert result["train"] > 0 and result["infer"] > 0 and result["peak_mib"] > 0
    times = [ms for _, ms, _ in profile["ops"]]
    assert profile["step_ms"] > 0 and 10 < len(times) < ng.TOP
    assert times == sorted(times, reverse=True)
    assert any("scaled_dot_product_attention" in name for name, _, _ in profile["ops"])


def test_the_gpt_case_feeds_both_sides_the_same_batch_and_weights():
    import numpy as np

    from minigraph.examples import train_gpt as G

    tokens, targets, vocab = ng.gpt.gpt_batch(3)
    cfg = ng.gpt.config()
    assert cfg == G.Config() and tokens.shape == targets.shape == (3, cfg.context)
    assert tokens.dtype == targets.dtype == np.int64 and 0 <= tokens.min() <= tokens.max() < vocab
    np.testing.assert_array_equal(tokens[:, 1:], targets[:, :-1])      # next characters
    again, _, _ = ng.gpt.gpt_batch(3)
    np.testing.assert_array_equal(tokens, again)                        # seeded
    weights = ng.gpt.initial_weights(vocab)
    net, _ = ng.gpt.mg_train_net(vocab)
    assert set(weights) == {p.name for p in net.parameters()}
    for p in net.parameters():                                          # the same init
        np.testing.assert_array_equal(weights[p.name], p.get())
    # the names the PyTorch twin reads (gpt_torch_side.torch_gpt)
    block = [f"h0.{s}" for s in ("ln1.scale", "ln1.bias", "attn.q.w", "attn.k.b",
                                  "attn.out.w", "fc.w", "proj.b", "ln2.scale")]
    assert {"wte.w", "wpe.w", "ln_f.scale", "ln_f.bias", *block} <= set(weights)
