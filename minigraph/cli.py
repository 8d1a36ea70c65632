"""The `minigraph` command.

    minigraph demo [--model digits|resnet|gpt] [--epochs N] [--device cpu|gpu] [--out DIR]
                   [--seed S] [--batch-size B] [--level layer|op] [--profile]
                   [--no-progress]

trains the digits example (see minigraph.examples.train_digits; --model resnet
trains the residual net of train_resnet_digits, --model gpt the character-level GPT of
train_gpt on Python's own help text), prints the loss and held-out
accuracy per epoch, and writes net.svg (one box per layer; --level op: every
op), training.png, model/ (an inference model) and model.onnx; --profile also
prints where a training step's time goes and writes profile.svg.
A bad option value is one line on stderr naming the option, and exit code 2.
"""
from __future__ import annotations

import sys

from minigraph.cliargs import Parser


def build_parser():
    """The argument parser of the `minigraph` command (one-line errors, exit code 2)."""
    from minigraph import __version__
    from minigraph.examples import train_digits

    parser = Parser(prog="minigraph",
                    description="minigraph: a small operator-graph deep-learning framework.")
    parser.add_argument("--version", action="version", version=f"minigraph {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = commands.add_parser(
        "demo", help="train a small conv net with batch norm on the 8x8 digits",
        description="Train conv -> batch_norm -> relu -> pool -> fc -> batch_norm -> relu -> "
                    "fc on scikit-learn's bundled 8x8 digits; print loss and held-out "
                    "accuracy per epoch; write a picture of the net and a training plot.")
    train_digits.add_arguments(demo)
    demo.set_defaults(command_parser=demo)
    return parser


def main(argv=None):
    """Run the command line `argv` (sys.argv[1:] by default); returns the exit code
    (2 for a usage error, printed as one line)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command == "demo":
            from minigraph.examples import train_digits

            problems = train_digits.check_arguments(args)
            if problems:
                option, problem = problems[0]
                args.command_parser.error(f"argument {option}: {problem}")
    except SystemExit as e:
        return e.code
    if args.command == "demo":
        return train_digits.run(args)
    parser.print_help(sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
