"""A checkpoint step's files as they were saved, and the check that they still are.

Orbax notices a file cut short or missing only sometimes, and reads a changed byte in a compressed
array as a wrong value without a word. So when a step is committed (every process has written its
shards, and just before Orbax renames it into place: `_commit.RecordedPath`), process 0 records the
size and CRC-32 of every file of its items (`record`, into `<step>/jshard_files.json`), and `restore`
and `load_plan` check the files they are about to read against that record first (`damage`): a
file cut short, grown, changed or missing is named. Reading a step is then one pass more over its
files (CRC-32 runs at a few GB/s). A step with no record cannot be verified (`verified`), and is
never read.
"""

from __future__ import annotations

import json
import os
import zlib

RECORD = "jshard_files.json"
FORMAT = "jshard.checkpoint.files/1"
_CHUNK = 1 << 24


def record(step_dir: str) -> None:
    """Writes the size and CRC-32 of every file under `step_dir` into its `RECORD`, atomically."""
    files = {}
    for root, _, names in os.walk(step_dir):
        if os.path.samefile(root, step_dir):
            continue  # Orbax's own step metadata, which it updates as it commits: only items are read
        for name in sorted(names):
            path = os.path.join(root, name)
            relative = os.path.relpath(path, step_dir)
            if relative != RECORD and not name.startswith(RECORD):
                files[relative] = [os.path.getsize(path), _crc32(path)]
    temporary = os.path.join(step_dir, f"{RECORD}.tmp{os.getpid()}")
    with open(temporary, "w") as f:
        json.dump({"format": FORMAT, "files": dict(sorted(files.items()))}, f, indent=0)
    os.replace(temporary, os.path.join(step_dir, RECORD))


def verified(step_dir: str) -> bool:
    """Whether `step_dir` holds a record of its files to check them against."""
    return os.path.isfile(os.path.join(step_dir, RECORD))


def damage(step_dir: str, under: str) -> list[str] | None:
    """What differs from the record in the files under `step_dir/under` (empty: nothing), or None
    where the step has no record to check against."""
    path = os.path.join(step_dir, RECORD)
    if not os.path.exists(path):
        return None
    saved = _read_record(path)
    if saved is None:
        return [f"{RECORD}: the record of the step's files is itself damaged, so they cannot be checked"]
    problems = []
    for relative, (size, crc) in saved.items():
        if not relative.startswith(under):
            continue
        full = os.path.join(step_dir, relative)
        if not os.path.exists(full):
            problems.append(f"{relative}: missing ({size} bytes were saved)")
        elif (actual := os.path.getsize(full)) != size:
            how = "cut short" if actual < size else "grown"
            problems.append(f"{relative}: {actual} bytes, {size} were saved ({how})")
        elif (now := _crc32(full)) != crc:
            problems.append(f"{relative}: its contents changed since it was saved (CRC-32 {now:08x}, saved {crc:08x})")
    return problems


def _read_record(path: str) -> dict[str, tuple[int, int]] | None:
    """The record's `file -> (size, CRC-32)`, or None where it is not one `record` wrote."""
    try:
        with open(path) as f:
            saved = json.load(f)
    except ValueError:  # not JSON, or not UTF-8
        return None
    files = saved.get("files") if isinstance(saved, dict) and saved.get("format") == FORMAT else None
    if not isinstance(files, dict):
        return None
    entries = {k: tuple(v) for k, v in files.items() if isinstance(v, list)}
    valid = all(len(v) == 2 and all(isinstance(x, int) for x in v) for v in entries.values())
    return entries if valid and len(entries) == len(files) else None


def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc
