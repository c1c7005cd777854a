"""The `serve` subcommand: `add_arguments(parser)` declares its options, `run(args) -> int` serves
(`HELP` is its one-line description for a subparser).

    python -m cupool serve --model DIR [--budget 40GiB] [--host 127.0.0.1 --port 8000]
                           [--api-key KEY] [--max-queue N] [--resume-points N]
                           [--host-experts | --no-host-experts] [--host-threads N]
                           [--host-promote] [--host-min-misses N] [--host-prefill-tokens N]
                           [--quantize-attention] [--shutdown-timeout S]

`run` checks every option before it loads anything: a user's mistake (a missing directory, no
config.json, a port outside 0..65535, --max-batch < 1, a budget that does not parse, a CUDA
device that is not there, a port already taken) ends with one line on stderr and exit code 2.
Then it binds the port, loads the model (`cupool.serve.loader`), starts one `cupool.Engine`,
and runs the FastAPI app (`cupool.serve.app`) under uvicorn until Ctrl-C, printing the URL once
it is ready. Importing this module imports neither FastAPI nor uvicorn.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import logging
import socket
import sys
from pathlib import Path

from cupool.cli import add_host_experts, host_flags_given, quantize_attention_error

MAX_BATCH = 8
"""serve's default --max-batch: the slots its engine decodes a step."""

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
DTYPES = ("auto", "float32", "bfloat16", "float16")
PROG = "cupool serve"
HELP = ("serve a model directory over OpenAI- and Anthropic-compatible HTTP APIs "
        "(FastAPI + uvicorn)")


class UsageError(ValueError):
    """An option the user gave cannot be served (the message is the one line printed)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `serve`. Numbers are checked by `run`, so that every mistake reads the
    same: one line and exit code 2."""
    parser.add_argument("--model", required=True, metavar="DIR",
                        help="a transformers model directory (config.json, safetensors weights, "
                             "tokenizer files for text prompts and chat)")
    parser.add_argument("--budget", metavar="SIZE",
                        help="GPU memory for the whole model, e.g. 40GiB (CUDA only; default: "
                             "what cupool.from_pretrained chooses)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on "
                        "(default: %(default)s)")
    parser.add_argument("--port", default="8000", help="TCP port, 0 for any free one "
                        "(default: %(default)s)")
    parser.add_argument("--device", default=None,
                        help="cpu, cuda or cuda:N (default: cuda if a GPU is visible, else cpu)")
    parser.add_argument("--max-batch", default=str(MAX_BATCH), metavar="B",
                        help="sequences decoded together (default: %(default)s)")
    parser.add_argument("--max-len", default=None, metavar="N",
                        help="tokens a sequence holds, prompt and output (default: the model's "
                             "max_position_embeddings, at most 4096)")
    parser.add_argument("--dtype", default="auto", metavar="|".join(DTYPES),
                        help="weights and activations (default: auto, the checkpoint's on the "
                             "CPU, cupool's on CUDA)")
    parser.add_argument("--served-model-name", default=None, metavar="NAME",
                        help="the model's name in the API (default: the directory's name)")
    parser.add_argument("--log-level", default="info", metavar="|".join(LOG_LEVELS),
                        help="(default: %(default)s)")
    parser.add_argument("--api-key", default=None, metavar="KEY",
                        help="require this key on every endpoint but /health (default: the "
                             "environment variable CUPOOL_API_KEY, else none)")
    parser.add_argument("--max-queue", default=None, metavar="N",
                        help="most requests waiting for a slot; more are refused with 429 "
                             "(default: no bound)")
    parser.add_argument("--resume-points", default=None, metavar="N",
                        help="models with recurrent (linear-attention, Mamba) layers: copies of a "
                             "slot's states kept on the GPU for prefix reuse, 0 for none "
                             "(default: 3 x --max-batch; the log gives their size)")
    parser.add_argument("--quantize-attention", action="store_true",
                        help="CUDA: quantize the attention projections to NVFP4 at load, as the "
                             "experts are, for a faster decode step (a quarter of their bytes a "
                             "token); it changes the outputs, as quantization does. Projections "
                             "the checkpoint holds as NVFP4 are used as they are either way")
    parser.add_argument("--no-fused", action="store_true",
                        help="run the model's own forward instead of cupool's fused decode step "
                             "(default: fused where the model fits)")
    parser.add_argument("--no-batch-prefill", action="store_true",
                        help="prefill each request's prompt alone instead of the prompts that "
                             "arrive together in one forward (default: together, on models "
                             "whose slots hold keys and values alone)")
    parser.add_argument("--no-narrow-step", action="store_true",
                        help="run every decode step over all --max-batch slots, also where few "
                             "requests are active (default: where they fit 1, 2, 4, ... slots, "
                             "the powers of two below --max-batch, a step of theirs alone, "
                             "faster; the same tokens)")
    parser.add_argument("--no-compile", action="store_true",
                        help="where the fused step is not used, do not put the model's forward "
                             "through torch.compile (default on CUDA: compiled, which adds tens "
                             "of seconds before the server is ready)")
    add_host_experts(parser, typed=False, serving=True)
    parser.add_argument("--shutdown-timeout", default="30", metavar="S",
                        help="on SIGTERM or Ctrl-C, seconds the requests in flight may take to "
                             "finish before they are cancelled (default: %(default)s)")


@dataclasses.dataclass
class Options:
    """The checked options of `serve`."""
    model_dir: Path
    budget: int | None
    host: str
    port: int
    device: str
    max_batch: int
    max_len: int
    dtype: object
    model_name: str
    log_level: str
    api_key: str | None = None
    max_queue: int | None = None
    shutdown_timeout: float = 30.0
    resume_points: int | None = None
    fused: bool = True
    compile: bool = True
    batch_prefill: bool = True
    narrow: bool = True
    host_experts: bool | None = None      # None: on where `auto_host_experts` says they can gain
    host_threads: int | None = None
    host_leave: bool = True
    host_min_misses: int | None = None
    host_prefill_tokens: int = 0
    quantize_attention: bool = False


def _int(value, flag: str, lo: int, hi: int | None = None) -> int:
    text = str(value).strip()
    try:
        n = int(text)
    except ValueError:
        raise UsageError(f"{flag} must be an integer, got {value!r}") from None
    if n < lo or (hi is not None and n > hi):
        span = f"in {lo}..{hi}" if hi is not None else f">= {lo}"
        raise UsageError(f"{flag} must be {span}, got {n}")
    return n


def _device(value) -> str:
    import torch
    if value is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(str(value))
    except (RuntimeError, ValueError):
        raise UsageError(f"--device {value!r} is not a device: use cpu, cuda or cuda:N") from None
    if dev.type == "cpu":
        return "cpu"
    if dev.type != "cuda":
        raise UsageError(f"--device {value!r} is not served: use cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise UsageError(f"--device {value}: no CUDA device is visible to torch "
                         f"(torch.cuda.is_available() is False); use --device cpu")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise UsageError(f"--device {value}: there are {torch.cuda.device_count()} CUDA devices")
    return str(dev)


def _dtype(value, device: str):
    import torch
    name = str(value).strip().lower()
    if name not in DTYPES:
        raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}, got {value!r}")
    if name == "auto":
        return None
    if device != "cpu" and name == "float32":
        raise UsageError("--dtype float32 is not served on CUDA: use bfloat16 or float16")
    return getattr(torch, name)


def check_options(args) -> Options:
    """`args` (from the parser of `add_arguments`) checked and converted; UsageError with the
    one line to print where one is wrong. Reads the directory's config.json, loads nothing."""
    from cupool.budget import parse_bytes
    from cupool.serve.loader import LoadError, read_config, resolve_max_len

    log_level = str(args.log_level).strip().lower()
    if log_level not in LOG_LEVELS:
        raise UsageError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, "
                         f"got {args.log_level!r}")
    port = _int(args.port, "--port", 0, 65535)
    max_batch = _int(args.max_batch, "--max-batch", 1)
    max_len = None if args.max_len is None else _int(args.max_len, "--max-len", 2)
    device = _device(args.device)
    budget = None
    if args.budget is not None:
        try:
            budget = parse_bytes(str(args.budget), "--budget")
        except (TypeError, ValueError) as e:
            raise UsageError(str(e)) from None
        if device == "cpu":
            raise UsageError("--budget applies to a CUDA device; the CPU serves the model "
                             "unwrapped (leave --budget out)")
    dtype = _dtype(args.dtype, device)
    try:
        cfg = read_config(args.model)
        max_len = resolve_max_len(cfg, max_len)
    except LoadError as e:
        raise UsageError(str(e).replace("max_len=", "--max-len ")) from None
    model_dir = Path(args.model).expanduser()
    name = args.served_model_name if args.served_model_name else model_dir.resolve().name
    if not str(args.host).strip():
        raise UsageError("--host is empty")
    from cupool.serve.auth import ENV, key_from_env
    if args.api_key is not None and not str(args.api_key).strip():
        raise UsageError(f"--api-key is empty (leave it out, or set {ENV}, for no key)")
    api_key = key_from_env(args.api_key)
    max_queue = None if args.max_queue is None else _int(args.max_queue, "--max-queue", 0)
    resume = getattr(args, "resume_points", None)
    resume = None if resume is None else _int(resume, "--resume-points", 0)
    # host experts: True (--host-experts), False (--no-host-experts), None (the default: on
    # where `auto_host_experts` finds they can gain, after loading); each setting's value is
    # checked first, then whether it applies
    host_experts = True if getattr(args, "host_experts", False) else \
        False if getattr(args, "no_host_experts", False) else None
    host_threads = getattr(args, "host_threads", None)
    host_promote = bool(getattr(args, "host_promote", False))
    host_min_misses = getattr(args, "host_min_misses", None)
    host_prefill_tokens = getattr(args, "host_prefill_tokens", None)
    given = host_flags_given(args)
    if host_threads is not None:
        host_threads = _int(host_threads, "--host-threads", 1, 1024)
    if host_min_misses is not None:
        host_min_misses = _int(host_min_misses, "--host-min-misses", 0, 1 << 20)
    host_prefill_tokens = 0 if host_prefill_tokens is None else _int(
        host_prefill_tokens, "--host-prefill-tokens", 0, 1 << 20)
    if host_experts and device == "cpu":
        raise UsageError("--host-experts applies to a CUDA device (the CPU serves the whole "
                         "model itself)")
    off = ("--no-host-experts" if host_experts is False
           else "--device cpu" if device == "cpu" else None)
    if given and off:
        raise UsageError(f"{given[0]} applies to host experts, which {off} turns off")
    if device == "cpu":
        host_experts = False
    if (why := quantize_attention_error(args, device)) is not None:
        raise UsageError(why)
    try:
        shutdown = float(str(args.shutdown_timeout).strip())
    except ValueError:
        raise UsageError(f"--shutdown-timeout must be a number of seconds, got "
                         f"{args.shutdown_timeout!r}") from None
    if not 0 <= shutdown < float("inf"):
        raise UsageError(f"--shutdown-timeout must be >= 0, got {shutdown}")
    return Options(model_dir, budget, str(args.host).strip(), port, device, max_batch, max_len,
                   dtype, name, log_level, api_key, max_queue, shutdown, resume_points=resume,
                   fused=not getattr(args, "no_fused", False),
                   compile=device != "cpu" and not getattr(args, "no_compile", False),
                   batch_prefill=not getattr(args, "no_batch_prefill", False),
                   narrow=not getattr(args, "no_narrow_step", False),
                   host_experts=host_experts, host_threads=host_threads,
                   host_leave=not host_promote, host_min_misses=host_min_misses,
                   host_prefill_tokens=host_prefill_tokens,
                   quantize_attention=bool(getattr(args, "quantize_attention", False)))


def _fail(message: str, code: int = 2) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    return code


def _bind(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port), not listening yet (uvicorn listens on it)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UsageError(f"--host {host!r} does not resolve: {e.strerror}") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/v1"


def run(args) -> int:
    """Serve until interrupted; the process's exit code: 0 after Ctrl-C once serving (uvicorn
    finishes the open requests first, up to --shutdown-timeout s), 130 for Ctrl-C while loading,
    2 for a user's mistake, 1 where loading or serving failed otherwise. SIGTERM: uvicorn shuts down the
    same way, then re-raises the signal, so the process ends by it (143), as process managers
    expect."""
    try:
        opts = check_options(args)
    except UsageError as e:
        return _fail(str(e))
    logging.basicConfig(level=opts.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("cupool.serve")
    missing = [m for m in ("fastapi", "uvicorn", "prometheus_client")
               if importlib.util.find_spec(m) is None]
    if missing:
        return _fail(f"serving needs {' and '.join(missing)}: pip install 'cupool[serve]'")
    try:
        sock = _bind(opts.host, opts.port)
    except UsageError as e:
        return _fail(str(e))
    engine = None
    try:
        from cupool.engine import Engine
        from cupool.serve.app import create_app
        from cupool.serve.loader import LoadError, load, unused_quantization

        log.info("loading %s on %s", opts.model_dir, opts.device)
        try:
            model, pool, tokenizer = load(opts.model_dir, opts.device, budget=opts.budget,
                                          max_batch=opts.max_batch, max_len=opts.max_len,
                                          dtype=opts.dtype, resume_points=opts.resume_points,
                                          quantize_attention=opts.quantize_attention)
        except LoadError as e:
            return _fail(str(e))
        if _host_experts_wanted(log, pool, opts):
            try:
                _enable_host_experts(log, pool, opts)
            except LoadError as e:
                return _fail(str(e))
        try:
            # the fastest step by default: fused where the model fits, else the compiled forward
            engine = Engine(model, pool, tokenizer=tokenizer, max_batch=opts.max_batch,
                            max_len=opts.max_len, fused=None if opts.fused else False,
                            compile=opts.compile, resume_points=opts.resume_points,
                            batch_prefill=opts.batch_prefill, narrow=opts.narrow)
        except ValueError as e:
            return _fail(str(e))
        log.info("decode step: %s", engine.step_kind)
        if opts.quantize_attention and (why := unused_quantization(engine)) is not None:
            log.warning("%s", why)
        if engine.graph:
            engine.warmup()               # compile and capture the decode step before "ready"
        log.info("prefill: %s", engine.prefill_kind)
        if engine.resume_point_bytes:
            _log_resume_points(log, engine, pool)
        engine.start()
        app = create_app(engine, tokenizer, opts.model_name, api_key=opts.api_key,
                         max_queue=opts.max_queue)
        url = _url(sock)

        def ready() -> None:
            print(f"{PROG}: {opts.model_name} ({opts.device}, {opts.max_batch} sequences x "
                  f"{opts.max_len} tokens) at {url}  (OpenAI and Anthropic APIs; Ctrl-C "
                  f"stops)", flush=True)

        try:
            _serve(app, sock, opts.log_level, ready, opts.shutdown_timeout)
        except KeyboardInterrupt:    # uvicorn stopped on Ctrl-C, then re-raised the signal
            pass
        print(f"{PROG}: stopped", file=sys.stderr, flush=True)
        return 0
    except KeyboardInterrupt:
        return _fail("interrupted", 130)
    except SystemExit as e:                          # uvicorn's exit on a failed startup
        return _fail(f"the server did not start (exit {e.code})", 1)
    except Exception as e:
        log.debug("serve failed", exc_info=True)
        return _fail(f"{type(e).__name__}: {e} (--log-level debug shows the traceback)", 1)
    finally:
        if engine is not None:
            engine.shutdown()
        sock.close()


def _host_experts_wanted(log, pool, opts) -> bool:
    """Whether serve turns host experts on for the loaded pool: --host-experts (which errors
    later where the bank misses nothing), --no-host-experts, or by default where
    `auto_host_experts` finds no reason against (the log says which)."""
    if opts.host_experts is not None:
        if not opts.host_experts:
            log.info("host experts: off (%s)",
                     "--no-host-experts" if opts.device != "cpu" else "the CPU serves the model")
        return opts.host_experts
    from cupool.serve.loader import auto_host_experts
    why = auto_host_experts(pool, opts.max_batch, opts.host_min_misses)
    if why is None:
        return True
    given = [flag for flag, on in (("--host-threads", opts.host_threads is not None),
                                   ("--host-promote", not opts.host_leave),
                                   ("--host-min-misses", opts.host_min_misses is not None),
                                   ("--host-prefill-tokens", opts.host_prefill_tokens > 0)) if on]
    if given:
        log.warning("host experts: off, so %s unused: %s (--host-experts turns them on "
                    "anyway where the bank misses experts)",
                    " and ".join(given) + (" is" if len(given) == 1 else " are"), why)
    else:
        log.info("host experts: off: %s", why)
    return False


def _enable_host_experts(log, pool, opts) -> None:
    """`Pool.enable_host_experts` for decode steps of --max-batch tokens and prefill calls of up
    to --host-prefill-tokens; logs what it measured and the split it gives."""
    from cupool.serve.loader import enable_host_experts
    hd = enable_host_experts(pool, opts.max_batch, opts.host_threads, opts.host_leave,
                             opts.host_min_misses, opts.host_prefill_tokens)
    log.info("host experts: %d threads, a row %.1f us on the CPU (+ %.1f a call) and %.1f us on "
             "the link; of a step's misses the host takes %s (for 1..%d misses), %s",
             hd.hx.threads, hd.cpu_us, hd.cpu_call_us, hd.link_us, hd.split[1:].tolist(),
             len(hd.split) - 1,
             "left out of the bank" if hd.leave else "their rows copied behind the step")
    fewest = next((n for n in range(1, opts.max_batch + 1) if hd.hands_over(n)), None)
    if fewest is None:
        log.warning("host experts: no step hands the host anything (--host-min-misses %d; a step "
                    "of %d sequences has at most %d misses)", hd.min_misses, opts.max_batch,
                    opts.max_batch * pool.top_k)
    else:
        log.info("host experts: steps of fewer than %d active sequences run without the hand-off "
                 "(--host-min-misses %d)", fewest, hd.min_misses)
    if hd.prefill_tokens:
        log.info("host experts: prompt prefill calls of up to %d tokens share their missing "
                 "experts with the host (%s)", hd.prefill_tokens, _prefill_costs(hd))
    else:
        log.info("host experts: decode steps only (--host-prefill-tokens N: prompt prefill "
                 "calls of up to N tokens too)")


def _prefill_costs(hd) -> str:
    """A HostDecode's measured prefill costs, e.g. '128 tokens: 40.1 us a row + 210 a call; a
    row 48.7 us on the link'."""
    return "; ".join(f"{t} tokens: {row:.1f} us a row + {call:.0f} a call"
                     for t, row, call in hd.prefill_costs) \
        + f"; a row {hd.prefill_link_us:.1f} us on the link"


def _log_resume_points(log, engine, pool) -> None:
    """The resume points' size; through a pool, a warning where one slot's states as allocated
    differ from the size the budget's reserve counted for them (`state_bytes_per_slot`)."""
    from cupool.kvcache import state_bytes_per_slot

    count, each = engine.prefix.saved.count, engine.resume_point_bytes
    log.info("prefix reuse: %d resume points of %.1f MiB, %.1f MiB in all (--resume-points)",
             count, each / 2**20, count * each / 2**20)
    if pool is None:
        return
    counted = state_bytes_per_slot(engine.model.config, engine.dtype.itemsize)
    if counted != each:
        log.warning("one slot's recurrent states take %d bytes, the budget's reserve counted %d "
                    "(for %d slots and %d resume points)", each, counted, engine.max_batch, count)


def _serve(app, sock: socket.socket, log_level: str, on_ready, shutdown_timeout: float) -> None:
    """Run `app` under uvicorn on `sock` until interrupted; `on_ready()` once it listens. On
    SIGTERM or SIGINT uvicorn stops listening, lets the open requests finish for up to
    `shutdown_timeout` s, then cancels the rest (their engine requests with them)."""
    import uvicorn

    class ReadyServer(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            if self.started and not self.should_exit:
                on_ready()

    config = uvicorn.Config(app, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=shutdown_timeout)
    ReadyServer(config).run(sockets=[sock])


def main(argv=None) -> int:
    """`serve` alone, for `python -m cupool.serve.cli` (the package's CLI wires add_arguments
    and run into `python -m cupool serve`)."""
    parser = argparse.ArgumentParser(prog=PROG, description=HELP)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
