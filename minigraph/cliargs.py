"""Command-line arguments checked before anything runs (the `minigraph`
command and the examples): every bad value is one line on stderr that names
the option, and exit code 2, never a traceback.
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
