"""vgpu/gc_freeze.py: the start-up heap is collected, then frozen out of the collector's full passes."""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_fixtures import ROOT, sim_daemon

from vgpu.gc_freeze import freeze_startup_heap


@pytest.fixture
def unfrozen() -> Iterator[None]:
    """Give the test process its heap back afterwards (pytest goes on making and dropping objects)."""
    gc.unfreeze()
    try:
        yield
    finally:
        gc.unfreeze()


# Run in a fresh interpreter: `gc.collect()` does nothing while another thread's collection is under
# way, and the test process has threads left by earlier tests (gRPC's, a stub's) that may be collecting.
COLLECT_THEN_FREEZE = """
import gc, weakref
from vgpu.gc_freeze import freeze_startup_heap

class Node:
    other = None

a, b = Node(), Node()
a.other, b.other = b, a  # a cycle: only the cyclic collector frees it
gone = weakref.ref(a)
del a, b
kept = [Node() for _ in range(1000)]
frozen = freeze_startup_heap()
assert gone() is None, "the cycle was kept"  # collected before the freeze, not kept forever
assert frozen == gc.get_freeze_count() >= len(kept), (frozen, gc.get_freeze_count())
assert all(not gc.is_finalized(k) for k in kept)
print("ok")
"""


def test_garbage_from_start_up_is_collected_and_the_rest_frozen() -> None:
    r = subprocess.run([sys.executable, "-c", COLLECT_THEN_FREEZE], cwd=ROOT, capture_output=True, text=True,
                       timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_a_full_collection_after_the_freeze_walks_only_what_came_later(unfrozen: None) -> None:
    """The objects alive at the freeze are in no generation a collection walks; those made after are."""
    startup = [[i] for i in range(100_000)]  # tracked containers, as start-up leaves behind
    walked_before = len(gc.get_objects())  # every generation a full collection walks
    freeze_startup_heap()
    later = [[i] for i in range(1000)]
    walked_after = len(gc.get_objects())
    assert walked_after < walked_before - len(startup)
    walked = {id(o) for o in gc.get_objects()}
    assert id(startup[0]) not in walked and id(later[0]) in walked


async def test_a_daemon_in_this_process_gives_the_heap_back_when_it_stops(tmp_path: Path, unfrozen: None) -> None:
    """vgpu serve freezes its start-up heap, and again once its background loads (the cold-start
    sizer, the shipped forecaster), begun after `serving`, are over; stopped, it thaws it, so a
    process that goes on (this test run) collects its cycles again."""
    d = sim_daemon(tmp_path)
    await d.start()
    try:
        at_serving = gc.get_freeze_count()
        assert at_serving > 10_000
        assert d._refreeze is not None
        await asyncio.wait_for(asyncio.shield(d._refreeze), timeout=60)
        assert not d.loads_running()
        assert gc.get_freeze_count() > at_serving  # what the loads left alive is frozen too
    finally:
        await d.stop("test")
    assert gc.get_freeze_count() == 0


@pytest.mark.parametrize(("argv", "rc"), [(["--version"], 0), (["no-such-command"], 2)])
def test_the_vgpu_program_exits_with_its_status_and_its_heap_frozen_after_its_exit_handlers(argv: list[str], rc: int) -> None:
    """`vgpu` (vgpu.cli.run) freezes the heap before it exits, so the interpreter's final full
    collection walks nothing (about a second of every `vgpu serve` stop with torch loaded); exit
    handlers still run after that, and the command's exit status is kept."""
    code = ("import atexit, gc, sys\n"
            "atexit.register(lambda: print('frozen at exit:', gc.get_freeze_count() > 1000, flush=True))\n"
            "from vgpu import cli\n"
            f"sys.argv = ['vgpu', *{argv!r}]\n"
            "cli.run()\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == rc, out.stderr
    assert out.stdout.splitlines()[-1] == "frozen at exit: True", out.stdout + out.stderr
