"""Command-line plumbing shared by `python -m cupool`, the examples and the benchmarks: a user's
mistake (a bad argument, a missing file, a budget too small, no GPU) ends in one line on stderr
and exit code 2, never a traceback; a bug still shows its traceback.

    p = CLIParser(prog="bench_x.py", description=__doc__)
    p.add_argument("--rows", type=positive_int, default=32)
    sys.exit(run(main, p))          # main(args) -> int
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Callable


def user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that are a user's mistake: their message is the whole story."""
    from cupool._cuda import CupyMissingError, NoGPUError, UnsupportedGPUError
    from cupool.budget import BudgetError
    from cupool.checkpoints import CheckpointError
    errs: list[type[BaseException]] = [ValueError, FileNotFoundError,
                                       IsADirectoryError, NotADirectoryError, PermissionError,
                                       NoGPUError, CupyMissingError, UnsupportedGPUError,
                                       BudgetError, CheckpointError, MemoryError]
    try:
        from cupool.adapters import UnsupportedModelError
        errs.append(UnsupportedModelError)
    except ImportError:
        pass
    return tuple(errs)


class CLIParser(argparse.ArgumentParser):
    """argparse, with errors as one line: "<prog>: error: <message>" and exit code 2."""

    def error(self, message: str):  # noqa: D102 (argparse's hook)
        self.exit(2, f"{self.prog}: error: {message}\n")


def fail(prog: str, message: str) -> int:
    """Print the one-line error and return the exit code 2."""
    text = " ".join(str(message).split())               # one line, whatever the message held
    print(f"{prog}: error: {text}", file=sys.stderr)
    return 2


def run(main: Callable[[argparse.Namespace], int | None], parser: argparse.ArgumentParser,
        argv=None) -> int:
    """Parse `argv` with `parser` and call main(args); user errors end as `fail` does."""
    args = parser.parse_args(argv)
    try:
        rc = main(args)
    except KeyboardInterrupt:
        return 130
    except user_errors() as e:
        return fail(parser.prog, e)
    return 0 if rc is None else int(rc)


# --- argument types (argparse turns their ValueError/ArgumentTypeError into a one-line error) ----
def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def positive_int(text: str) -> int:
    v = _int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {v}")
    return v


def nonnegative_int(text: str) -> int:
    v = _int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {v}")
    return v


def promote(text: str) -> int | str:
    """A promotion cap (`cupool.Pool.promote`): "auto" or an integer >= 0 (0: no cap)."""
    if text.strip() == "auto":
        return "auto"
    try:
        return nonnegative_int(text)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"must be 'auto' or an integer >= 0, got {text!r}") \
            from e


def port(text: str) -> int:
    v = _int(text)
    if not 1 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port in [1, 65535], got {v}")
    return v


def _float(text: str, ok, want: str) -> float:
    """float(text) if it is finite and ok(value), else the argparse error saying `want`."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(v) and ok(v)):
        raise argparse.ArgumentTypeError(f"must be {want}, got {text}")
    return v


def fraction(text: str) -> float:
    """A number in (0, 1]."""
    return _float(text, lambda v: 0 < v <= 1, "a number in (0, 1]")


def nonnegative_float(text: str) -> float:
    return _float(text, lambda v: v >= 0, "a finite number >= 0")


def size(text: str) -> int:
    """Bytes from '24GiB', '512MiB', '40GB' or a plain integer."""
    from cupool.budget import parse_bytes
    try:
        return parse_bytes(int(text) if text.strip().isdigit() else text, "size")
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e).replace("size=", "")) from None


def existing_file(text: str) -> Path:
    p = Path(text)
    if not p.is_file():
        raise argparse.ArgumentTypeError(f"{text}: no such file")
    return p


def existing_dir(text: str) -> Path:
    p = Path(text)
    if not p.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: no such directory")
    return p


# --- argument types for the benchmarks and examples ----------------------------------------------
def positive_float(text: str) -> float:
    """A finite number > 0."""
    return _float(text, lambda v: v > 0, "a finite number > 0")


def bounded_int(low: int, high: int | None = None, multiple_of: int = 1) -> Callable[[str], int]:
    """An argument type for integers in [low, high] (no upper bound when high is None) that are
    multiples of `multiple_of`: bounded_int(2) for '--tokens' of a decode that needs two."""
    where = f">= {low}" if high is None else f"in [{low}, {high}]"
    where = (f"a multiple of {multiple_of} " + ("and " if high is None else "") + where
             if multiple_of > 1 else f"an integer {where}")

    def parse(text: str) -> int:
        v = _int(text)
        if v < low or (high is not None and v > high) or v % multiple_of:
            raise argparse.ArgumentTypeError(f"must be {where}, got {v}")
        return v

    parse.__name__ = where
    return parse


def output_file(text: str) -> Path:
    """A file to write: its folder must exist and it must not be a folder itself."""
    p = Path(text)
    if p.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: is a directory, not a file")
    if not p.parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: no such directory {str(p.parent)!r}")
    return p


def fields(sep: str = ",", **types: Callable[[str], object]) -> Callable[[str], tuple]:
    """An argument type for "A,B,C": one value a name, each through its own type, as a tuple.
    fields(BLOCKS=positive_float, THREADS=positive_int) reads '0.5,256' as (0.5, 256);
    fields("x", ROWS=positive_int, BUFFERS=positive_int) reads '32x2'."""
    names = list(types)
    form = sep.join(names)

    def parse(text: str) -> tuple:
        parts = text.split(sep)
        if len(parts) != len(names):
            raise argparse.ArgumentTypeError(f"expected {form}, got {text!r}")
        out = []
        for name, part in zip(names, parts):
            try:
                out.append(types[name](part.strip()))
            except (argparse.ArgumentTypeError, ValueError) as e:
                raise argparse.ArgumentTypeError(f"{text!r}: {name}: {e}") from None
        return tuple(out)

    parse.__name__ = form
    return parse


# serve's default turns host experts on only where the process may use this many CPUs: the
# host's threads are the CPUs less one, and the serving and engine threads need cores of their own
# (measured gains came from 16-core hosts, where 15 threads and 13 did alike)
AUTO_HOST_CPUS = 8


def host_flags_given(args) -> list[str]:
    """The host-expert settings given on the command line, in `add_host_experts`' order:
    --host-threads, --host-leave (or serving's --host-promote), --host-min-misses,
    --host-prefill-tokens (where the parser has it)."""
    keep = "--host-promote" if hasattr(args, "host_promote") else "--host-leave"
    return [flag for flag, given in (
        ("--host-threads", args.host_threads is not None),
        (keep, getattr(args, keep[2:].replace("-", "_"))),
        ("--host-min-misses", args.host_min_misses is not None),
        ("--host-prefill-tokens", getattr(args, "host_prefill_tokens", None) is not None))
        if given]


def check_host_flags(args) -> None:
    """ValueError naming the first of --host-threads, --host-leave, --host-min-misses and
    --host-prefill-tokens given without --host-experts (`add_host_experts`' typed flags)."""
    given = host_flags_given(args)
    if given and not args.host_experts:
        raise ValueError(f"{given[0]} applies with --host-experts")


def quantize_attention_error(args, device: str) -> str | None:
    """Why --quantize-attention (`generate`, `serve`) cannot go with the other options: a CPU
    device, or --no-fused (the quantized projections are read by the fused step's GEMVs only);
    None where it can, or where it is not given."""
    if not getattr(args, "quantize_attention", False):
        return None
    if device == "cpu":
        return ("--quantize-attention applies to a CUDA device (the fused decode step's GEMVs "
                "read the quantized projections); the CPU serves the model's own weights")
    if getattr(args, "no_fused", False):
        return "--quantize-attention is for the fused decode step, which --no-fused turns off"
    return None


def add_host_experts(parser, typed: bool = True, prefill: bool = True,
                     serving: bool = False) -> None:
    """--host-experts, --host-threads N, --host-leave, --host-min-misses N and (with `prefill`:
    not for a benchmark of decode steps alone) --host-prefill-tokens N
    (`Pool.enable_host_experts`), as `generate` and the benchmarks take them. The caller
    checks that the others come with --host-experts (`check_host_flags`, where its messages
    fit). typed False (`serve`, which checks every
    option itself to answer a mistake with its own one-line error): the numbers stay strings,
    None where not given.

    serving (`serve`, and bench_serve, which measures what serve does): host experts are on by
    default where they can gain (`cupool.serve.loader.auto_host_experts`), so the flags are
    --host-experts (on, or an error where they cannot be) and --no-host-experts (off), and the
    host's misses are left out of the bank unless --host-promote is given (in place of
    --host-leave)."""
    if serving:
        onoff = parser.add_mutually_exclusive_group()
        onoff.add_argument("--host-experts", action="store_true",
                           help="compute some of each decode step's missed experts on the "
                                "host's CPU while their rows are copied (default: on where the "
                                "bank does not hold every expert, a step of --max-batch "
                                "sequences can hand the host something (see --host-min-misses), "
                                f"the device is CUDA and the process may use at least "
                                f"{AUTO_HOST_CPUS} CPUs; given, it is an error where they cannot "
                                "be on)")
        onoff.add_argument("--no-host-experts", action="store_true",
                           help="never compute experts on the host's CPU")
    else:
        parser.add_argument("--host-experts", action="store_true",
                            help="compute some of each decode step's missed experts on the "
                                 "host's CPU while their rows are copied (a bank that does not "
                                 "hold every expert; default: off)")
    about = "host experts" if serving else "--host-experts"
    parser.add_argument("--host-threads", type=bounded_int(1, 1024) if typed else str,
                        metavar="N",
                        help=f"{about}: host threads (default: the CPUs this process may "
                             "use, less one)")
    if serving:
        parser.add_argument("--host-promote", action="store_true",
                            help="host experts: promote the host's misses into the bank and "
                                 "copy their rows behind the step (default: they are left out "
                                 "of the bank, which is faster where many streams keep the link "
                                 "busy)")
    else:
        parser.add_argument("--host-leave", action="store_true",
                            help="--host-experts: leave the host's experts out of the bank "
                                 "instead of copying their rows behind the step (faster where "
                                 "many streams keep the link busy)")
    parser.add_argument("--host-min-misses", type=bounded_int(0, 1 << 20) if typed else str,
                        metavar="N",
                        help=f"{about}: hand the host nothing in decode calls of fewer "
                             "than N misses (default: top-k + 1, so a step of one active "
                             "sequence runs without the hand-off)")
    if prefill:
        parser.add_argument("--host-prefill-tokens",
                            type=bounded_int(0, 1 << 20) if typed else str, metavar="N",
                            help=f"{about}: the host also computes some experts without a "
                                 "bank row of prompt prefill calls of up to N tokens, such as a "
                                 "turn after a reused prefix, e.g. 512 (at most the pool's "
                                 "widest prefill call; default: 0, decode steps only: where the "
                                 "link slows beside the host's threads it loses)")
