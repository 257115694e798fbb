"""Checkpoints: sharded, written durably and atomically, verified before a restart resumes
from them, at the same or a different world size.

    <dir>/step-000012/
        weights/                 Hugging Face folder (bf16, `kubestar.training.weights`): what
                                 engines and `kubestar eval` load
        trainer/                 fp32 weights + AdamW moments (torch.distributed.checkpoint):
            .metadata            every tensor's global shape and where each piece of it lies
            __0_0.distcp ...     one file per rank, each with that rank's shards
        state.json               where the run is: stage, step in stage, global step, RNG,
                                 filters
        manifest.json            every other file's size and sha256; written last
    <dir>/.tmp-step-000012-PID/  a save in progress (or one that died): never resumed from
    <dir>/.bad-step-000010/      a checkpoint that failed its manifest, set aside (never
                                 deleted by kubestar)

Every rank writes its own shards (nothing is gathered) into a temporary folder. Once all
have finished, each rank hashes its own shard files (sha256, still in its page cache, all ranks
at once) and fsyncs them; rank 0 gathers the hashes, hashes and fsyncs the rest, writes
state.json and manifest.json (fsynced), fsyncs the folders, renames the folder to
step-NNNNNN and fsyncs its parent: a power loss leaves either no checkpoint or a whole one.
Then it prunes all but the newest `keep` good ones.

A restart resumes from the newest checkpoint that verifies (`newest_good`): every file the
manifest names is there with its size and sha256, and nothing else is. One that does not
is logged (which file, why), renamed to .bad-step-NNNNNN and the one before is tried; rank 0
decides and every rank follows. Checkpoints written before manifests existed load unverified.

Failures are agreed on: after each part of a save every rank learns whether any rank failed,
so all raise the same CheckpointError (or CheckpointVolumeFull, when the volume is out of
space or quota) and none is left waiting in a collective; the partial folder is removed.

On load, torch.distributed.checkpoint reads the pieces each rank's shards need, whatever the
world size that wrote them: a run saved by 2 ranks resumes on 1 or on 4. At world size 1 the
format is the same (one file). In a world over several machines the checkpoint folder must
be one shared file system (a ReadWriteMany volume).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from kubestar.api.conditions import Reason
from kubestar.api.trainer_contract import ENV_CHECKPOINT_VOLUME
from kubestar.training.distributed import SINGLE, World, all_gather, broadcast
from kubestar.training.policy import Policy
from kubestar.training.stopping import FinalFailure
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

log = logging.getLogger(__name__)

T = TypeVar("T")

PREFIX = "step-"
TMP_PREFIX = ".tmp-"
BAD_PREFIX = ".bad-"
TRAINER = "trainer"
WEIGHTS = "weights"
STATE_FILE = "state.json"
MANIFEST_FILE = "manifest.json"
MANIFEST_VERSION = 1
# Out of space, or out of the volume's quota: more of the same volume will not help.
FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class CheckpointError(Exception):
    """A checkpoint could not be written or read. Raised on every rank alike."""


class CheckpointVolumeFull(CheckpointError, FinalFailure):
    """The checkpoint volume ran out of space (or quota) during a save: the message names
    the folder, the volume, the space left and what to do."""

    # How the trainer states it (termination message, status condition).
    reason = Reason.CHECKPOINT_VOLUME_FULL


@dataclass
class RunState:
    global_step: int = 0  # RL steps done, over all stages
    stage_index: int = 0
    stage_step: int = 0  # RL steps done in the current stage
    sft_done: bool = False
    # Per stage: the problem ids it trains on once its filter ran (kept across restarts).
    stage_problems: dict[str, list[str]] = field(default_factory=dict)
    rng_state: Any = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, default=str)

    @classmethod
    def from_json(cls, text: str) -> RunState:
        data = json.loads(text)
        state = cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})
        if isinstance(state.rng_state, list):  # JSON turns random.getstate's tuples into lists
            version, internal, gauss = state.rng_state
            state.rng_state = (version, tuple(internal), gauss)
        return state


# -- saving ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Failure:
    """What went wrong on one rank, in a form every rank can be sent."""

    rank: int
    errno: int | None
    words: str


class _Failed(Exception):
    def __init__(self, failures: list[_Failure]) -> None:
        super().__init__("; ".join(f"rank {f.rank}: {f.words}" for f in failures))
        self.failures = failures


def _attempt(work: Callable[[], T]) -> tuple[T | None, Exception | None]:
    try:
        return work(), None
    except Exception as error:
        return None, error


def _agree(world: World, value: T, error: Exception | None) -> list[T]:
    """Every rank's `value` once every rank has got here; raises _Failed on every rank alike
    when any rank brought an error, so that none goes on into a collective the others left."""
    failure = None
    if error is not None:
        failure = _Failure(world.rank, full_errno(error), _words(error))
    gathered = all_gather((value, failure), world)
    failures = [f for _, f in gathered if f is not None]
    if failures:
        raise _Failed(failures)
    return [v for v, _ in gathered]


def save(
    directory: Path, policy: Policy, state: RunState, keep: int, weights: Path | None = None
) -> Path:
    """Write a checkpoint of `policy` and `state`; every rank calls it. `weights`: the engines'
    folder this step already wrote (rank 0's path), linked into the checkpoint instead of
    gathered again (without it the weights are gathered here: a rank that fails while
    writing them leaves the others waiting in that collective until it exits).

    Raises CheckpointVolumeFull (or CheckpointError) on every rank when any rank failed, once
    the partial folder is gone."""
    world = policy.world
    final = directory / f"{PREFIX}{state.global_step:06d}"
    tmp = directory / f"{TMP_PREFIX}{final.name}-{os.getpid()}"
    try:
        made, error = _attempt(lambda: _begin(directory, tmp)) if world.main else (tmp, None)
        tmp = _agree(world, made, error)[0] or tmp  # rank 0's process id names the folder
        error = None
        if weights is None and world.sharded:
            policy.save_weights(tmp / WEIGHTS)  # collective (see above)
        elif weights is None:
            _, error = _attempt(lambda: policy.save_weights(tmp / WEIGHTS))
        elif world.main:
            _, error = _attempt(lambda: _link_folder(weights, tmp / WEIGHTS))
        # Every rank writes its shards even when rank 0 could not link the weights: a rank
        # that skipped the collective would leave the others waiting in it.
        _, sharded = _attempt(lambda: _save_sharded(policy, tmp / TRAINER))
        error = error or sharded
        # Each rank hashes its own shard files (in its page cache, all ranks at once; on a
        # shared file system rank 0 could read them all, but alone and from the network) and
        # fsyncs them; rank 0 gets every rank's hashes.
        own: dict[str, dict[str, Any]] | None = None
        if error is None:
            own, error = _attempt(lambda: _own_shards(tmp, world.rank))
        hashed = _agree(world, own, error)
        error = None
        if world.main:
            _, error = _attempt(lambda: _commit(directory, tmp, final, state, hashed, keep))
        _agree(world, None, error)  # the checkpoint is in place, or every rank raises
    except _Failed as failed:
        raise _failed_save(failed, world, directory, tmp, final, keep) from None
    return final


def _begin(directory: Path, tmp: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def _save_sharded(policy: Policy, folder: Path) -> None:
    # sync_files: torch.distributed.checkpoint fsyncs each file it writes (its default, said
    # here so that it stays so); the manifest's pass fsyncs them again, cheaply.
    writer = FileSystemWriter(folder, sync_files=True)
    try:
        with _single_process_quiet():
            dcp_save(policy.state(), storage_writer=writer, no_dist=not policy.world.sharded)
    except CheckpointException as error:  # a BaseException: make it an ordinary error
        raise CheckpointError(_words(error)) from _first_failure(error)


def _own_shards(tmp: Path, rank: int) -> dict[str, dict[str, Any]]:
    """Size and sha256 of the shard files this rank wrote (torch.distributed.checkpoint names
    them __RANK_N.distcp), each fsynced. Files no rank claims are rank 0's to hash."""
    return {
        f"{TRAINER}/{path.name}": _digest(path, sync=True)
        for path in sorted((tmp / TRAINER).glob(f"__{rank}_*"))
    }


def _commit(
    directory: Path,
    tmp: Path,
    final: Path,
    state: RunState,
    hashed: list[dict[str, dict[str, Any]] | None],
    keep: int,
) -> None:
    """Rank 0, once every rank's shards are on disk: state.json, the rest hashed and fsynced,
    the manifest (written last: it covers state.json too), the folders fsynced, the rename
    that makes the checkpoint exist, and pruning."""
    _write_durably(tmp / STATE_FILE, state.to_json())
    files: dict[str, dict[str, Any]] = {}
    for part in hashed:
        files.update(part or {})
    for path in _files(tmp):
        name = path.relative_to(tmp).as_posix()
        if name not in files:
            files[name] = _digest(path, sync=True)
    manifest = {"version": MANIFEST_VERSION, "files": dict(sorted(files.items()))}
    _write_durably(tmp / MANIFEST_FILE, json.dumps(manifest, indent=1) + "\n")
    for folder in sorted({p.parent for p in _files(tmp)}, key=lambda p: -len(p.parts)):
        _fsync_dir(folder)  # the names in it (the .metadata rename, say), deepest first
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)  # the checkpoint exists only once it is complete
    _fsync_dir(final)
    _fsync_dir(directory)  # the rename itself
    try:
        _prune(directory, keep)
    except OSError as error:  # the checkpoint is in place; pruning is tried again next time
        log.warning(f"pruning checkpoints in {directory}: {_words(error)}")


def _failed_save(
    failed: _Failed, world: World, directory: Path, tmp: Path, final: Path, keep: int
) -> CheckpointError:
    """Every rank is here (the failure was agreed on): rank 0 removes the partial folder, so
    that the space returns, and says what happened; every rank raises the same."""
    message: tuple[bool, str] | None = None
    if world.main:
        shutil.rmtree(tmp, ignore_errors=True)
        full = next((f for f in failed.failures if f.errno in FULL_ERRNOS), None)
        if full is not None:
            message = (True, _full_message(directory, final, full, keep))
        else:
            first = failed.failures[0]
            message = (False, f"checkpoint {final} failed on rank {first.rank}: {first.words}")
    agreed = broadcast(message, world)
    assert agreed is not None
    full_volume, text = agreed
    return CheckpointVolumeFull(text) if full_volume else CheckpointError(text)


def _full_message(directory: Path, final: Path, failure: _Failure, keep: int) -> str:
    return _full_volume(
        directory,
        f"writing {final.name} failed on rank {failure.rank} ({failure.words}); the partial "
        "checkpoint was removed",
        keep,
    )


def _full_volume(directory: Path, what: str, keep: int) -> str:
    """One line: the folder and its volume, what failed, the space left, what to do."""
    volume = os.environ.get(ENV_CHECKPOINT_VOLUME, "")
    where = f"{directory} ({volume})" if volume else str(directory)
    space = "free space unknown"
    try:
        usage = shutil.disk_usage(directory)
        space = f"{_bytes(usage.free)} free of {_bytes(usage.total)}"
    except OSError:
        pass
    bad = sorted(p.name for p in directory.glob(f"{BAD_PREFIX}*"))
    aside = f"; {', '.join(bad)} (set aside as bad) can go once looked at" if bad else ""
    return (
        f"checkpoint volume full: {where}: {what}; {space}. Give the run a bigger volume "
        "(spec.checkpoint.storage, or a larger claim in spec.checkpoint.pvcClaimName) or keep "
        f"fewer checkpoints (spec.checkpoint.keep, now {keep}){aside}"
    )


def volume_full(error: BaseException, directory: Path, keep: int) -> CheckpointVolumeFull | None:
    """An error raised outside a save (the weights pushed to the engines, which lie on the
    checkpoint volume in a cluster) that is the volume of `directory` running full, as a
    CheckpointVolumeFull; None for any other error."""
    if isinstance(error, CheckpointVolumeFull):
        return error
    if full_errno(error) is None:
        return None
    filename = next((e.filename for e in _chain(error) if isinstance(e, OSError)), None)
    if filename and not _same_volume(Path(os.fsdecode(filename)), directory):
        return None
    return CheckpointVolumeFull(_full_volume(directory, _words(error), keep))


def full_errno(error: BaseException) -> int | None:
    """ENOSPC or EDQUOT when that is what `error` (or what caused it, or a failure inside a
    torch.distributed.checkpoint exception) comes down to."""
    for item in _chain(error):
        if isinstance(item, OSError) and item.errno in FULL_ERRNOS:
            return item.errno
    text = str(error)  # errors from native code (safetensors) carry only the OS's words
    return next((n for n in FULL_ERRNOS if os.strerror(n) in text), None)


def _chain(error: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    stack = [error]
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        yield item
        if isinstance(item, CheckpointException):
            stack += [failure for failure, _ in item.failures.values()]
        stack += [c for c in (item.__cause__, item.__context__) if c is not None]


def _first_failure(error: CheckpointException) -> BaseException | None:
    return next((failure for failure, _ in error.failures.values()), None)


def _words(error: BaseException) -> str:
    """One line: the error's type and message (for torch.distributed.checkpoint's, the first
    failing rank's own error instead of every rank's traceback)."""
    if isinstance(error, CheckpointException):
        inner = _first_failure(error)
        return _words(inner) if inner is not None else "torch.distributed.checkpoint failed"
    if isinstance(error, CheckpointError) and error.__cause__ is not None:
        return _words(error.__cause__)
    if isinstance(error, OSError) and error.strerror:
        name = f": {os.fsdecode(error.filename)}" if error.filename else ""
        return f"{type(error).__name__}: [Errno {error.errno}] {error.strerror}{name}"
    return " ".join(f"{type(error).__name__}: {error}".split())


def _same_volume(path: Path, directory: Path) -> bool:
    def device(p: Path) -> int | None:
        for candidate in (p, *p.parents):
            try:
                return candidate.stat().st_dev
            except OSError:
                continue
        return None

    return device(path) == device(directory)


def _bytes(count: int) -> str:
    size = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{count} B"
        size /= 1024
    return f"{count} B"


# -- files ----------------------------------------------------------------------------------


def _files(folder: Path) -> list[Path]:
    """Every file below `folder`, but the manifest."""
    return sorted(
        p for p in folder.rglob("*") if p.is_file() and p.relative_to(folder) != Path(MANIFEST_FILE)
    )


def _digest(path: Path, sync: bool = False) -> dict[str, Any]:
    """{"size", "sha256"} of a file as it is on disk; `sync`: fsync it too (on the same
    descriptor: whoever wrote it, its data reach the disk)."""
    with path.open("rb") as handle:
        digest = hashlib.file_digest(handle, "sha256").hexdigest()
        if sync:
            os.fsync(handle.fileno())
        size = os.fstat(handle.fileno()).st_size
    return {"size": size, "sha256": digest}


def _write_durably(path: Path, text: str) -> None:
    with path.open("w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def _fsync_dir(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _link_folder(source: Path, target: Path) -> None:
    """Hard links to the files of `source` (written once, never changed), copies where the
    two lie on different file systems."""
    target.mkdir()
    for file in source.iterdir():
        try:
            os.link(file, target / file.name)
        except OSError:
            try:
                shutil.copy2(file, target / file.name)
            except OSError as error:  # name the file being written, not the one read
                raise OSError(error.errno, error.strerror, str(target / file.name)) from error


# -- loading --------------------------------------------------------------------------------


class Verdict(NamedTuple):
    """What a checkpoint's manifest says of it: `problem` is "" when it verifies (or has no
    manifest, `verified` False then), else the file and what is wrong with it."""

    verified: bool
    problem: str = ""


def verify(path: Path, world: World = SINGLE) -> Verdict:
    """Check every file of `path` against its manifest (collective: rank 0 checks the
    listing and sizes, then the ranks share the hashing); the same verdict on every rank."""
    plan: tuple[Verdict | None, list[list[str]], dict[str, dict[str, Any]]] | None = None
    if world.main:
        try:
            plan = _verify_plan(path, world.size)
        except OSError as error:  # a file gone while listed: the others wait for the plan
            plan = Verdict(True, f"unreadable ({_words(error)})"), [], {}
    agreed = broadcast(plan, world)
    assert agreed is not None
    early, parts, files = agreed
    if early is not None:
        return early
    problem = ""
    for name in parts[world.rank]:
        try:
            found = _digest(path / name)
        except OSError as error:
            problem = f"{name}: unreadable ({_words(error)})"
            break
        if found["size"] != files[name]["size"]:  # changed since rank 0 looked
            problem = f"{name}: {found['size']} bytes, the manifest says {files[name]['size']}"
            break
        if found["sha256"] != files[name]["sha256"]:
            problem = (
                f"{name}: sha256 {found['sha256'][:16]}... does not match the manifest's "
                f"{files[name]['sha256'][:16]}..."
            )
            break
    problems = [p for p in all_gather(problem, world) if p]
    return Verdict(True, problems[0] if problems else "")


def _verify_plan(
    path: Path, size: int
) -> tuple[Verdict | None, list[list[str]], dict[str, dict[str, Any]]]:
    """Rank 0's part: the manifest read, the folder listed and sized against it (a verdict
    already when anything is off), else which rank hashes which files (balanced by bytes)."""
    parts: list[list[str]] = [[] for _ in range(size)]
    files, problem = _manifest(path)
    if files is None:
        return Verdict(problem != "", problem), parts, {}
    problem = _listing_problem(path, files)
    if problem:
        return Verdict(True, problem), parts, {}
    loads = [0] * size
    for name in sorted(files, key=lambda n: (-int(files[n]["size"]), n)):
        rank = loads.index(min(loads))
        parts[rank].append(name)
        loads[rank] += int(files[name]["size"])
    return None, parts, files


def _manifest(path: Path) -> tuple[dict[str, dict[str, Any]] | None, str]:
    """The manifest's files; (None, "") when there is none (an older checkpoint), (None,
    why) when it cannot be read."""
    manifest = path / MANIFEST_FILE
    if not manifest.exists():
        return None, ""
    try:
        data = json.loads(manifest.read_text())
        files = data["files"]
        if not isinstance(files, dict) or not all(
            isinstance(v, dict) and {"size", "sha256"} <= v.keys() for v in files.values()
        ):
            raise ValueError("no size and sha256 for every file")
        return files, ""
    except (OSError, ValueError, KeyError, TypeError) as error:
        return None, f"{MANIFEST_FILE}: unreadable ({_words(error)})"


def _listing_problem(path: Path, files: dict[str, dict[str, Any]]) -> str:
    """The first file missing, of another size than the manifest says, or not in it."""
    on_disk = {p.relative_to(path).as_posix(): p for p in _files(path)}
    for name, entry in sorted(files.items()):
        if name not in on_disk:
            return f"{name}: missing"
        size = on_disk[name].stat().st_size
        if size != entry["size"]:
            return f"{name}: {size} bytes, the manifest says {entry['size']}"
    extra = sorted(set(on_disk) - set(files))
    return f"{extra[0]}: not in the manifest" if extra else ""


def newest_good(directory: Path, world: World = SINGLE) -> Path | None:
    """The newest complete checkpoint that verifies (or has no manifest: written before
    manifests, loaded unverified), or None. Bad ones on the way are logged, one line each
    naming the file and why, and renamed to .bad-step-NNNNNN. Collective; rank 0's view of
    the folder decides."""
    candidates = broadcast(_complete(directory) if world.main else None, world) or []
    for path in reversed(candidates):
        verdict = verify(path, world)
        if not verdict.problem:
            if not verdict.verified and world.main:
                log.warning(
                    f"checkpoint {path} has no {MANIFEST_FILE} (written before checkpoints had "
                    "checksums): resuming from it unverified",
                    extra={"fields": {"checkpoint": str(path)}},
                )
            return path
        if world.main:
            try:
                _set_aside(path, verdict.problem, "trying the one before")
            except OSError as error:  # skipped all the same; the other ranks go on with it
                log.warning(f"checkpoint {path} is bad: {verdict.problem}; {_words(error)}")
    return None


def latest(directory: Path) -> Path | None:
    """The newest complete checkpoint (a step-NNNNNN folder with its state.json), or None,
    unverified (see newest_good)."""
    complete = _complete(directory)
    return complete[-1] if complete else None


def load(path: Path, policy: Policy) -> RunState:
    """Load a checkpoint into `policy` (collective; every rank reads the pieces of its own
    shards) and return the run's state."""
    main = policy.world.main
    sharded = (path / TRAINER / ".metadata").exists() if main else None
    if not broadcast(sharded, policy.world):
        found = sorted(p.name for p in path.iterdir()) if main else []
        raise FileNotFoundError(
            f"{path} has no sharded trainer state ({TRAINER}/.metadata; found {found}): it was "
            "written by an older kubestar; start the run again with --fresh"
        )
    state = policy.state()  # this rank's shards, of the current world's shapes
    try:
        with _single_process_quiet():
            dcp_load(state, checkpoint_id=path / TRAINER, no_dist=not policy.world.sharded)
    except CheckpointException as error:  # a BaseException: make it an ordinary error
        raise CheckpointError(f"loading {path}: {_words(error)}") from _first_failure(error)
    policy.load_state(state)
    run = RunState.from_json((path / STATE_FILE).read_text()) if main else None
    return broadcast(run, policy.world) or RunState()


@contextmanager
def _single_process_quiet() -> Iterator[None]:
    """World size 1 needs no process group; DCP warns that it assumes so every time."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


# -- the folder -----------------------------------------------------------------------------


def _complete(directory: Path) -> list[Path]:
    return [p for p in sorted(directory.glob(f"{PREFIX}*")) if (p / STATE_FILE).exists()]


def _set_aside(path: Path, problem: str, then: str) -> Path:
    """Rename a bad checkpoint to .bad-step-NNNNNN (kept for a person to look at), logging
    one line that names the file and why."""
    target = path.parent / f"{BAD_PREFIX}{path.name}"
    number = 1
    while target.exists():
        target = path.parent / f"{BAD_PREFIX}{path.name}-{number}"
        number += 1
    path.rename(target)
    log.warning(
        f"checkpoint {path} is bad: {problem}; moved aside to {target.name}; {then}",
        extra={"fields": {"checkpoint": str(path), "problem": problem, "moved_to": str(target)}},
    )
    return target


def _prune(directory: Path, keep: int) -> None:
    """Keep the newest `keep` good checkpoints (by their manifest's listing and sizes; one
    without a manifest counts as good), drop older ones and saves that never finished. One
    that fails its manifest is set aside and not counted, so the only good one is never
    dropped for it."""
    good = 0
    for path in reversed(_complete(directory)):
        if good >= keep:
            shutil.rmtree(path, ignore_errors=True)
            continue
        files, problem = _manifest(path)
        problem = problem or (_listing_problem(path, files) if files is not None else "")
        if problem:
            _set_aside(path, problem, "not counted among the checkpoints kept")
        else:
            good += 1
    for unfinished in directory.glob(f"{TMP_PREFIX}*"):
        shutil.rmtree(unfinished, ignore_errors=True)
