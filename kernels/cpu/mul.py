"""CPU kernels of mul (ops/mul.py): x flattened to a matrix, times y, by fc_native's
few-rows kernel for float32 products of at most fc_native.ROWS_MAX rows (a generated
token's), else by fc_native's training kernel (the weight packed block by block as it
is used) or BLAS, whichever was the faster for the shape on this machine (choices.py,
kind "mm"); mul_grad's input gradient the same way; and of fused_fc (ops/fused_fc.py):
the same product with its bias and relu, by the native kernel on the weight packed
once (fc_native.py) or by BLAS with the bias and relu in place, whichever was the
faster for the shape on this machine (choices.py; the native kernel where nothing is
timed) where the native kernel takes the product, else by BLAS's product with the
bias and relu in place (mul's and elementwise_add's bits where mul runs on BLAS),
then a residual and gelu (add's and gelu's bits); and of fused_fc_group (ops/
fused_fc_group.py): its products in one call to fc_native's few-rows group kernel,
else each as fused_fc's; either fused op first normalises x by layer_norm's kernel
where it was folded in. Weight gradients run wgrad_native's kernel, fc_native's
training kernel or BLAS's product, whichever was the faster (weight_grad).
"""
from __future__ import annotations

import functools
import math

import numpy as np

from minigraph.kernels.cpu import (
    activation,
    blocks,
    choices,
    fc_native,
    gelu_native,
    layer_norm,
    native,
    prepared,
    wgrad_native,
)


def as_matrix(x, n):
    """x viewed as (prod(x.shape[:n]), prod(x.shape[n:]))."""
    return x.reshape(math.prod(x.shape[:n]), math.prod(x.shape[n:]))


def product(x2, y):
    """x2 @ y: by fc_native's kernel for a few rows on the weight as it lies where it
    takes them (a generated token's products), else by fc_native's training kernel or
    BLAS, whichever was the faster for the shape on this machine where the kernel
    takes the product (trained_product), else by BLAS."""
    if fc_native.rows_supports(x2, y):
        return fc_native.rows_forward(x2, y)
    return trained_product(x2, y)


def trained_product(a, b, a_transposed=False, b_transposed=False):
    """A @ B with A = a or a.T, B = b or b.T: by fc_native.train_product (the weight
    packed block by block as it is used) or BLAS, whichever was the faster for the
    shape and transposes on this machine (choices.py, kind "mm"; BLAS where nothing
    is timed) where the kernel takes the product, else by BLAS."""
    left, right = (a.T if a_transposed else a), (b.T if b_transposed else b)
    if not fc_native.train_supports(a, b, a_transposed, b_transposed):
        return left @ right
    (m, k), n = left.shape, right.shape[1]
    sides = ("t" if a_transposed else "n") + ("t" if b_transposed else "n")
    key = (f"{m}x{k}x{n}|{sides}|t{blocks.get_num_threads()}"
           f"|b{native.build_key('fc_native')}")
    return choices.choose("mm", key, {
        "native": lambda: fc_native.train_product(a, b, a_transposed, b_transposed),
        "blas": lambda: left @ right}, "blas")


def mul_cpu(op, ins, ctx):
    """out = flatten(x) @ y, reshaped to x.shape[:n] + (M,)."""
    x, y = ins["x"], ins["y"]
    n = op.attrs["x_num_col_dims"]
    if n == x.ndim - 1:                         # a product on the last axis (linear's)
        shape, k = x.shape, x.shape[-1]
        rows = x.size // k if k else math.prod(shape[:n])
        return {"out": product(x.reshape(rows, k), y).reshape(shape[:n] + (y.shape[1],))}
    return {"out": product(as_matrix(x, n), y).reshape(x.shape[:n] + (y.shape[1],))}


def weight_grad(x2, d2):
    """x2.T @ d2 (x2 (R, K), d2 (R, M)): by wgrad_native's kernel, fc_native's
    training kernel (x2 read transposed) or BLAS, whichever was the faster for the
    shape on this machine among those that take the product (choices.py, kind
    "fc_dw"), else by BLAS (blas_weight_grad)."""
    options = {"blas": lambda: blas_weight_grad(x2, d2)}
    if wgrad_native.supports(x2, d2):
        options["native"] = lambda: wgrad_native.product(x2, d2)
    if fc_native.train_supports(x2, d2, True, False):
        options["panels"] = lambda: fc_native.train_product(x2, d2, True, False)
    if len(options) == 1:
        return blas_weight_grad(x2, d2)
    (r, k), m = x2.shape, d2.shape[1]
    key = (f"{r}x{k}x{m}|t{blocks.get_num_threads()}"
           f"|b{native.build_key('wgrad_native')}{native.build_key('fc_native')}")
    return choices.choose("fc_dw", key, options, "blas")


def blas_weight_grad(x2, d2):
    """x2.T @ d2 by BLAS, computed as (d2.T @ x2).T when K < M and K < R: OpenBLAS runs
    a product of few output rows over a long inner dimension an order of magnitude
    slower on two threads than one (a (128, 4096) @ (4096, 512) weight gradient: 350 ms
    against 28 ms for the (512, 128) one), and the transpose is then a copy of a small
    result. Over a short inner dimension the direct product is the faster, and the
    transposed copy of a large result is not small: the wide MLP's (784, 128) @ (128,
    2048) took 2.3 ms, against 7.2 ms that way."""
    r, k = x2.shape
    if k < d2.shape[1] and k < r:
        return np.ascontiguousarray((d2.T @ x2).T)
    return x2.T @ d2


def mul_grad_cpu(op, ins, ctx):
    """dx = dout2 @ y.T reshaped to x's shape; dy = x2.T @ dout2."""
    x, y, d = ins["x"], ins["y"], ins["dout"]
    n = op.attrs["x_num_col_dims"]
    d2 = d.reshape(math.prod(x.shape[:n]), y.shape[1])
    out = {}
    if op.wants("dx"):
        out["dx"] = trained_product(d2, y, b_transposed=True).reshape(x.shape)
    if op.wants("dy"):
        out["dy"] = weight_grad(as_matrix(x, n), d2)
    return out


def fused_fc_cpu(op, ins, ctx):
    """out = act(flatten(x') @ y + bias + residual), shaped x.shape[:n] + (M,) (broadcast
    with the residual's shape), x' x or its normalisation (normalized_x): the native
    kernel where it takes the product and the weight is fixed (it makes y read-only),
    fc_native's few-rows kernel (with a residual of the product's shape), else BLAS's
    product with the bias and relu in place; then what is left of the residual and
    activation. The unfused ops' bits: layer_norm's, mul's (where its product runs on
    BLAS), elementwise_add's, add's, relu's (NaN stays NaN) and gelu's."""
    x, y, bias, residual = normalized_x(op, ins), ins["y"], ins.get("bias"), ins.get("residual")
    n, act = op.attrs["x_num_col_dims"], op.attrs["activation"]
    x2, shape = as_matrix(x, n), x.shape[:n] + (y.shape[1],)
    relu = act == "relu" and residual is None         # in the product's own epilogue
    rows_residual = residual is None or (residual.shape == shape
                                         and fc_native.residual_fits(residual))
    if op.attrs["weight_fixed"] and fc_native.supports(x2, y):
        out = choices.choose("fc", _fixed_key(x2, y, bias, relu), {
            "native": lambda: fc_native.forward(x2, y, bias, relu),
            "blas": lambda: _product_bias_relu(x2, y, bias, relu)}, "native")
    elif residual is not None and rows_residual and fc_native.rows_supports(x2, y, bias):
        out, residual = fc_native.rows_forward(x2, y, bias, act == "relu", residual), None
        relu = act == "relu"
    else:
        out = _product_bias_relu(x2, y, bias, relu)
    out = out.reshape(shape)
    if residual is not None:
        out = np.add(out, residual, out=out if residual.shape == shape else None)
    if act == "relu" and not relu:
        blocks.relu(out, out=out)
    return {"out": activation.gelu(out, out=out) if act == "gelu" else out}


def normalized_x(op, ins):
    """A fused op's x, or with attribute normalize layer_norm's y of it over the axes
    from x_num_col_dims (norm_scale, norm_bias, norm_epsilon; layer_norm's bits)."""
    a = op.attrs
    if not a["normalize"]:
        return ins["x"]
    return layer_norm.normalized_input(op, ins["x"], ins.get("norm_scale"),
                                       ins.get("norm_bias"), a["x_num_col_dims"],
                                       a["norm_epsilon"])


def _bound_x(op, x, norm_scale, norm_bias, kept):
    """(the product's x, the calls to run before it) for a bound form: x and none, or
    layer_norm's prepared call into a kept array and it; None where that does not
    apply (the kernel runs)."""
    a = op.attrs
    if not a["normalize"]:
        return x, ()
    done = layer_norm.prepared_rows(x, norm_scale, norm_bias, a["x_num_col_dims"],
                                    a["norm_epsilon"], kept)
    return None if done is None else (done[0], (done[2],))


def _product_bias_relu(x2, y, bias, relu):
    """act(x2 @ y + bias), act = max(., 0) (NaN stays NaN) where relu: fc_native's
    few-rows kernel where it takes the product, else BLAS's product with the bias and
    relu in place on it (the bits of the bound form's _blas_into, and of mul and
    elementwise_add where mul's product runs on BLAS)."""
    if fc_native.rows_supports(x2, y, bias):
        return fc_native.rows_forward(x2, y, bias, relu)
    out = x2 @ y
    if bias is not None:
        out += bias
    if relu:
        np.maximum(out, 0, out=out)
    return out


def bind_fused_fc(op):
    """fused_fc_cpu's bound form (minigraph.bound_run): x's normalisation (layer_norm's
    prepared call, where the op normalises x), its product, bias, residual and
    activation into the same arrays every run, prepared again only when an input is
    another array. The product: for a fixed weight (weight_fixed) that fc_native takes,
    the option its choice names (fc_native's kernel on the packed weight, or BLAS's),
    the residual and relu after it; else fc_native's few-rows call, then gelu's; else
    BLAS's and numpy's. None (the kernel runs) for a residual of another shape than the
    product's, for gelu without its native kernel (float64), and for a normalisation
    without layer_norm's bound form (norm_epsilon 0, or no native kernel)."""
    n, act = op.attrs["x_num_col_dims"], op.attrs["activation"]
    kept, kept_norm = {"key": None}, {}

    def prepare(x, y, bias, residual, norm_scale, norm_bias):
        if not (x.flags.c_contiguous and x.dtype == y.dtype and x.size
                and (bias is None or (bias.dtype == x.dtype and bias.flags.c_contiguous))):
            return None
        done = _bound_x(op, x, norm_scale, norm_bias, kept_norm)
        if done is None:
            return None
        x, before = done
        shape = x.shape[:n] + (y.shape[1],)
        if residual is not None and (residual.shape != shape or residual.dtype != x.dtype
                                     or not residual.flags.c_contiguous):
            return None
        key = (x.shape, y.shape, x.dtype)
        if key != kept["key"]:
            out2 = prepared.aligned_empty((math.prod(x.shape[:n]), y.shape[1]), x.dtype)
            kept.update(key=key, out2=out2, out={"out": out2.reshape(shape)})
        x2, out2 = x.reshape(kept["out2"].shape[0], -1), kept["out2"]
        if op.attrs["weight_fixed"] and fc_native.supports(x2, y):
            calls = [*before, _fixed_product(x2, y, bias, act == "relu" and residual is None,
                                             out2)]
            if residual is not None:
                calls.append(functools.partial(np.add, out2, residual.reshape(out2.shape),
                                               out=out2))
                if act == "relu":
                    calls.append(functools.partial(blocks.relu, out2, out=out2))
        elif fc_native.rows_supports(x2, y, bias) and fc_native.residual_fits(residual):
            calls = [*before, fc_native.prepared_rows(x2, y, bias, act == "relu", out2,
                                                      residual)]
        else:
            calls = [*before, functools.partial(_blas_into, x2, y, bias, residual,
                                                act == "relu", out2)]
        if act == "gelu":
            calls.append(gelu_native.prepared_forward(out2, out2))
            if calls[-1] is None:
                return None
        return _one_call(calls), kept["out"]
    return prepared.form(("x", "y", "bias", "residual", "norm_scale", "norm_bias"), prepare,
                         streamed=("x", "residual"))


def _fixed_key(x2, y, bias, relu):
    """The choice key of a fixed weight's product (fused_fc)."""
    (m, k), build = x2.shape, native.build_key("fc_native")
    return (f"{m}x{k}x{y.shape[1]}|bias{int(bias is not None)}|relu{int(relu)}"
            f"|t{blocks.get_num_threads()}|b{build}")


def _fixed_product(x2, y, bias, relu, out):
    """The product of a fixed weight as fused_fc_cpu's choice runs it (fc_native's
    kernel, or _product_bias_relu's way), into `out`, prepared; prepared again where
    fc_native's kernel runs and the weight was made writeable since (it packs it
    anew)."""
    def prepare():
        if fc_native.rows_supports(x2, y, bias):
            other = fc_native.prepared_rows(x2, y, bias, relu, out)
        else:
            other = functools.partial(_blas_into, x2, y, bias, None, relu, out)
        made = []                   # the native call, prepared (the weight packed) when
                                    # first timed or picked, then timed as it runs

        def native():
            if not made:
                made.append(fc_native.prepared_forward(x2, y, bias, relu, out))
            return made[0]
        name = choices.pick("fc", _fixed_key(x2, y, bias, relu), {
            "native": lambda: native()(), "blas": other}, "native")
        return (native(), True) if name == "native" else (other, False)
    kept = list(prepare())                  # [the call, whether it reads the packed copy]

    def call():
        if kept[1] and y.flags.writeable:
            kept[:] = prepare()
        kept[0]()
    return call


def _blas_into(x2, y, bias, residual, relu, out):
    """out = act(x2 @ y + bias + residual) by BLAS, the bias, the residual (the
    product's size) and relu in place (fused_fc's bits)."""
    np.matmul(x2, y, out=out)
    if bias is not None:
        np.add(out, bias, out=out)
    if residual is not None:
        np.add(out, residual.reshape(out.shape), out=out)
    if relu:
        blocks.relu(out, out=out)


def fused_fc_group_cpu(op, ins, ctx):
    """out[g] = flatten(x') @ y[g] + bias[g], shaped x.shape[:n] + (M_g,), x' x or its
    normalisation (normalized_x): fc_native's group kernel in one call where it takes
    every product (a generated token's), else each product as fused_fc_cpu runs it
    without a fixed weight (the same bits)."""
    x, ys = normalized_x(op, ins), ins["y"]
    biases = ins.get("bias") or [None] * len(ys)
    n = op.attrs["x_num_col_dims"]
    x2 = as_matrix(x, n)
    if _group_fits(x2, ys, biases):
        outs = [np.empty((x2.shape[0], y.shape[1]), x.dtype) for y in ys]
        fc_native.prepared_rows_group(x2, ys, biases, outs)()
    else:
        outs = [_product_bias_relu(x2, y, b, False) for y, b in zip(ys, biases)]
    return {"out": [out.reshape(x.shape[:n] + (out.shape[1],)) for out in outs]}


def _group_fits(x2, ys, biases):
    return len(ys) <= fc_native.GROUP_MAX and all(
        fc_native.rows_supports(x2, y, b) for y, b in zip(ys, biases))


def bind_fused_fc_group(op):
    """fused_fc_group_cpu's bound form (minigraph.bound_run): x's normalisation as
    bind_fused_fc's, then the products into the same arrays every run, by one prepared
    group call where it takes them, else each as bind_fused_fc runs it (prepared again
    only when an input is another array)."""
    n = op.attrs["x_num_col_dims"]
    kept, kept_norm = {"key": None}, {}

    def prepare(x, ys, biases, norm_scale, norm_bias):
        biases = biases or [None] * len(ys)
        if not (x.flags.c_contiguous and x.size and all(y.dtype == x.dtype for y in ys)
                and all(b is None or b.dtype == x.dtype for b in biases)):
            return None
        done = _bound_x(op, x, norm_scale, norm_bias, kept_norm)
        if done is None:
            return None
        x, before = done
        key = (x.shape, x.dtype, tuple(y.shape for y in ys))
        if key != kept["key"]:
            rows = math.prod(x.shape[:n])
            outs2 = [prepared.aligned_empty((rows, y.shape[1]), x.dtype) for y in ys]
            kept.update(key=key, outs2=outs2, out={"out": [
                o.reshape(x.shape[:n] + (o.shape[1],)) for o in outs2]})
        outs2 = kept["outs2"]
        x2 = x.reshape(outs2[0].shape[0], -1)
        if _group_fits(x2, ys, biases):
            calls = [fc_native.prepared_rows_group(x2, ys, biases, outs2)]
        else:
            calls = [fc_native.prepared_rows(x2, y, b, False, out)
                     if fc_native.rows_supports(x2, y, b)
                     else functools.partial(_blas_into, x2, y, b, None, False, out)
                     for y, b, out in zip(ys, biases, outs2)]
        return _one_call([*before, *calls]), kept["out"]
    return prepared.form(("x", "y", "bias", "norm_scale", "norm_bias"), prepare,
                         lists=("y", "bias"))


def _one_call(calls):
    """A function of no arguments running `calls` in order."""
    return calls[0] if len(calls) == 1 else functools.partial(_each, tuple(calls))


def _each(calls):
    for call in calls:
        call()
