"""A proxyblocks command: its flags, its config file, and its signals.

- :class:`CommandParser`: ``argparse`` with one-line errors (``proxyblocks:
  error: ...``, exit code 2) and ``--config FILE``, a TOML file that can hold
  everything the flags say. Its keys are the long flags' names (``port =
  8080``, ``replica = ["http://10.0.0.5:8000"]``, ``no-scheduler = true``),
  plus the tables the command declares (``[apps.chat]``, say). A flag given
  on the command line overrides the file's key (a repeatable flag replaces
  the file's list). The file's values go through the flags' own checks, and
  a bad one is one line naming the file and the key; a relative path in it
  is relative to the file.
- :func:`run_until_signal`: a command's ``trio.run``: SIGINT or SIGTERM
  drains, a second stops at once, SIGHUP reloads. With ``--processes N``
  (N > 1) it runs a supervising parent instead, which starts the same
  command N times on one shared port, and SIGUSR2 restarts them in turn
  with nothing lost (docs/scale.md).
- ``type=`` checkers for flags: :func:`port_number`, :func:`at_least`,
  :func:`seconds`, :func:`between`.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import io
import json
import math
import os
import signal
import socket
import sys
import tomllib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn, Protocol

import attrs
import trio

from blocks.observe import LEVELS as _LOG_LEVELS
from blocks.observe import configure_logging
from blocks.transport.listener import inherit_listener
from blocks.transport.streams import CODECS as _CODECS
from blocks.transport.streams import CodecUnavailable, use_codec


@attrs.frozen(kw_only=True)
class Operations:
    """How a command's operators watch it (what ``--admin-port`` and ``--access-log`` say).

    ``admin_port``: an admin listener there (``/metrics``, ``/healthz``,
    ``/readyz``, the admin page; 0: any free port), and every hop counts
    its requests (:class:`~blocks.observe.Metrics`); None: neither.
    ``access_log``: one JSON line per request, appended to this file
    (``"-"``: standard output), at the hops named in ``access_log_hops``
    (None: the front-most hop the command runs, the edge of a whole chain).
    :func:`~blocks.serve_chain` and :func:`~blocks.open_chain` take it.
    """

    admin_port: int | None = None
    access_log: str | None = None
    access_log_hops: frozenset[str] | None = None
    processes: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    """How many processes serve the command's port (``--processes N``): with more than one, each
    binds it with ``SO_REUSEPORT`` and takes its share of the fair scheduler's budget and caps
    (:meth:`~blocks.scheduler.SchedulerConfig.split` by :attr:`process`: together, what one took)."""
    start_timeout: float = attrs.field(default=60.0, validator=attrs.validators.gt(0))
    """With more than one process (``--start-timeout``): seconds each of them gets to serve once
    started; one that has not is killed (before all first served, that ends the command, exit 2)."""
    process: int | None = None
    """This process's index among them (0 to ``processes - 1``) when a supervising parent started it
    (:func:`run_until_signal`); its admin listener is then on a private loopback port, which the
    parent's merges."""

    def process_flags(self) -> list[str]:
        """``--processes N --start-timeout S`` as this says: what a command passes on to a command
        it starts, so that one runs as many processes (the fleet recipe's proxies)."""
        return ["--processes", str(self.processes), "--start-timeout", f"{self.start_timeout:g}"]


@attrs.frozen
class _Supervised:
    """What a supervising parent tells each child it starts (``PROXYBLOCKS_PROCESS=INDEX COUNT FD
    LISTENING``): its index, how many there are, the file descriptor of its link to the parent (a
    Unix socket: the child reports on it, and reads end-of-file when the parent is gone) and that of
    the listening socket it serves (the parent's, shared with its replacement: docs/scale.md), if any."""

    index: int
    count: int
    fd: int
    listening: int | None = None


SUPERVISED_VARIABLE = "PROXYBLOCKS_PROCESS"
CODEC_VARIABLE = "PROXYBLOCKS_CODEC"
"""Names the default of every command's ``--codec`` (``h2``, ``nghttp2`` or ``auto``; unset: ``auto``)."""


@functools.cache
def _supervised() -> _Supervised | None:
    """This process's place under a supervising parent, or None; read once (and removed from the
    environment, so that a process this one starts is not taken for a supervised one)."""
    words = os.environ.pop(SUPERVISED_VARIABLE, "").split()
    if len(words) not in (3, 4) or not all(word.isdigit() for word in words):
        return None
    index, count, fd, *rest = map(int, words)
    if index >= count:
        return None
    try:  # (inherited to be had here: a process this one starts must not hold the link open)
        os.set_inheritable(fd, False)
    except OSError:  # no such descriptor: no parent to report to
        return None
    listening = rest[0] if rest else None
    if listening is not None:
        try:  # (nor the listening socket: a process this one starts would keep its queue alive)
            os.set_inheritable(listening, False)
            inherit_listener(socket.socket(fileno=listening))
        except OSError:
            listening = None
    return _Supervised(index, count, fd, listening)


def _whole_lines(*streams: object) -> None:
    """Make each text stream write a printed line in one ``write`` (and at once), as a pipe several
    processes share needs: ``PYTHONUNBUFFERED`` (``-u``) writes a ``print``'s text and its newline
    apart, and another process's line lands between them. A line up to ``PIPE_BUF`` (4 KiB) is then
    whole on a pipe."""
    for stream in streams:
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(line_buffering=True, write_through=False)


def _report(slot: _Supervised, **message: object) -> None:
    """One JSON line to the supervising parent (nothing if it is gone)."""
    try:
        os.write(slot.fd, json.dumps(message).encode() + b"\n")
    except OSError:
        pass


Section = Callable[..., object]
"""How a command reads one table of its config file (``CommandParser(sections=...)``): it takes the
TOML value and returns what the namespace holds under the table's name, raising ``ValueError`` or
``TypeError`` with what is wrong. A reader with a ``base`` keyword also gets the config file's
directory, the base of the relative paths in the table (a key file, say)."""


class Drainable(Protocol):
    """What :func:`run_until_signal` runs: anything with an async ``shutdown(grace)`` that drains.

    If it also has an async ``reload()`` (as :class:`~blocks.Chain` does), SIGHUP calls it.
    """

    async def shutdown(self, grace: float) -> None: ...


class CommandParser(argparse.ArgumentParser):
    """The command line of a proxyblocks command: a bad flag is one line, ``proxyblocks: error: ...``, and exit code 2.

    It adds the flags every command has: ``--admin-port PORT`` and
    ``--access-log FILE`` (the namespace holds them as one
    :class:`Operations`, ``operations``), ``--log-level`` (``warning`` by
    default: the parse configures logging), and ``--config FILE`` (see the module's docstring): ``sections`` names
    the config file's tables and how each is read; a table the file does not
    have is None in the namespace. (argparse would print its usage before an
    error; ``--help`` still shows it, with every default.) Flags are never
    abbreviated, so a config key and its flag are one name.
    """

    def __init__(self, *args: Any, sections: Mapping[str, Section] | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.sections = {name.replace("-", "_"): read for name, read in (sections or {}).items()}
        self._based = {name for name, read in self.sections.items() if "base" in inspect.signature(read).parameters}
        self.set_defaults(**dict.fromkeys(self.sections))
        self.add_argument(
            "--config", type=Path, metavar="FILE", help="a TOML file of settings, keyed by the long flags' names"
        )
        self.add_argument(
            "--admin-port", type=port_number, metavar="PORT", help="serve /metrics, /healthz, /readyz and a status page"
        )
        self.add_argument("--access-log", metavar="FILE", help="one JSON line per request (-: stdout)")
        self.add_argument(
            "--access-log-hops",
            type=hop_names,
            metavar="HOPS",
            help="the hops that log, of edge,proxy,worker (default: the front-most hop this process runs)",
        )
        self.add_argument("--log-level", type=str.lower, choices=_LOG_LEVELS, default="warning", help="what is logged")
        self.add_argument(
            "--codec",
            choices=_CODECS,
            default=os.environ.get(CODEC_VARIABLE) or "auto",
            help=f"HTTP/2 codec: hyper-h2, libnghttp2, or libnghttp2 where it loads (default: ${CODEC_VARIABLE}, auto)",
        )
        self._raising = False

    def add_serving_flags(self, *, tls: bool = True, grace: float = 10.0) -> None:
        """The flags of a command that listens: ``--host``, ``--port``, ``--grace``,
        ``--processes`` and ``--start-timeout`` (:meth:`add_processes_flag`) and, with
        ``tls``, ``--tls`` (a self-signed certificate), ``--cert FILE`` and ``--key FILE``
        (which go together: one without the other is an error)."""
        self.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface)")
        self.add_argument("--port", type=port_number, default=0, help="the port to listen on (0: any free port)")
        self.add_argument("--grace", type=seconds, default=grace, help="seconds requests in flight get on shutdown")
        self.add_processes_flag()
        if tls:
            self.add_argument("--tls", action="store_true", help="serve HTTPS with a generated self-signed certificate")
            self.add_argument("--cert", type=Path, metavar="FILE", help="serve HTTPS with this certificate chain (PEM)")
            self.add_argument("--key", type=Path, metavar="FILE", help="the private key of --cert (PEM)")

    def add_processes_flag(self) -> None:
        """``--processes N``: N processes share the port, under a supervising parent
        (:attr:`Operations.processes`; give the namespace's ``operations`` to :func:`run_until_signal`),
        and ``--start-timeout S``, the seconds each gets to serve (:attr:`Operations.start_timeout`)."""
        self.add_argument(
            "--processes",
            type=at_least(1, most=256),
            default=1,
            metavar="N",
            help="processes sharing the port (SO_REUSEPORT) under a supervising parent",
        )
        self.add_argument(
            "--start-timeout",
            type=between(0.001),
            default=60.0,
            metavar="S",
            help="seconds each process of --processes N gets to serve once started, or it is killed",
        )

    def error(self, message: str) -> NoReturn:
        if self._raising:
            raise ValueError(message)
        self.exit(2, f"proxyblocks: error: {message}\n")

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: None = None
    ) -> argparse.Namespace:
        """Parse the flags (``sys.argv`` by default) over the ``--config`` file's settings."""
        argv = sys.argv[1:] if args is None else list(args)
        pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
        pre.add_argument("--config", type=Path)
        path = pre.parse_known_args(argv)[0].config
        settings = argparse.Namespace(**(self._read_config(path, argv) if path is not None else {}))
        parsed = super().parse_args(argv, settings)
        if (getattr(parsed, "cert", None) is None) != (getattr(parsed, "key", None) is None):
            self.error("--cert and --key go together")
        if getattr(parsed, "tls", False) and getattr(parsed, "processes", 1) > 1:
            self.error("--tls makes a certificate in each process: with --processes, use --cert and --key")
        try:
            use_codec(parsed.codec)  # (codec_in_use() says which, for auto)
        except (CodecUnavailable, ValueError) as exc:
            self.error(f"--codec {parsed.codec}: {exc}")
        del parsed.codec
        if not self._raising:
            configure_logging(parsed.log_level)
        slot = _supervised()
        admin_port = parsed.admin_port
        if slot is not None and admin_port is not None:
            admin_port = 0  # the parent serves the port asked for; this process, a private one
        parsed.operations = Operations(
            admin_port=admin_port,
            access_log=parsed.access_log,
            access_log_hops=parsed.access_log_hops,
            processes=getattr(parsed, "processes", 1),
            start_timeout=getattr(parsed, "start_timeout", 60.0),
            process=None if slot is None else slot.index,
        )
        del parsed.admin_port, parsed.access_log, parsed.access_log_hops  # (log_level stays: a process may use it)
        for name in ("processes", "start_timeout"):
            if hasattr(parsed, name):
                delattr(parsed, name)
        return parsed

    def reparse(self, args: Sequence[str] | None = None) -> argparse.Namespace:
        """:meth:`parse_args` again, for a reload: the config file is read anew, and a bad
        setting raises ``ValueError`` (the message the command line would print) instead of exiting."""
        self._raising = True
        try:
            return self.parse_args(args)
        finally:
            self._raising = False

    def _read_config(self, path: Path, argv: Sequence[str]) -> dict[str, object]:
        try:
            with path.open("rb") as file:
                document = tomllib.load(file)
        except OSError as exc:
            self.error(f"--config {path}: {exc.strerror or exc}")
        except tomllib.TOMLDecodeError as exc:
            self.error(f"--config {path}: not TOML: {exc}")
        flags = {
            option[2:].replace("-", "_"): action
            for action in self._actions
            for option in action.option_strings
            if option.startswith("--") and action.dest not in ("help", "config")
        }
        given = {option.split("=", 1)[0] for option in argv if option.startswith("--")}
        settings: dict[str, object] = {}
        for key, value in document.items():
            name = key.replace("-", "_")
            where = f"{path}: {key}"
            if name in self.sections:
                try:
                    based = {"base": path.parent} if name in self._based else {}
                    settings[name] = self.sections[name](value, **based)
                except (ValueError, TypeError) as exc:
                    self.error(f"{where}: {exc}")
                continue
            action = flags.get(name)
            if action is None:
                known = sorted(name.replace("_", "-") for name in flags | self.sections)
                self.error(f"{where}: not a setting (the settings: {', '.join(known)})")
            if not given.isdisjoint(action.option_strings):
                continue  # the command line says otherwise
            settings[action.dest] = self._setting(action, value, where, path.parent)
        return settings

    def _setting(self, action: argparse.Action, value: object, where: str, base: Path) -> object:
        if action.nargs == 0:  # a switch: store_true, store_false
            if type(value) is not bool:
                self.error(f"{where}: true or false, not {value!r}")
            return action.const if value else action.default
        if isinstance(action, argparse._AppendAction):  # a repeatable flag takes a list
            values = value if isinstance(value, list) else [value]
            return [self._value(action, one, where, base) for one in values]
        return self._value(action, value, where, base)

    def _value(self, action: argparse.Action, value: object, where: str, base: Path) -> object:
        if isinstance(value, dict | list) or type(value) is bool:
            self.error(f"{where}: {value!r} is not a value this setting takes")
        try:
            result = action.type(str(value)) if callable(action.type) else str(value)
        except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
            self.error(f"{where}: {exc}")
        if action.choices is not None and result not in action.choices:
            self.error(f"{where}: {value!r} is not one of {', '.join(map(str, action.choices))}")
        if isinstance(result, Path) and not result.is_absolute():
            result = base / result
        return result


def port_number(text: str) -> int:
    """An argparse ``type``: a TCP port, 0 (any free port) to 65535."""
    if not (text.isascii() and text.isdigit() and int(text) <= 65535):
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (0-65535)")
    return int(text)


_HOPS = ("edge", "proxy", "worker")


def hop_names(text: str) -> frozenset[str]:
    """An argparse ``type``: a comma-separated list of hops (``edge``, ``proxy``, ``worker``)."""
    names = frozenset(name.strip() for name in text.split(","))
    if not names or not names <= set(_HOPS):
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of {', '.join(_HOPS)}")
    return names


def at_least(minimum: int, *, most: int | None = None) -> Callable[[str], int]:
    """An argparse ``type``: a whole number, ``minimum`` or more (and ``most`` or less)."""
    span = f"at least {minimum}" if most is None else f"from {minimum} to {most}"

    def parse(text: str) -> int:
        digits = text.removeprefix("-")
        if not (
            digits.isascii() and digits.isdigit() and minimum <= int(text) <= (int(text) if most is None else most)
        ):
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number {span}")
        return int(text)

    return parse


def seconds(text: str) -> float:
    """An argparse ``type``: a finite, non-negative number of seconds."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds (0 or more)")
    return value


def between(low: float, high: float = math.inf) -> Callable[[str], float]:
    """An argparse ``type``: a number from ``low`` to ``high`` (a share: ``between(0, 1)``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (low <= value <= high):
            raise argparse.ArgumentTypeError(f"{text!r} is not a number from {low:g} to {high:g}")
        return value

    return parse


def run_until_signal(
    start: Callable[..., Awaitable[None]],
    *,
    grace: float = 10.0,
    operations: Operations | None = None,
    listen: tuple[str, int] | None = None,
) -> None:
    """Run ``start`` (a ``serve_*``-style function reporting a :class:`Drainable`) until SIGINT or SIGTERM.

    A command's ``trio.run``. The first signal prints ``draining...``, calls
    the reported object's ``shutdown(grace)``, prints ``stopped`` and
    returns (exit status 0). A second signal while draining prints
    ``stopping now`` and cancels everything at once; the process then exits
    with 128 + the signal's number (130 for SIGINT), with no traceback.
    SIGHUP calls the reported object's ``reload()``, if it has one, and
    prints ``reloaded``, or one line ``proxyblocks: reload failed: ...`` on
    stderr (an ``OSError`` or ``ValueError``: what was in force stays); the
    command serves on either way, and a SIGHUP during a reload waits for it.
    If ``start`` ends by itself, so does this (printing nothing). If it
    fails before it reports (a port in use, a route file that does not
    load: an ``OSError`` or a ``ValueError``), that is one line on stderr,
    ``proxyblocks: error: ...``, and exit code 2; an error after that
    propagates.

    With ``operations.processes`` above 1 (``--processes N``), this process
    becomes a supervising parent instead (docs/scale.md): it binds
    ``listen`` (host, port; port 0 picks one) with ``SO_REUSEPORT`` and keeps
    it, starts the same command line N times on that port, restarts a
    process that dies (with backoff), forwards SIGHUP to all, restarts all
    in turn on SIGUSR2 (each replaced before it is drained: nothing is
    lost), drains all on SIGINT or SIGTERM, and serves the merged admin
    listener on ``operations.admin_port``. Each of those processes runs
    ``start`` here, reporting to the parent instead of printing these lines
    (SIGUSR2 to one of them asks the parent to restart that one). SIGUSR2
    to a process on its own prints one line on stderr and does nothing.

    Every line the command prints is one write (:func:`_whole_lines`): the
    parent and its processes share stdout and stderr.
    """
    _whole_lines(sys.stdout, sys.stderr)
    slot = _supervised()
    if slot is None and operations is not None and operations.processes > 1:
        from blocks._supervisor import supervise  # (it imports this module)

        code = supervise(operations, listen or ("127.0.0.1", 0), grace=grace)
        if code:
            raise SystemExit(code)
        return
    try:
        code = trio.run(_until_signal, start, grace, slot)
    except KeyboardInterrupt:  # a Ctrl-C before the signal handlers were in place, or after
        code = 128 + signal.SIGINT
    except BaseException as exc:
        failed = _one_cause(exc)  # (the nurseries on the way out wrap it)
        if not isinstance(failed, _StartFailed):
            raise
        if slot is not None:
            _report(slot, error=_reason(failed.reason))  # the parent prints it, once
        else:
            print(f"proxyblocks: error: {_reason(failed.reason)}", file=sys.stderr, flush=True)
        code = 2
    if code:
        raise SystemExit(code)


class _StartFailed(Exception):
    def __init__(self, reason: BaseException) -> None:
        super().__init__(str(reason))
        self.reason = reason


def _reason(error: BaseException) -> str:
    """One line for an ``OSError`` or a ``ValueError``: ``FILE: No such file or directory``, say."""
    if isinstance(error, OSError) and error.strerror:
        return f"{error.filename}: {error.strerror}" if error.filename else error.strerror
    return str(error)


def _one_cause(error: BaseException) -> BaseException:
    """The one error inside nested exception groups of one (what nurseries wrap), else ``error`` itself."""
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error


async def _reload(reload: Callable[[], Awaitable[None]], lock: trio.Lock, slot: _Supervised | None) -> None:
    async with lock:
        try:
            await reload()
        except (OSError, ValueError) as exc:
            if slot is not None:
                _report(slot, reloaded=_reason(exc))
            else:
                print(f"proxyblocks: reload failed: {_reason(exc)}", file=sys.stderr, flush=True)
        else:
            if slot is not None:
                _report(slot, reloaded=None)
            else:
                print("reloaded", flush=True)


def _restart_asked(slot: _Supervised | None) -> None:
    """SIGUSR2: a supervised process asks its parent to restart it (a replacement first); a process
    on its own has no one to take its traffic meanwhile, and says so."""
    if slot is not None:
        _report(slot, restart=os.getpid())
    else:
        print(
            "proxyblocks: SIGUSR2 restarts a process of --processes N; this command runs one: ignored",
            file=sys.stderr,
            flush=True,
        )


_PARENT_GONE = 0
"""What :func:`_parent_gone` puts among the signals: not a signal (none is numbered 0)."""


async def _parent_gone(slot: _Supervised, stop: trio.MemorySendChannel[int]) -> None:
    """A supervised process's watch on its link: end-of-file (the parent is gone, even killed) drains
    this process as SIGTERM would, so that no process outlives its parent for long; it is not a
    signal, so it never counts as the second one (a parent killed while its children drain)."""
    link = trio.socket.fromfd(slot.fd, trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    with link:
        while await link.recv(4096):
            pass
    await stop.send(_PARENT_GONE)


async def _until_signal(start: Callable[..., Awaitable[None]], grace: float, slot: _Supervised | None = None) -> int:
    code = 0
    drained = False

    def say(line: str) -> None:
        if slot is None:  # (a supervised process's parent says it, once for all)
            print(line, flush=True)

    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR2) as received:
        async with trio.open_nursery() as nursery:
            send, signals = trio.open_memory_channel[int](math.inf)

            async def relay() -> None:
                async for signum in received:
                    await send.send(signum)

            nursery.start_soon(relay)

            async def serve(task_status: trio.TaskStatus[Drainable]) -> None:
                await start(task_status=task_status)
                nursery.cancel_scope.cancel()  # it ended: stop waiting for a signal

            signalled = False  # a SIGINT or SIGTERM came (the parent's end drains too, but is no signal)

            async def second() -> None:
                nonlocal code, signalled
                async for signum in signals:
                    if signum in (signal.SIGHUP, signal.SIGUSR2, _PARENT_GONE):
                        continue
                    if not signalled:  # the first signal: the parent's end began the drain
                        signalled = True
                        continue
                    say("stopping now")
                    code = 128 + signum
                    nursery.cancel_scope.cancel()

            if slot is not None:
                nursery.start_soon(_parent_gone, slot, send.clone())
            try:
                target: Drainable = await nursery.start(serve)
            except BaseException as exc:
                cause = _one_cause(exc)
                if isinstance(cause, OSError | ValueError):
                    raise _StartFailed(cause) from None
                raise
            if slot is not None:
                admin = getattr(target, "admin", None)
                _report(slot, started=os.getpid(), admin=getattr(admin, "port", None))
            reload: Callable[[], Awaitable[None]] | None = getattr(target, "reload", None)
            reloads = trio.Lock()
            async for signum in signals:
                if signum == signal.SIGUSR2:
                    _restart_asked(slot)
                    continue
                if signum != signal.SIGHUP:
                    signalled = signum != _PARENT_GONE
                    break
                if reload is not None:
                    nursery.start_soon(_reload, reload, reloads, slot)
                elif slot is not None:
                    _report(slot, reloaded=None)
            say("draining...")
            nursery.start_soon(second)
            await target.shutdown(grace)
            drained = True
            nursery.cancel_scope.cancel()
    if drained and not code:
        say("stopped")
    return code


__all__ = [
    "CODEC_VARIABLE",
    "CommandParser",
    "Drainable",
    "Operations",
    "SUPERVISED_VARIABLE",
    "Section",
    "at_least",
    "between",
    "hop_names",
    "port_number",
    "run_until_signal",
    "seconds",
]
