"""`vgpu` command line: one subcommand per entry of COMMANDS, imported only when it runs.

Each entry names `module:function`; the function takes the remaining arguments and the program
name (`vgpu NAME`) and returns the exit status. Modules are imported lazily so that `vgpu release`
does not pay for importing torch.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

# name -> (module:function, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("vgpu.daemon.demo:main", "run the whole pipeline on a simulated GPU with a bundled trace"),
    "serve": ("vgpu.daemon.serve:main", "run the manager and allocator daemon"),
    "profiler": ("vgpu.profiler.main:main", "run the behavioural profiler and stream to the manager"),
    "record": ("vgpu.profiler.record:main", "record what the profiler samples to a canonical trace"),
    "available": ("vgpu.ctl:available_main", "show free and granted resources per device"),
    "apps": ("vgpu.ctl:apps_main", "list applications with their usage, forecast and grants"),
    "request": ("vgpu.ctl:request_main", "request an allocation for an application"),
    "release": ("vgpu.ctl:release_main", "release a grant"),
    "set-limit": ("vgpu.ctl:set_limit_main", "set an application's limits (operator)"),
    "forget-app": ("vgpu.ctl:forget_app_main", "drop claimed application ids that hold nothing (operator)"),
    "top": ("vgpu.ctl:top_main", "live view of applications and devices"),
    "report": ("vgpu.report:main", "draw use, forecast and grant over time for an application or a GPU"),
    "size": ("vgpu.manager.coldstart:size_main", "size a job before it has a history (the cold-start model)"),
    "doctor": ("vgpu.daemon.doctor:main", "check driver, NVML, privileges, sockets and the model file"),
    "trace": ("vgpu.offline.tracecli:main",
              "canonical traces: convert (a dataset into the format), info (describe one), "
              "cut (the bundled demo trace from MIGPerf), synth (derived serving and training series)"),
    "train": ("vgpu.offline.train:main", "train the forecaster on canonical traces"),
    "eval": ("vgpu.offline.evaluate:main", "evaluate forecasters by the trace evaluation protocol"),
    "model": ("vgpu.manager.nodelearn:model_main", "the node-local forecaster: status, rollback"),
}


def _usage() -> str:
    width = max(len("-h, --help"), *(len(n) for n in COMMANDS))
    lines = ["usage: vgpu COMMAND [ARGS...]", "       vgpu --version", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "options:", f"  {'--version':<{width}}  print vgpu's version and exit",
              f"  {'-h, --help':<{width}}  show this help and exit",
              "", "Run `vgpu COMMAND --help` (or `vgpu help COMMAND`) for a command's options."]
    return "\n".join(lines)


def resolve(name: str) -> Callable[[Sequence[str], str], int]:
    """The entry function of a subcommand."""
    target, _ = COMMANDS[name]
    module_name, func_name = target.split(":")
    module = importlib.import_module(module_name)
    func: Callable[[Sequence[str], str], int] = getattr(module, func_name)
    return func


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:  # no command: a usage error, as for an unknown one (a script's typo does not pass)
        print(_usage(), file=sys.stderr)
        return 2
    if args[0] == "help" and len(args) > 1:  # `vgpu help apps`, as `git help`: that command's help
        if args[1] not in COMMANDS:
            print(f"vgpu: unknown command {args[1]!r}\n\n{_usage()}", file=sys.stderr)
            return 2
        args = [args[1], "--help"]
    elif args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if args[0] == "--version":
        from vgpu import __version__

        print(f"vgpu {__version__}")
        return 0
    name = args[0]
    if name not in COMMANDS:
        print(f"vgpu: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    # Log records go to stderr from the start: structlog left unconfigured prints to stdout, where a
    # tool's own output is (`vgpu model status | jq`). Commands with their own settings (serve, the
    # profiler, the demo) configure it again.
    from vgpu import log

    log.configure("console", "info")
    try:
        return resolve(name)(args[1:], f"vgpu {name}")
    except BrokenPipeError:
        # Whoever read stdout went away (`vgpu top --plain | head`): stop quietly, with the status of a
        # tool that SIGPIPE ended; stdout goes to /dev/null so the exit's flush does not fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 128 + signal.SIGPIPE


def run() -> NoReturn:
    """The `vgpu` program (console script and `python -m vgpu.cli`): main(), then exit without the
    interpreter's final garbage collection over the heap (vgpu/gc_freeze.py `freeze_for_exit`: 0.4-1.1 s
    of a `vgpu serve` stop with torch loaded). main() stays callable in a process that goes on."""
    rc = main()
    from vgpu.gc_freeze import freeze_for_exit

    freeze_for_exit()
    sys.exit(rc)


if __name__ == "__main__":
    run()
