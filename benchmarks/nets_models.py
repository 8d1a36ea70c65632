"""The nets of benchmarks/nets_cpu.py (and nets_gpu.py) on minigraph's side, and what
both frameworks' sides share: each net's batch, optimizer and seeded data. The
PyTorch twins are in nets_torch.py.

- digits (64x1x8x8, Momentum(0.1, 0.9)): minigraph.examples.train_digits.build_net,
  conv16-BN-ReLU-maxpool-fc64-BN-ReLU-fc10;
- resnet (32x3x32x32, Momentum(0.1, 0.9)): stem conv16-BN-ReLU, three stages of two
  residual blocks (16; 32 stride 2; 64 stride 2; 3x3 convs without bias, BN, a 1x1
  projection with BN where the shape changes), global average pool, fc10;
- mnist (64x1x28x28, Adam(1e-3)): conv16-BN-ReLU-maxpool, conv32-BN-ReLU-maxpool
  (3x3, padding 1), dropout 0.25, fc128-BN-ReLU, dropout 0.5, fc10;
- mlp (128x784, Adam(1e-3)): fc2048-BN-ReLU, fc2048-BN-ReLU, fc10;
- recipe (64x1x28x28, AdamW(1e-3, weight decay 0.01) with two parameter groups:
  the conv and fc weights decayed, biases and batch-norm scales and shifts not): a
  user's first CNN, conv32-BN-ReLU-maxpool, conv64-BN-ReLU-maxpool (3x3, padding
  1), fc128-BN-ReLU, dropout 0.5, fc10;
- mobile (32x3x32x32, Momentum(0.1, 0.9)): a MobileNet-style net of depthwise
  separable blocks, stem conv32-BN-ReLU, then per block a depthwise 3x3 conv
  (groups = channels) and a pointwise 1x1 conv, each without bias, then BN-ReLU:
  32->64, 64->128 stride 2, 128->128, 128->256 stride 2; global average pool, fc10;
- cifar (64x3x32x32, Adam(1e-3)): a user's CIFAR CNN with other activations and
  pooling, three blocks conv-BN-SiLU-avgpool (32, 64, 128; 3x3, padding 1), then
  fc256-LeakyReLU(0.01), dropout 0.3, fc10.
minigraph runs every BN-ReLU pair as one batch_norm_relu op
(mg.passes.fuse_batch_norm_relu, before minimize); a BN whose output goes to a
residual add stays a batch_norm. The Momentum nets' updates run as one
merged_momentum op (mg.passes.merge_updates, after minimize; PyTorch's SGD gets
foreach=True, its counterpart).
"""
from __future__ import annotations

NETS = {"digits": (64, (1, 8, 8)), "resnet": (32, (3, 32, 32)), "mnist": (64, (1, 28, 28)),
        "mlp": (128, (784,)), "recipe": (64, (1, 28, 28)), "mobile": (32, (3, 32, 32)),
        "cifar": (64, (3, 32, 32))}
ADAM_NETS = ("mnist", "mlp", "cifar")  # trained with Adam(1e-3)
ADAMW_NETS = ("recipe",)               # AdamW(1e-3, WEIGHT_DECAY), two parameter groups
LEARNING_RATE, MOMENTUM = 0.1, 0.9     # the others: Momentum
WEIGHT_DECAY = 0.01
STAGES = ((16, 1), (32, 2), (64, 2))
RECIPE_CONVS = (32, 64)
CIFAR_CONVS = (32, 64, 128)
MOBILE_BLOCKS = ((64, 1), (128, 2), (128, 1), (256, 2))    # (pointwise filters, stride)


def batch(net_name, seed=0, n=None):
    """(images, labels) of `net_name`'s input at its batch size (or `n`), seeded."""
    import numpy as np

    default, chw = NETS[net_name]
    n = default if n is None else n
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n,) + chw, dtype=np.float32),
            rng.integers(0, 10, size=n).astype(np.int64))


def mg_resnet(seed=0, place=None):
    """(net, image, logits, loss): the CIFAR-sized ResNet built with the layer API
    (on `place`, the CPU by default)."""
    import minigraph as mg
    from minigraph import layers

    net = mg.Net(place=place, seed=seed)
    image = layers.data(net, "image", shape=(-1, 3, 32, 32))
    label = layers.data(net, "label", shape=(-1,), dtype="int64")

    def conv_bn(x, filters, size, stride, relu):
        h = layers.conv2d(net, x, num_filters=filters, filter_size=size, stride=stride,
                          padding=size // 2, bias=False)
        h = layers.batch_norm(net, h)
        return layers.relu(net, h) if relu else h

    h, channels = conv_bn(image, 16, 3, 1, True), 16
    for filters, stride in STAGES:
        for block in range(2):
            s = stride if block == 0 else 1
            out = conv_bn(conv_bn(h, filters, 3, s, True), filters, 3, 1, False)
            short = h if (s == 1 and channels == filters) else conv_bn(h, filters, 1, s, False)
            h, channels = layers.relu(net, layers.add(net, out, short)), filters
    return (net, image, *pooled_head(net, h, label))


def pooled_head(net, h, label):
    """(logits, loss) of the ResNet and the mobile net after their last block h: global
    average pool, fc10, mean cross entropy; then BN-ReLU pairs fused, Momentum
    minimised and its updates merged."""
    import minigraph as mg
    from minigraph import layers as L

    h = L.pool2d(net, h, global_pooling=True, pool_type="avg")
    logits = L.fc(net, L.flatten(net, h), size=10)
    loss = L.mean(net, L.softmax_with_cross_entropy(net, logits, label))
    mg.passes.fuse_batch_norm_relu(net)
    mg.optimizer.Momentum(LEARNING_RATE, MOMENTUM).minimize(net, loss)
    mg.passes.merge_updates(net)
    return logits, loss


def mg_mobile(seed=0, place=None):
    """(net, image, logits, loss): the MobileNet-style net built with the layer API
    (on `place`, the CPU by default)."""
    import minigraph as mg
    from minigraph import layers as L

    net = mg.Net(place=place, seed=seed)
    image = L.data(net, "image", shape=(-1, 3, 32, 32))
    label = L.data(net, "label", shape=(-1,), dtype="int64")

    def conv_bn(x, filters, size, stride=1, groups=1):
        h = L.conv2d(net, x, num_filters=filters, filter_size=size, stride=stride,
                     padding=size // 2, groups=groups, bias=False)
        return L.relu(net, L.batch_norm(net, h))

    h, channels = conv_bn(image, 32, 3), 32
    for filters, stride in MOBILE_BLOCKS:
        h = conv_bn(conv_bn(h, channels, 3, stride, groups=channels), filters, 1)
        channels = filters
    return (net, image, *pooled_head(net, h, label))


def mg_cnn(net_name, seed=0, place=None):
    """(net, image, logits, loss): the MNIST CNN, the wide MLP, the CIFAR CNN (minimised
    with Adam) or the recipe (AdamW, two parameter groups), on `place` (the CPU by
    default)."""
    import minigraph as mg
    from minigraph import layers as L

    net = mg.Net(place=place, seed=seed)
    image = L.data(net, "image", shape=(-1,) + NETS[net_name][1])
    label = L.data(net, "label", shape=(-1,), dtype="int64")
    h = image
    if net_name == "cifar":
        for filters in CIFAR_CONVS:
            h = L.conv2d(net, h, num_filters=filters, filter_size=3, padding=1)
            h = L.pool2d(net, L.silu(net, L.batch_norm(net, h)), 2, pool_type="avg")
        h = L.dropout(net, L.leaky_relu(net, L.fc(net, h, 256), alpha=0.01), p=0.3)
    elif net_name in ("mnist", "recipe"):
        for filters in (16, 32) if net_name == "mnist" else RECIPE_CONVS:
            h = L.conv2d(net, h, num_filters=filters, filter_size=3, padding=1)
            h = L.pool2d(net, L.relu(net, L.batch_norm(net, h)), 2)
        if net_name == "mnist":
            h = L.dropout(net, h, p=0.25)
        h = L.dropout(net, L.relu(net, L.batch_norm(net, L.fc(net, h, 128))), p=0.5)
    else:
        for _ in range(2):
            h = L.relu(net, L.batch_norm(net, L.fc(net, h, 2048)))
    logits = L.fc(net, h, 10)
    loss = L.mean(net, L.softmax_with_cross_entropy(net, logits, label))
    mg.passes.fuse_batch_norm_relu(net)
    if net_name in ADAMW_NETS:
        params = net.parameters()
        groups = [{"params": [p for p in params if len(p.shape) >= 2]},
                  {"params": [p for p in params if len(p.shape) < 2], "weight_decay": 0.0}]
        mg.optimizer.AdamW(1e-3, weight_decay=WEIGHT_DECAY).minimize(net, loss,
                                                                     parameters=groups)
    else:
        mg.optimizer.Adam(1e-3).minimize(net, loss)
    return net, image, logits, loss


def mg_net(net_name, place=None):
    """(net, image, logits, loss) of `net_name` on `place` (the CPU by default)."""
    if net_name == "resnet":
        return mg_resnet(place=place)
    if net_name == "mobile":
        return mg_mobile(place=place)
    if net_name in ADAM_NETS + ADAMW_NETS:
        return mg_cnn(net_name, place=place)
    import minigraph as mg
    from minigraph.examples.train_digits import build_net

    net, h = build_net(place=place, seed=0, learning_rate=LEARNING_RATE, momentum=MOMENTUM)
    mg.passes.merge_updates(net)
    return net, h["image"], h["logits"], h["loss"]


def mg_optimized(net):
    """The inference net of `net` (batch norms folded, ops fused)."""
    import minigraph as mg

    return mg.passes.optimize_for_inference(net)
