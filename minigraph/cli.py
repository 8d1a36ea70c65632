"""The `minigraph` command.

    minigraph demo [--epochs N] [--device cpu|gpu] [--out DIR] [--seed S]

trains the digits example (see minigraph.examples.train_digits), prints the
loss and held-out accuracy per epoch, and writes net.svg and training.png.
"""
from __future__ import annotations

import argparse
import sys


def build_parser():
    """The argument parser of the `minigraph` command."""
    from minigraph import __version__
    from minigraph.examples import train_digits

    parser = argparse.ArgumentParser(
        prog="minigraph",
        description="minigraph: a small operator-graph deep-learning framework.")
    parser.add_argument("--version", action="version", version=f"minigraph {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = commands.add_parser(
        "demo", help="train a small conv net with batch norm on the 8x8 digits",
        description="Train conv -> batch_norm -> relu -> pool -> fc -> batch_norm -> relu -> "
                    "fc on scikit-learn's bundled 8x8 digits; print loss and held-out "
                    "accuracy per epoch; write a picture of the net and a training plot.")
    train_digits.add_arguments(demo)
    return parser


def main(argv=None):
    """Run the command line `argv` (sys.argv[1:] by default); returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        from minigraph.examples import train_digits

        return train_digits.run(args)
    parser.print_help(sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
