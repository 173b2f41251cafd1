"""Learning on the node: fine-tune a node-local copy of the model on the node's own history, promote it
only when it beats the serving one on the most recent held-back history, log every promotion, roll back.

Files, under `<state_dir>/models/`:
- `local.pt`: the node-local model the daemon serves as the mixture's "local" expert (absent: none);
- `archive/local-<n>.pt`: the promoted models, kept for rollback: the newest `KEEP_ARCHIVED` (10)
  that rollback walks back through and the `KEEP_ARCHIVED` highest-numbered, at most twice that many
  files (a checkpoint is about 0.9 MB); a promotion deletes the rest and logs a `pruned` entry naming
  them, so a rollback past the oldest kept model falls back to the global model and says why;
- `promotions.jsonl`: one JSON object per promotion, rejection or rollback, appended; rotated once it
  passes `ROTATE_AT_BYTES` (1 MiB): rewritten as one `compacted` entry that carries what the older
  entries said (the models that served in turn, the newest `MAX_SERVING_STACK` of them, and the counts
  of promotions, rejections, rollbacks and pruned models), then the newest entries that fit in
  `KEEP_BYTES` (256 KiB).

One learning round (`learn_once`): read the history (manager/history.py), hold back its last
`holdout_s` seconds of the node's clock, fine-tune a copy of the serving model (the local one when it
loads, else the global one) on the rest for a few epochs with the training loss (pinball on P50 and
P90, manager/model.py) at a small learning rate, then score both on the held-back seconds (mean
absolute error of the P50 change, normalised units, the same windows for both). The candidate is
promoted only when its error is below (1 - `min_gain`) x the serving one's; a serving local model that
does not load is replaced by the global one as the reference (and logged). A round runs in a child
process at the lowest CPU priority with one torch thread (`BackgroundLearner`), so it never holds the
daemon's interpreter lock nor delays a tick.

`vgpu model status` prints the state as JSON, with whether `local.pt`, the archived model it should
hold and the one a rollback would put back each load as the daemon loads them (`load_local`: at most
three loads, so the command stays quick); `vgpu model rollback` puts the previously promoted model
back in `local.pt` (or removes it when there was none before) and logs it (an entry and a
`local_model_rolled_back` event), under the log's lock as a promotion is. It loads the copy it would
install first and refuses, changing nothing, when that does not load, as it refuses when the file is
missing: a rollback never installs a model that cannot serve. The daemon watches `local.pt` and serves
what is there (nothing, or a file that does not load: the global model and the last value only;
`LocalModelWatcher.state`, the metric `vgpu_local_model_state`).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import math
import os
import re
import shutil
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from vgpu.capped import read_tail
from vgpu.log import get_logger
from vgpu.manager.forecast import Forecaster
from vgpu.traces import AppTrace

LOCAL = "local.pt"
LOG = "promotions.jsonl"
# The newest this many bytes of the promotion log are read (vgpu/capped.py `read_tail`): a line is a
# few hundred bytes, so that is tens of thousands of promotions; an older part is skipped with one
# log line (`promotion_log_skipped`), and a log damaged into gigabytes is never read whole.
MAX_LOG_BYTES = 8 * 1024 * 1024
# The log is rotated when an append takes it past ROTATE_AT_BYTES (thousands of entries; a round runs
# at most every few minutes, so years of them): the entries before the newest KEEP_BYTES are replaced
# by one `compacted` entry that says what they said, so `status` and `rollback` read the same after it.
# A rollback reaches back at most MAX_SERVING_STACK promotions that a rotation summarised (a name is
# about 15 bytes, so the entry stays well under KEEP_BYTES); past them it serves the global model.
ROTATE_AT_BYTES = 1024 * 1024
KEEP_BYTES = 256 * 1024
MAX_SERVING_STACK = 1000
# A promotion keeps the newest KEEP_ARCHIVED models that a rollback walks back through (the serving
# one and the KEEP_ARCHIVED - 1 before it) and the KEEP_ARCHIVED highest-numbered files (so a damaged
# or deleted log never empties the archive), and deletes every other `local-<n>.pt`: at most
# 2 x KEEP_ARCHIVED files, about 18 MB with the 0.9 MB shipped model. At least 2, so that the serving
# model and the one a rollback goes back to next are never deleted.
KEEP_ARCHIVED = 10
_LOCK = ".promotions.lock"


@dataclass(frozen=True)
class LearnConfig:
    holdout_s: float = 1800.0  # the most recent seconds held back to judge a candidate
    min_history_s: float = 3600.0  # no round before the history spans this much
    epochs: int = 3
    learning_rate: float = 1e-4
    max_windows: int = 20000
    min_gain: float = 0.02  # promote only below (1 - min_gain) x the serving model's error
    seed: int = 0


def models_dir(state_dir: str | Path) -> Path:
    return Path(state_dir) / "models"


@contextlib.contextmanager
def _log_lock(state_dir: str | Path, on_wait: Callable[[], None] | None = None) -> Iterator[None]:
    """The promotion log's lock, held by every append and for the whole of a promotion (archive, copy,
    append, prune) and of a rollback (read, decide, copy, append), so that a learning round and
    `vgpu model rollback` never interleave nor lose each other's entries to a rotation. It waits for
    another holder; `on_wait` is called first when it has to (the holder's work is file copies, not
    training, so the wait is short; a holder that dies releases it with its descriptor)."""
    d = models_dir(state_dir)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    lock_fd = os.open(d / _LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait()
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(lock_fd)  # releases the lock


def _append_log(state_dir: str | Path, entry: dict[str, Any], *, rotate_at_bytes: int = ROTATE_AT_BYTES,
                keep_bytes: int = KEEP_BYTES) -> None:
    """Append `entry` to the promotion log, then rotate the log when it is larger than
    `rotate_at_bytes`; under the log's lock."""
    with _log_lock(state_dir):
        _append_locked(state_dir, entry, rotate_at_bytes, keep_bytes)


def _append_locked(state_dir: str | Path, entry: dict[str, Any], rotate_at_bytes: int = ROTATE_AT_BYTES,
                   keep_bytes: int = KEEP_BYTES) -> None:
    d = models_dir(state_dir)
    with open(d / LOG, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(entry, sort_keys=True) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
        size = fh.tell()
    if size > rotate_at_bytes:
        _rotate(state_dir, keep_bytes)


def _rotate(state_dir: str | Path, keep_bytes: int) -> None:
    """Rewrite the log (atomically) as one `compacted` entry summing up all but its newest entries,
    then those newest entries that fit in `keep_bytes` (the newest one always)."""
    log = read_log(state_dir)
    lines = [json.dumps(e, sort_keys=True) + "\n" for e in log]
    first, size = len(lines), 0
    while first > 0 and (first == len(lines) or size + len(lines[first - 1]) <= keep_bytes):
        first -= 1
        size += len(lines[first])
    if first == 0:
        return  # nothing older to drop: every entry fits
    summary = _summarise(log[:first])
    stack = summary.stack[-MAX_SERVING_STACK:]
    compacted = {"at": time.time(), "event": "compacted", "dropped_entries": first, "serving_archive": stack,
                 "pruned_below": summary.pruned_below, **summary.counts, **trees_counts(log[:first])}
    d = models_dir(state_dir)
    tmp = d / f".{LOG}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(json.dumps(compacted, sort_keys=True) + "\n")
        fh.writelines(lines[first:])
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, d / LOG)  # the `compacted` entry itself records the rotation (no log line: the
    # commands that append print JSON on stdout)


# The node-local trees' entries (manager/nodetrees.py) and the counts a `compacted` entry keeps of them.
TREES_EVENTS = {"trees_promoted": "trees_promotions", "trees_rejected": "trees_rejections",
                "trees_rollback": "trees_rollbacks"}


def trees_counts(log: Sequence[dict[str, Any]]) -> dict[str, int]:
    """How many trees promotions, rejections and rollbacks `log` says, a `compacted` entry standing for
    the entries a rotation dropped before it."""
    counts = dict.fromkeys(TREES_EVENTS.values(), 0)
    for e in log:
        event = e.get("event")
        if event == "compacted":
            counts = {k: _count(e.get(k)) for k in counts}
        elif isinstance(event, str) and event in TREES_EVENTS:
            counts[TREES_EVENTS[event]] += 1
    return counts


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


@dataclass(frozen=True)
class _Summary:
    stack: list[str]  # the archived models that served in turn, oldest first, rollbacks and pruning applied
    counts: dict[str, int]  # promotions, rejections, rollbacks, pruned (archived models deleted)
    pruned_below: bool  # a model a rollback from the bottom of `stack` would have gone back to was pruned


def _summarise(log: Sequence[dict[str, Any]]) -> _Summary:
    """What `log` says; a `compacted` entry stands for the entries a rotation dropped before it."""
    stack: list[str] = []
    counts = {"promotions": 0, "rejections": 0, "rollbacks": 0, "pruned": 0}
    pruned_below = False
    for e in log:
        event = e.get("event")
        if event == "compacted":
            prior = e.get("serving_archive")
            stack = [a for a in prior if isinstance(a, str) and _ARCHIVED.fullmatch(a)] if isinstance(prior, list) else []
            counts = {k: _count(e.get(k)) for k in counts}
            pruned_below = e.get("pruned_below") is True
        elif event == "pruned":
            names = e.get("pruned")
            gone = {a for a in names if isinstance(a, str)} if isinstance(names, list) else set()
            counts["pruned"] += len(gone)
            if any(a in gone for a in stack):
                pruned_below = True
                stack = [a for a in stack if a not in gone]
        elif event == "promoted":
            counts["promotions"] += 1
            archived = e.get("archived")
            if isinstance(archived, str) and _ARCHIVED.fullmatch(archived):
                stack.append(archived)
        elif event == "rejected":
            counts["rejections"] += 1
        elif event == "rollback":
            counts["rollbacks"] += 1
            if stack:
                stack.pop()
            if not stack:
                pruned_below = False  # the global model serves: nothing below it to reach
    return _Summary(stack, counts, pruned_below)


def read_log(state_dir: str | Path, *, max_bytes: int = MAX_LOG_BYTES) -> list[dict[str, Any]]:
    """The promotion log, its newest `max_bytes` (an older part is skipped, said in one log line); a
    line that is not a JSON object (a crash mid-write, or damage: a line nested too deep for the parser
    raises RecursionError) is skipped."""
    path = models_dir(state_dir) / LOG
    try:
        data, skipped = read_tail(path, max_bytes)
    except FileNotFoundError:
        return []
    if skipped:
        get_logger("vgpu.manager.nodelearn").warning(
            "promotion_log_skipped", path=str(path), skipped_bytes=skipped, read_bytes=len(data),
            reason=f"only the newest {max_bytes} bytes of the promotion log are read")
    out = []
    for line in data.decode("utf-8", errors="replace").splitlines():
        try:
            entry = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(entry, dict):
            out.append(entry)
    return out


def split_recent(traces: Sequence[AppTrace], holdout_s: float) -> tuple[list[AppTrace], list[AppTrace]]:
    """(before, held back): every application cut at the node's last second minus `holdout_s`."""
    ends = [float(t.t_s[-1]) for t in traces if len(t)]
    if not ends:
        return [], []
    cut = max(ends) - holdout_s
    before: list[AppTrace] = []
    after: list[AppTrace] = []
    for t in traces:
        early = t.t_s < cut
        for keep, out in ((early, before), (~early, after)):
            if keep.any():
                out.append(AppTrace(t.app, t.t_s[keep], {c: v[keep] for c, v in t.columns.items()}, gpu=t.gpu))
    return before, after


def _dataset(traces: Sequence[AppTrace], spec: Any, max_windows: int, seed: int) -> tuple[Any, Any, Any]:
    """(x, y, mask) windows of every origin from the 10th second on (at most `max_windows`, a seeded
    sample), in the checkpoint's feature encoding."""
    import numpy as np  # noqa: PLC0415

    from vgpu.manager.features import build_grid, encode, targets  # noqa: PLC0415

    grid = build_grid(traces)
    origins = []
    for i in range(grid.n_apps):
        lo, hi = int(grid.offsets[i]), int(grid.offsets[i + 1])
        origins.append(np.arange(lo + 9, hi - 1))
    all_o = np.concatenate(origins) if origins else np.zeros(0, dtype=np.int64)
    if len(all_o) > max_windows:
        all_o = np.sort(np.random.default_rng(seed).choice(all_o, max_windows, replace=False))
    win = encode(grid, spec.window_s, all_o.astype(np.int64), spec.version)
    y, mask = targets(grid, win, spec.horizons_s)
    return win.x, y, mask


def score(checkpoint: Any, traces: Sequence[AppTrace], max_windows: int = 20000, seed: int = 0) -> float:
    """Mean absolute error of the P50 change (normalised units, dead band applied) of a checkpoint on
    the windows of `traces`; NaN when there is no window."""
    import numpy as np  # noqa: PLC0415

    from vgpu.manager.predictor import ModelForecaster, apply_deadband  # noqa: PLC0415

    x, y, mask = _dataset(traces, checkpoint.metadata.features, max_windows, seed)
    if not mask.any():
        return math.nan
    fc = ModelForecaster(checkpoint, "cpu", mode="fused")
    out = apply_deadband(fc.predict_normalised(x), np.asarray(checkpoint.metadata.p50_deadband))
    return float(np.abs(out[..., 0] - y)[mask].mean())


def finetune(checkpoint: Any, traces: Sequence[AppTrace], cfg: LearnConfig) -> Any:
    """A fine-tuned copy of the checkpoint's network (the checkpoint itself is left as it is)."""
    import copy  # noqa: PLC0415

    import numpy as np  # noqa: PLC0415
    import torch  # noqa: PLC0415

    from vgpu.manager.model import pinball_loss  # noqa: PLC0415

    torch.manual_seed(cfg.seed)
    model = copy.deepcopy(checkpoint.model).train()
    x, y, mask = _dataset(traces, checkpoint.metadata.features, cfg.max_windows, cfg.seed)
    if not mask.any():
        raise ValueError("no training window in the history")
    xt, yt, mt = torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(mask)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.learning_rate)
    rng = np.random.default_rng(cfg.seed)
    for _ in range(cfg.epochs):
        for idx in np.array_split(rng.permutation(len(x)), max(1, len(x) // 256)):
            opt.zero_grad()
            loss = pinball_loss(model(xt[idx]), yt[idx], mt[idx])
            loss.backward()  # type: ignore[no-untyped-call]  # torch's Tensor.backward is unannotated
            opt.step()
    return model.eval()


def learn_once(
    state_dir: str | Path,
    history: Sequence[AppTrace],
    global_model: str | Path,
    cfg: LearnConfig | None = None,
    *,
    logger: structlog.typing.FilteringBoundLogger | None = None,
    tune: Callable[[Any, Sequence[AppTrace], LearnConfig], Any] = finetune,
) -> dict[str, Any]:
    """One round (module docstring). Returns the log entry it appended ({"event": "skipped"} without
    appending when the history is too short)."""
    from vgpu.manager.checkpoint import CheckpointError, load_checkpoint, save_checkpoint  # noqa: PLC0415

    cfg = cfg or LearnConfig()
    log = logger or get_logger("vgpu.manager.nodelearn")
    spans = [float(t.t_s[-1] - t.t_s[0]) for t in history if len(t)]
    node_span = (max(float(t.t_s[-1]) for t in history if len(t)) - min(float(t.t_s[0]) for t in history if len(t))
                 if spans else 0.0)
    if node_span < cfg.min_history_s:
        return {"event": "skipped", "reason": f"history spans {node_span:.0f} s < {cfg.min_history_s:.0f} s"}
    before, held = split_recent(history, cfg.holdout_s)
    d = models_dir(state_dir)
    local = d / LOCAL
    reference, ref_name = None, "global"
    if local.exists():
        try:
            reference, ref_name = load_checkpoint(local), "local"
        except CheckpointError as exc:
            log.warning("local_model_unusable", path=str(local), error=str(exc))
    if reference is None:
        reference = load_checkpoint(global_model)
    serving_error = score(reference, held, cfg.max_windows, cfg.seed)
    entry: dict[str, Any] = {"at": time.time(), "reference": ref_name, "serving_error": serving_error,
                             "train_apps": len(before), "held_back_apps": len(held), "holdout_s": cfg.holdout_s}
    try:
        tuned = tune(reference, before, cfg)
        candidate_path = d / "candidate.pt"
        meta = reference.metadata
        save_checkpoint(candidate_path, tuned, type(meta)(
            config=meta.config, features=meta.features, p90_shift=meta.p90_shift, p50_deadband=meta.p50_deadband,
            training={**meta.training, "node_finetune": {"epochs": cfg.epochs, "lr": cfg.learning_rate,
                                                         "from": ref_name}},
            validation=meta.validation, git_commit=meta.git_commit))
        candidate = load_checkpoint(candidate_path)
        candidate_error = score(candidate, held, cfg.max_windows, cfg.seed)
    except (ValueError, CheckpointError, RuntimeError) as exc:
        entry |= {"event": "rejected", "reason": f"candidate failed: {exc}"}
        _append_log(state_dir, entry)
        log.warning("local_model_rejected", **_fields(entry))
        return entry
    entry["candidate_error"] = candidate_error
    if not (math.isfinite(candidate_error) and math.isfinite(serving_error)
            and candidate_error < (1 - cfg.min_gain) * serving_error):
        entry |= {"event": "rejected", "reason": "no better on the held-back history"}
        candidate_path.unlink(missing_ok=True)
        _append_log(state_dir, entry)
        log.info("local_model_rejected", **_fields(entry))
        return entry
    promote(state_dir, candidate_path, entry)
    log.info("local_model_promoted", **_fields(entry))
    return entry


def _fields(entry: dict[str, Any]) -> dict[str, Any]:
    """A log entry as log fields (structlog's own `event` is the message)."""
    return {k: v for k, v in entry.items() if k != "event"}


def promote(state_dir: str | Path, candidate: Path, entry: dict[str, Any]) -> Path:
    """Archive the candidate and put it in `local.pt` (atomically), logging `entry` as a promotion."""
    d = models_dir(state_dir)
    archive = d / "archive"
    archive.mkdir(parents=True, exist_ok=True, mode=0o700)
    # under the log's lock from the first file to the last entry: a rollback between the copy over
    # local.pt and the promotion's entry would read a log without it and put an older model back
    with _log_lock(state_dir):
        n = 1 + max((int(p.stem.split("-")[1]) for p in archive.glob("local-*.pt")
                     if p.stem.split("-")[1].isdigit()), default=0)
        kept = archive / f"local-{n}.pt"
        shutil.copyfile(candidate, kept)
        tmp = d / f".{LOCAL}.tmp"
        shutil.copyfile(candidate, tmp)
        os.replace(tmp, d / LOCAL)
        candidate.unlink(missing_ok=True)
        entry |= {"event": "promoted", "archived": kept.name}
        _append_locked(state_dir, entry)
        pruned = _prune(state_dir)
    if pruned:
        get_logger("vgpu.manager.nodelearn").info("archived_models_pruned", pruned=pruned, keep=KEEP_ARCHIVED)
    return kept


def _prune(state_dir: str | Path, keep: int = KEEP_ARCHIVED) -> list[str]:
    """Delete the archived models beyond the newest `keep` that a rollback walks back through and the
    `keep` highest-numbered files, logging a `pruned` entry first (a crash in between leaves files that
    the next promotion deletes, never a log that reads a pruned model as deleted by accident); the
    caller holds the log's lock. Returns the names deleted."""
    keep = max(2, keep)  # never the serving model nor the one a rollback goes back to next
    archive = models_dir(state_dir) / "archive"
    files = sorted((p for p in archive.glob("local-*.pt") if _ARCHIVED.fullmatch(p.name) and p.is_file()),
                   key=lambda p: int(p.stem.split("-")[1]))
    kept = set(_summarise(read_log(state_dir)).stack[-keep:]) | {p.name for p in files[-keep:]}
    gone = [p for p in files if p.name not in kept]
    if not gone:
        return []
    _append_locked(state_dir, {"at": time.time(), "event": "pruned", "pruned": [p.name for p in gone],
                               "keep": keep})
    for p in gone:
        p.unlink(missing_ok=True)
    return [p.name for p in gone]


# The names `promote` gives archived models; a log entry naming anything else (another directory, a
# path) is not one of them and is left out.
_ARCHIVED = re.compile(r"local-[0-9]+\.pt")


def serving_archive(state_dir: str | Path) -> list[str]:
    """The archived models that served in turn, oldest first, rollbacks applied: what the log says
    `local.pt` held after each promotion or rollback."""
    return _summarise(read_log(state_dir)).stack


def load_local(path: Path) -> Forecaster:
    """A node-local model as the daemon serves it (on the CPU, with the serving threads); raises
    what the load raises when the file cannot be served."""
    from vgpu.manager.predictor import SERVING_THREADS, load_forecaster  # noqa: PLC0415 - torch

    return load_forecaster(path, "cpu", threads=SERVING_THREADS)


# A load failure is said in at most this many characters (torch's own messages run to paragraphs).
MAX_PROBLEM_CHARS = 200


def _regular(path: Path) -> None:
    """OSError unless `path` is a regular file: a FIFO or a device put where a model belongs would
    block the reader (the learner's thread, `vgpu model status`) for good."""
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise OSError(f"{path} is not a regular file")


def load_problem(path: Path, load: Callable[[Path], object] = load_local) -> str | None:
    """None when `path` loads with `load`; else why not, in one short line."""
    from vgpu.manager.checkpoint import CheckpointError  # noqa: PLC0415

    try:
        _regular(path)
        load(path)
    except CheckpointError as exc:
        why = exc.problem
    except Exception as exc:  # noqa: BLE001 - any failure means it cannot be served
        why = f"{type(exc).__name__}: {exc}"
    else:
        return None
    why = " ".join(why.split())
    return why if len(why) <= MAX_PROBLEM_CHARS else why[:MAX_PROBLEM_CHARS - 3] + "..."


def rollback(state_dir: str | Path, on_wait: Callable[[], None] | None = None, *,
             load: Callable[[Path], object] = load_local) -> dict[str, Any]:
    """Put the model promoted before the serving one back in `local.pt` (or remove it when none was),
    holding the log's lock throughout (after waiting for a promotion under way: `on_wait` is called
    then), and log a `local_model_rolled_back` event. LookupError, with nothing changed, when there is
    nothing to roll back or the model to put back is missing or does not `load`."""
    with _log_lock(state_dir, on_wait):
        entry = _rollback_locked(state_dir, load)
    get_logger("vgpu.manager.nodelearn").info("local_model_rolled_back", **_fields(entry))
    return entry


def _rollback_locked(state_dir: str | Path, load: Callable[[Path], object]) -> dict[str, Any]:
    d = models_dir(state_dir)
    summary = _summarise(read_log(state_dir))
    stack = summary.stack
    if not stack:
        raise LookupError("nothing to roll back: no promoted node-local model serves")
    undone = stack.pop()
    entry: dict[str, Any] = {"at": time.time(), "event": "rollback", "undone": undone,
                             "serving": stack[-1] if stack else None}
    if not stack and summary.pruned_below:
        # the models promoted before `undone` were deleted to bound the archive: the global model serves
        entry["note"] = (f"the models promoted before {undone} were pruned from the archive (only the newest "
                         f"{KEEP_ARCHIVED} are kept): the global model serves")
    if stack:
        previous = d / "archive" / stack[-1]
        if not previous.is_file():
            # nothing changed: local.pt keeps serving, and no rollback is logged
            raise LookupError(f"cannot roll back {undone}: the model before it, {previous}, is missing "
                              "from the archive")
        tmp = d / f".{LOCAL}.tmp"
        shutil.copyfile(previous, tmp)
        problem = load_problem(tmp, load)  # the very bytes that would serve
        if problem is not None:
            tmp.unlink(missing_ok=True)
            raise LookupError(f"cannot roll back {undone}: the model before it, {previous}, does not load "
                              f"({problem}); nothing changed. To serve the global model alone, remove "
                              f"{d / LOCAL}; `vgpu model status` says which models load")
        os.replace(tmp, d / LOCAL)
    else:
        (d / LOCAL).unlink(missing_ok=True)
    _append_locked(state_dir, entry)
    return entry


def _model_check(name: str, path: Path | None, load: Callable[[Path], object]) -> dict[str, Any]:
    """`<name>_loads` (None: no file to check) and, when it does not load, `<name>_problem`."""
    if path is None:
        return {f"{name}_loads": None}
    problem = load_problem(path, load)
    return {f"{name}_loads": problem is None} | ({} if problem is None else {f"{name}_problem": problem})


def status(state_dir: str | Path, load: Callable[[Path], object] = load_local) -> dict[str, Any]:
    """The node-local model's state; `local_model`, the archived model it should hold
    (`serving_archive`) and the one a rollback would put back (`rollback_to`; None: the global model
    alone, or nothing to roll back when `rollback_depth` is 0) each with whether it loads by `load`."""
    d = models_dir(state_dir)
    log = read_log(state_dir)
    summary = _summarise(log)
    stack = summary.stack
    local = d / LOCAL
    archived = [d / "archive" / a for a in stack[-2:]]
    return {
        "local_model": str(local) if local.exists() else None,
        **_model_check("local_model", local if local.exists() else None, load),
        "serving_archive": stack[-1] if stack else None,
        **_model_check("serving_archive", archived[-1] if stack else None, load),
        "rollback_to": stack[-2] if len(stack) > 1 else None,
        **_model_check("rollback_to", archived[0] if len(stack) > 1 else None, load),
        "rollback_depth": len(stack),  # how many rollbacks reach an archived model (then the global one)
        **summary.counts,
        "last": log[-1] if log else None,
        "history": _history_files(Path(state_dir) / "history"),
    }


def unusable_local_model_advice(state: Mapping[str, Any], state_dir: str | Path) -> str:
    """What an operator does about a `local.pt` that does not load, from its `status`: put the
    archived copy of the same model back where that loads, else roll back where there is a sound
    model before it, else remove the file (the global model then serves alone)."""
    rollback = f"`vgpu model rollback --state-dir {state_dir}`"
    if state["serving_archive_loads"]:
        # local.pt damaged after its promotion: the archived copy of the same model puts it right
        archived = models_dir(state_dir) / "archive" / state["serving_archive"]
        return (f"its archived copy {archived} loads: copy that to a new file beside it and `mv` it over "
                f"{LOCAL}, or {rollback} to go back one promotion")
    if state["rollback_depth"] == 0:
        return f"no promotion is logged to roll back to: remove {state['local_model']}"
    if state["rollback_to_loads"] is False:
        return (f"{rollback} would refuse ({state['rollback_to']}, the model before it, does not load either): "
                f"remove {state['local_model']}")
    back = state["rollback_to"] or "none: the global model alone"
    return f"{rollback} puts back the model promoted before it ({back}), or remove {state['local_model']}"


def _history_files(directory: Path) -> dict[str, int]:
    """How much node history is on disk (segment files and bytes; none where there is no directory)."""
    files = [p for p in directory.glob("seg-*.csv*") if p.is_file()] if directory.is_dir() else []
    return {"segment_files": len(files), "bytes": sum(p.stat().st_size for p in files)}


class LocalModelWatcher:
    """Serves `local.pt` as the mixture's "local" expert: `poll()` loads a changed file (a failed load is
    logged once per file version and the slot left empty: the global model and the last value
    serve), and empties the slot when the file is gone (a rollback to none). `state` says which:
    "serving", "unusable" (a file that does not load) or "none" (no file). With `filename`, `loader`
    and `what` it watches another of the node's learnt experts (the trees, manager/nodetrees.py); its
    log events are `<what>` and `<what>_unusable`."""

    def __init__(self, state_dir: str | Path, set_expert: Callable[[Forecaster | None], None],
                 loader: Callable[[Path], Forecaster] = load_local,
                 logger: structlog.typing.FilteringBoundLogger | None = None, *,
                 filename: str = LOCAL, what: str = "local_model",
                 to_act: str = ("`vgpu model status` says which archived models load; `vgpu model rollback` puts the "
                                "one before back, or remove the file to serve the global model alone")) -> None:
        self.path = models_dir(state_dir) / filename
        self.what, self.to_act = what, to_act
        self._set = set_expert
        self._loader = loader
        self._log = logger or get_logger("vgpu.manager.nodelearn")
        self._sig: tuple[int, int] | None = None
        self.loaded = 0
        self.failures = 0
        self.state = "none"

    def poll(self) -> None:
        try:
            st = os.stat(self.path)
            sig: tuple[int, int] | None = (st.st_mtime_ns, st.st_size)
        except OSError:
            sig = None
        if sig == self._sig:
            return
        self._sig = sig
        if sig is None:
            self._set(None)
            self.state = "none"
            self._log.info(self.what, serving=None)
            return
        try:
            _regular(self.path)
            model = self._loader(self.path)
        except Exception as exc:  # noqa: BLE001 - any unusable file: no local expert, the others serve
            self.failures += 1
            self._set(None)
            self.state = "unusable"
            self._log.warning(f"{self.what}_unusable", path=str(self.path), error=repr(exc), to_act=self.to_act)
            return
        self.loaded += 1
        self._set(model)
        self.state = "serving"
        self._log.info(self.what, serving=str(self.path))


class BackgroundLearner:
    """A daemon thread: polls `local.pt` (and runs `housekeeping`) every `poll_s` and every `interval_s` runs one learning round
    in a child process (`python -m vgpu.manager.nodelearn learn ...`) at the lowest CPU priority with
    one torch thread, waiting for it without holding anything the forecasting needs."""

    def __init__(self, state_dir: str | Path, history_dir: str | Path, global_model: str | Path,
                 watcher: LocalModelWatcher, *, interval_s: float = 3600.0, poll_s: float = 5.0,
                 housekeeping: Callable[[], object] | None = None,
                 also_watch: Sequence[LocalModelWatcher] = (), trees: bool = True,
                 logger: structlog.typing.FilteringBoundLogger | None = None) -> None:
        self.state_dir, self.history_dir, self.global_model = Path(state_dir), Path(history_dir), Path(global_model)
        self.watcher = watcher
        self.watchers = (watcher, *also_watch)  # polled together: the network's file and the trees'
        self.trees = trees  # each round fits node-local trees too
        self.housekeeping = housekeeping  # e.g. the history's compression of closed segments, each poll
        self.interval_s, self.poll_s = interval_s, poll_s
        self._log = logger or get_logger("vgpu.manager.nodelearn")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="node-learner", daemon=True)
        self._child: subprocess.Popen[bytes] | None = None
        self.rounds = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        child = self._child
        if child is not None and child.poll() is None:
            child.terminate()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        next_round = time.monotonic() + self.interval_s
        while not self._stop.is_set():
            self._poll()
            if self.housekeeping is not None:
                try:
                    self.housekeeping()
                except Exception as exc:  # noqa: BLE001 - housekeeping must not end the thread
                    self._log.error("node_housekeeping_failed", error=repr(exc))
            if self.interval_s > 0 and time.monotonic() >= next_round:
                next_round = time.monotonic() + self.interval_s
                self._round()
            self._stop.wait(self.poll_s)

    def _round(self) -> None:
        cmd = [sys.executable, "-m", "vgpu.manager.nodelearn", "learn", "--state-dir", str(self.state_dir),
               "--history-dir", str(self.history_dir), "--global-model", str(self.global_model),
               *(() if self.trees else ("--no-trees",))]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        try:
            # the child lowers its own priority first thing (a preexec_fn is unsafe in a threaded daemon)
            self._child = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            _, err = self._child.communicate()
        except OSError as exc:
            self._log.error("node_learning_failed", error=repr(exc))
            return
        self.rounds += 1
        if self._child.returncode != 0 and not self._stop.is_set():
            self._log.error("node_learning_failed", rc=self._child.returncode, stderr=err.decode(errors="replace")[-2000:])
        self._poll()

    def _poll(self) -> None:
        for w in self.watchers:
            w.poll()


# --- the commands ---------------------------------------------------------------------------------
def model_main(argv: Sequence[str] | None = None, prog: str = "vgpu model") -> int:
    """`vgpu model status|rollback [--state-dir DIR] [--config FILE]`."""
    from vgpu import config  # noqa: PLC0415

    p = argparse.ArgumentParser(prog=prog, description="the node-local forecaster: status and rollback")
    p.add_argument("action", choices=("status", "rollback"),
                   help="status: the node-local model and its promotions, as JSON; rollback: put the model "
                   "promoted before the serving one back (or none)")
    p.add_argument("--state-dir", default=None,
                   help="the daemon's state directory (default: server.state_dir of the configuration, "
                   f"{config.DEFAULT_STATE_DIR})")
    p.add_argument("--config", type=Path, default=None,
                   help=f"configuration file (default {config.DEFAULT_CONFIG_PATH} if present)")
    p.add_argument("--trees", action="store_true",
                   help="rollback: the node-local trees (manager/nodetrees.py) instead of the network")
    args = p.parse_args(argv)
    if args.trees and args.action != "rollback":
        p.error("--trees goes with rollback (status always shows the trees)")
    state_dir = args.state_dir
    if state_dir is None:
        # the daemon's own: its configuration file and VGPU_SERVER_STATE_DIR, as `vgpu serve` reads them
        try:
            state_dir = str(config.load(args.config).server.state_dir)
        except config.ConfigError as exc:
            print(f"{prog}: configuration error: {exc}", file=sys.stderr)
            return 2
    if not Path(state_dir).is_dir():
        # a mistyped directory would otherwise read as a node with no history and no models
        print(f"{prog}: no state directory at {state_dir}: give the daemon's server.state_dir with --state-dir",
              file=sys.stderr)
        return 2
    from vgpu.manager import nodetrees  # noqa: PLC0415 - a cycle at import time: nodetrees uses this module

    if args.action == "status":
        state = status(state_dir)
        state |= nodetrees.trees_status(state_dir, read_log(state_dir))
        print(json.dumps(state, indent=2, sort_keys=True))
        if state["local_model_loads"] is False:
            # stdout stays one JSON document; the warning a person reads goes to stderr
            print(f"{prog}: {state['local_model']} does not load ({state['local_model_problem']}): the daemon serves "
                  f"without it; {unusable_local_model_advice(state, state_dir)}", file=sys.stderr)
        if state["trees"] is None and state["trees_rollback_to_loads"]:
            print(f"{prog}: no trees serve, and earlier ones that load are kept ({state['trees_rollback_to']}): "
                  f"`{prog} rollback --trees --state-dir {state_dir}` serves them again (until a learning round "
                  "promotes new ones)", file=sys.stderr)
        if state["trees_loads"] is False:
            print(f"{prog}: {state['trees_problem']}: the daemon serves without the trees; "
                  f"{nodetrees.unusable_trees_advice(state, state_dir, prog)}", file=sys.stderr)
        return 0
    def waiting() -> None:
        print(f"{prog}: a promotion or rollback is under way (the promotion log is locked): waiting for it",
              file=sys.stderr, flush=True)

    try:
        entry = nodetrees.rollback_trees(state_dir, waiting) if args.trees else rollback(state_dir, waiting)
    except LookupError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    if "note" in entry:
        print(f"{prog}: {entry['note']}", file=sys.stderr)
    print(json.dumps(entry, sort_keys=True))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m vgpu.manager.nodelearn learn ...`: one round of each of the node's learnt experts (the
    trees of manager/nodetrees.py, then the network), as the background learner runs them."""
    p = argparse.ArgumentParser(prog="vgpu.manager.nodelearn")
    p.add_argument("action", choices=("learn",))
    p.add_argument("--state-dir", required=True)
    p.add_argument("--history-dir", required=True)
    p.add_argument("--global-model", required=True)
    p.add_argument("--no-trees", action="store_true", help="fit no node-local trees (manager.node_trees = false)")
    args = p.parse_args(argv)
    os.nice(19)  # the lowest CPU priority: the node's jobs and the daemon come first
    import torch  # noqa: PLC0415

    from vgpu.manager.history import NodeHistory  # noqa: PLC0415
    from vgpu.manager.nodetrees import learn_round  # noqa: PLC0415

    torch.set_num_threads(1)
    history = NodeHistory(args.history_dir).read()
    rc = 0
    # the trees first: seconds of CPU, where the network's fine-tuning takes minutes; one failing
    # leaves the other's round to run
    rounds: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("trees", lambda: learn_round(args.state_dir, history)),
        ("network", lambda: learn_once(args.state_dir, history, args.global_model)),
    ][1 if args.no_trees else 0:]
    for name, one_round in rounds:
        try:
            entry = one_round()
        except Exception as exc:  # noqa: BLE001 - reported on stderr, which the daemon logs
            print(f"{name} round failed: {exc!r}", file=sys.stderr)
            rc = 1
            continue
        print(json.dumps({"round": name, **entry}, sort_keys=True, default=str))
    return rc


if __name__ == "__main__":
    sys.exit(main())
