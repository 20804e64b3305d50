"""The command line: ``python -m mxload`` and the ``mxload`` console script
(the same program): ``bench``, ``profile``, ``info``, ``help``, ``--version``.

Every mistake in the command line ends the program with one line on stderr
and exit status 2; a failure in the user's own code (a factory that raises, a
dataset that fails) shows the user's traceback, then one line of ours, with
exit status 1.  Progress is drawn on stderr only when it is a terminal.
"""
from __future__ import annotations

import argparse
import difflib
import importlib
import json
import os
import sys
import traceback
from collections.abc import Sequence
from typing import Any, NoReturn

from ._version import __version__

PROG = "mxload"
USAGE_ERROR = 2   # as argparse and most Unix tools
USER_CODE_ERROR = 1


class UsageError(Exception):
    """A mistake in the command line: reported as one line, exit status 2."""


class UserCodeError(Exception):
    """The user's code raised: their traceback is printed, then this message."""

    def __init__(self, message: str, cause: BaseException):
        super().__init__(message)
        self.cause = cause


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad option is one line (what was wrong, where to look)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: error: {message} (see '{self.prog} --help')")


def _int_at_least(low: int, name: str) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            what = "a positive integer" if low == 1 else f"an integer >= {low}"
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return value
    parse.__name__ = name   # argparse names the type in some messages
    return parse


# ------------------------------------------------------------------ bench


def _bench_parser(sub: Any) -> None:
    from .synthetic import WORKLOADS
    p = sub.add_parser(
        "bench", help="throughput on built-in synthetic data, against in-process and torch loading",
        description="Time mxload on built-in synthetic workloads (generated in memory) against "
                    "in-process loading (num_workers=0) and, when torch is installed, "
                    "torch.utils.data.DataLoader with the same workers; print a table and the "
                    "profiler's verdict per run.")
    p.add_argument("--workers", type=_int_at_least(0, "--workers"), nargs="+", default=[2], metavar="N",
                   help="worker counts, one row each (default: 2)")
    p.add_argument("--batches", type=_int_at_least(1, "--batches"), default=60, metavar="N",
                   help="batches timed per loader, split over its rounds (default: 60)")
    p.add_argument("--rounds", type=_int_at_least(3, "--rounds"), default=5, metavar="N",
                   help="alternated rounds per loader, each a fresh epoch timed after its first batch; "
                        "workers are advised for or against only when their rounds and in-process "
                        "loading's do not overlap (default: 5: equal loaders fail to overlap by chance "
                        "under 1%% of the time)")
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), metavar="NAME",
                   help=f"any of {', '.join(WORKLOADS)} (default: all)")
    p.add_argument("--no-torch", action="store_true", help="skip the torch baseline")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress line (it is only drawn when stderr is a terminal anyway)")
    p.set_defaults(run=_bench)


def _bench(args: argparse.Namespace) -> int:
    from .synthetic import WORKLOADS
    unknown = [w for w in args.workloads if w not in WORKLOADS]
    if unknown:
        raise UsageError(f"{PROG} bench: error: unknown workload {unknown[0]!r}; choose from "
                         f"{', '.join(WORKLOADS)}")
    if len(set(args.workers)) != len(args.workers):
        raise UsageError(f"{PROG} bench: error: --workers lists a count twice: {args.workers}")
    if max(args.workers) > 256:
        raise UsageError(f"{PROG} bench: error: --workers {max(args.workers)} is more than 256")
    from ._bench import bench
    return bench(args, sys.stdout, sys.stderr)


# ------------------------------------------------------------------ profile


def _profile_parser(sub: Any) -> None:
    p = sub.add_parser(
        "profile", help="profile your own loader: MODULE:FACTORY returns a dataset or a DataLoader",
        description="Profile a loader and print the report (where the time goes, per field and "
                    "per worker, and a verdict). FACTORY, a module-level function of MODULE (a "
                    "module name on sys.path or the current folder, or a path to a .py file), "
                    "is called without arguments and returns a dataset or a DataLoader.")
    p.add_argument("factory", metavar="MODULE:FACTORY")
    p.add_argument("--batch-size", type=_int_at_least(1, "--batch-size"), default=32, metavar="N",
                   help="batch size when FACTORY returns a dataset (default: 32)")
    p.add_argument("--workers", type=_int_at_least(0, "--workers"), default=2, metavar="N",
                   help="num_workers when FACTORY returns a dataset (default: 2)")
    p.add_argument("--batches", type=_int_at_least(1, "--batches"), default=100, metavar="N",
                   help="batches to profile, at most one epoch (default: 100)")
    p.add_argument("--trace", metavar="OUT.json", help="also write a Chrome/Perfetto trace here")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress line on a terminal")
    p.set_defaults(run=_profile)


def _without_our_frames(error: BaseException) -> str:
    """The traceback of `error`, without this module's and importlib's frames:
    what is left is the user's code (and whatever it called)."""
    te = traceback.TracebackException.from_exception(error)
    ours = (os.path.abspath(__file__), os.path.abspath(importlib.__file__ or ""))
    frames = [f for f in te.stack
              if os.path.abspath(f.filename) not in ours and not f.filename.startswith("<frozen importlib")]
    te.stack = traceback.StackSummary.from_list(frames)
    return "".join(te.format())


def _load_factory(spec: str) -> Any:
    """MODULE:FACTORY (MODULE may be a path to a .py file) -> the callable."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"{PROG} profile: error: expected MODULE:FACTORY (e.g. mydata:make_dataset or "
                         f"path/to/mydata.py:make_dataset), got {spec!r}")
    if module_name.endswith(".py") or os.sep in module_name:
        path = os.path.abspath(module_name)
        if not os.path.isfile(path):
            raise UsageError(f"{PROG} profile: error: no such file: {module_name}")
        sys.path.insert(0, os.path.dirname(path))
        module_name = os.path.splitext(os.path.basename(path))[0]
    else:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and module_name.split(".")[0] == e.name.split(".")[0] \
                and module_name.startswith(e.name):
            raise UsageError(f"{PROG} profile: error: no module named {e.name!r} (looked in the current "
                             f"folder and sys.path; pass a path/to/file.py:FACTORY instead)") from None
        raise UserCodeError(f"importing {module_name!r} failed with {type(e).__name__}", e) from None
    except Exception as e:
        raise UserCodeError(f"importing {module_name!r} failed with {type(e).__name__}", e) from None
    factory = getattr(module, attr, None)
    if factory is None:
        names = [n for n in dir(module) if not n.startswith("_")]
        close = difflib.get_close_matches(attr, names, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise UsageError(f"{PROG} profile: error: module {module_name!r} has no attribute {attr!r}{hint}")
    if not callable(factory):
        raise UsageError(f"{PROG} profile: error: {spec} is a {type(factory).__name__}, not a function "
                         f"that returns a dataset or a DataLoader")
    return factory


def _profile(args: argparse.Namespace) -> int:
    if args.trace:
        folder = os.path.dirname(os.path.abspath(args.trace))
        if not os.path.isdir(folder):
            raise UsageError(f"{PROG} profile: error: --trace {args.trace}: folder {folder} does not exist")
    factory = _load_factory(args.factory)
    from . import DataLoader
    from ._bench import Progress
    from .profiler import profile
    try:
        made = factory()
    except Exception as e:
        raise UserCodeError(f"{args.factory}() raised {type(e).__name__}", e) from None
    if isinstance(made, DataLoader):
        loader = made
    else:
        if not (hasattr(made, "__getitem__") or hasattr(made, "__iter__")):
            raise UsageError(f"{PROG} profile: error: {args.factory}() returned a "
                             f"{type(made).__name__}, not a dataset (__getitem__ and __len__, or "
                             f"__iter__) or a DataLoader")
        try:
            loader = DataLoader(made, batch_size=args.batch_size, num_workers=args.workers, shuffle=
                                not (hasattr(made, "__iter__") and not hasattr(made, "__getitem__")))
        except (TypeError, ValueError) as e:
            raise UsageError(f"{PROG} profile: error: cannot build a DataLoader from what "
                             f"{args.factory}() returned: {e}") from None
    progress = Progress(sys.stderr, not args.no_progress)
    try:
        with profile(loader) as prof:
            it = iter(loader)
            try:
                total = min(args.batches, len(it))
            except TypeError:   # an IterableDataset without a length
                total = args.batches
            done = 0
            for _ in it:
                done += 1
                progress.show(f"profiling: {done}/{total} batches")
                if done >= total:
                    break
            it.close()
            progress.clear()
            report = prof.report()
            if args.trace:
                prof.save_chrome_trace(args.trace)
    except Exception as e:
        progress.clear()
        raise UserCodeError(f"loading batches from {args.factory}() failed with {type(e).__name__}",
                            e) from None
    finally:
        loader.close()
    print(json.dumps(report.to_dict(), indent=2) if args.json else report)
    if args.trace:
        print(f"\ntrace written to {args.trace} (open it in https://ui.perfetto.dev or chrome://tracing)")
    return 0


# ------------------------------------------------------------------ info, help


def _info(args: argparse.Namespace) -> int:
    from ._info import show_config
    show_config()
    return 0


def _parser() -> _Parser:
    parser = _Parser(
        prog=PROG,
        description="mxload: a fast, reliable multi-process data loader. Run as 'mxload' or "
                    "'python -m mxload' (the same program).",
        epilog=f"'{PROG} help COMMAND' (or '{PROG} COMMAND --help') describes a command.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    _bench_parser(sub)
    _profile_parser(sub)
    sub.add_parser("info", help="how this mxload was built and what the platform offers",
                   description="Print the version, the compiled core's build flags, numpy's "
                               "version, the start method and the platform's capabilities."
                   ).set_defaults(run=_info)
    helper = sub.add_parser("help", help="show this help, or a command's: help COMMAND",
                            description="Show the help of mxload or of one command.")
    helper.add_argument("topic", nargs="?", metavar="COMMAND")
    helper.set_defaults(run=None)
    return parser


def _help(parser: _Parser, topic: str | None) -> int:
    if topic is None:
        parser.print_help()
        return 0
    if topic not in ("bench", "profile", "info", "help"):
        raise UsageError(f"{PROG} help: error: unknown command {topic!r}; choose from bench, profile, "
                         f"info, help")
    try:
        parser.parse_args([topic, "--help"])
    except SystemExit as e:   # argparse exits after printing the help
        return int(e.code or 0)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with `argv` (default: ``sys.argv[1:]``); returns the exit status."""
    parser = _parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:
            prog = f"{PROG} {args.command}" if args.command else PROG
            raise UsageError(f"{prog}: error: unrecognized arguments: {' '.join(extra)} "
                             f"(see '{prog} --help')")
        if args.command is None:
            parser.print_help(sys.stderr)
            return USAGE_ERROR
        if args.run is None:
            return _help(parser, args.topic)
        return int(args.run(args))
    except UsageError as e:
        print(e, file=sys.stderr)
        return USAGE_ERROR
    except UserCodeError as e:
        sys.stderr.write(_without_our_frames(e.cause))
        print(f"{PROG}: error: {e} (traceback above)", file=sys.stderr)
        return USER_CODE_ERROR
    except KeyboardInterrupt:
        print(f"\n{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
