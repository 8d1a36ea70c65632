"""What the ONNX tests share: running an exported file in onnxruntime and in onnx's
reference evaluator, and comparing every output with net.infer."""
import numpy as np
import onnx
import onnxruntime as ort
from onnx.reference import ReferenceEvaluator

# 1e-5 relative; near 0 an absolute 1e-6 of the tensor's scale: a value near 0 that is a
# sum of larger float32 terms keeps their rounding (~1e-7 of them each)
RTOL, ATOL = 1e-5, 1e-6


def assert_close(got, want, msg=""):
    scale = max(1.0, float(np.abs(want).max())) if want.size and want.dtype.kind == "f" else 1.0
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL * scale, err_msg=msg)


def onnx_outputs(path, feed, runtimes=("ort", "reference")):
    """{runtime: [outputs]} of the model at `path` on `feed`, runtime 'ort'
    (onnxruntime) and 'reference' (onnx.reference.ReferenceEvaluator)."""
    out = {}
    if "ort" in runtimes:
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        out["ort"] = session.run(None, feed)
    if "reference" in runtimes:
        out["reference"] = ReferenceEvaluator(str(path)).run(None, feed)
    return out


def max_differences(net, path, fetches, feed_fn, feed_names, sizes=(1, 7),
                    runtimes=("ort", "reference")):
    """Check every output of the model at `path` against net.infer at each batch size
    (one file) in each of `runtimes`; return {(runtime, n): largest |difference|}."""
    onnx.checker.check_model(onnx.load(str(path)), full_check=True)
    worst = {}
    for n in sizes:
        feed = feed_fn(np.random.default_rng(n), n)
        feed = {k: feed[k] for k in feed_names}
        want = net.infer(feed=feed, fetch=fetches)
        for runtime, got in onnx_outputs(path, feed, runtimes).items():
            assert len(got) == len(want)
            diff = 0.0
            for w, g in zip(want, got):
                g = np.asarray(g)
                assert g.shape == w.shape, (runtime, n)
                assert g.dtype == w.dtype, (runtime, n)
                assert_close(g, w, f"{runtime}, N={n}")
                if w.size:
                    diff = max(diff, float(np.abs(g.astype(np.float64) - w).max()))
            worst[runtime, n] = diff
    return worst
