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
A bad option value is one line on stderr naming the option, and exit code 2,
never a traceback: the argument helpers below (Parser, int_at_least,
out_folder_problem, launcher_rank, fail) check every value before anything
runs, for this command and the examples alike.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

_RANK_ENV = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK", "SLURM_PROCID")


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line: `prog: error: message (see
    prog --help)`, exit code 2. Sub-command parsers are of this class too."""

    def error(self, message):
        """Print the one-line error and exit with code 2."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def int_at_least(minimum, why=""):
    """An argparse `type=`: an int >= `minimum`; `why` is added to the complaint."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}{why}, got "
                                             f"{text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}{why}, got "
                                             f"{value}")
        return value
    parse.__name__ = f"integer >= {minimum}"
    return parse


def out_folder_problem(out):
    """Why files cannot be written into the folder `out` (created if missing),
    or None when they can. Tries it: creates and removes a temporary file in
    `out`, or in its nearest existing ancestor when `out` does not exist yet
    (permission bits do not stop root; an actual write does tell). An empty name
    is a problem too (it would mean the current directory)."""
    if not str(out).strip():
        return f"must name a folder, got {str(out)!r}"
    path = Path(out)
    if path.exists() and not path.is_dir():
        return f"{str(path)!r} is a file, not a folder"
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        return f"cannot create {str(path)!r}: {str(probe)!r} is a file, not a folder"
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as e:
        where = "write in" if probe == path else f"create {str(path)!r} in"
        return f"cannot {where} {str(probe)!r} ({e.strerror or e})"
    return None


def launcher_rank():
    """This process's rank as an MPI/Slurm launcher announced it (0 when none did):
    who prints a usage error before a communicator exists."""
    for name in _RANK_ENV:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def fail(prog, option, problem, rank=0):
    """Print `prog: error: argument OPTION: PROBLEM` (on rank 0 only); returns 2."""
    if rank == 0:
        print(f"{prog}: error: argument {option}: {problem}", file=sys.stderr)
    return 2


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
