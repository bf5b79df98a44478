"""`keras-mirror-kit ckpt ls|verify|export DIR`: inspect, verify and export checkpoints.

`ls` and `verify` read the directory with `keras_mirror_kit.checkpoint.store` alone (NumPy,
no TensorFlow), so they answer at once; `export` builds the model with Keras. Every input
error (no such directory or checkpoint, one that fails verification, an architecture that
cannot be rebuilt, a file that cannot be read or written) exits 2 with a sentence.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
from typing import Any


def register(sub: Any) -> None:
    """Adds the `ckpt` sub-command (`ls`, `verify`, `export`) to the parser."""
    ckpt = sub.add_parser(
        "ckpt", help="list, verify or export the checkpoints of a SyncedCheckpoint directory"
    )
    actions = ckpt.add_subparsers(dest="ckpt_command", required=True)
    ls = actions.add_parser("ls", help="list checkpoints: epoch, step, size, checksum, score")
    ls.add_argument("directory")
    ls.add_argument("--json", action="store_true", help="print JSON instead of a table")
    verify = actions.add_parser("verify", help="check every checkpoint's size, checksum and CRCs")
    verify.add_argument("directory")
    verify.add_argument("name", nargs="?", help="only this checkpoint (file name or number)")
    export = actions.add_parser(
        "export", help="write a checkpoint as a Keras .keras model or .weights.h5 file"
    )
    export.add_argument("directory")
    export.add_argument(
        "--to", required=True, help="the file to write: NAME.keras or NAME.weights.h5"
    )
    export.add_argument(
        "--name", help="which checkpoint: a file name, a number, or 'best' (default: newest)"
    )
    export.add_argument(
        "--model",
        help="module:function (or file.py:function) returning the model, for checkpoints "
        "that do not record the architecture",
    )
    export.add_argument("--overwrite", action="store_true", help="replace an existing file")


def run(args: argparse.Namespace) -> int:
    """Runs `keras-mirror-kit ckpt ...`; returns the exit code (1: a failed check, 2: an error)."""
    from keras_mirror_kit.checkpoint.store import CheckpointError

    try:
        if args.ckpt_command == "ls":
            return _ls(args.directory, args.json)
        if args.ckpt_command == "verify":
            return _verify(args.directory, args.name)
        return _export(args)
    except (CheckpointError, ValueError, OSError) as err:
        sys.stderr.write(f"keras-mirror-kit ckpt: error: {_sentence(err)}\n")
        return 2


def _sentence(err: Exception) -> str:
    """The message of an error; for an `OSError` without one of ours, what failed on which file."""
    if isinstance(err, OSError) and not isinstance(err, FileExistsError) and err.strerror:
        where = f" ({err.filename})" if err.filename else ""
        return f"{err.strerror}{where}. Check the path and its permissions."
    return str(err)


def _store(directory: str) -> Any:
    from keras_mirror_kit.checkpoint.store import CheckpointError, CheckpointStore

    if not os.path.isdir(directory):
        raise CheckpointError(
            f"There is no checkpoint directory {directory!r}. Received: directory={directory!r}"
        )
    return CheckpointStore(directory)


def rows(directory: str) -> list[dict[str, Any]]:
    """The checkpoints of `directory`, oldest first, with what `ls` shows."""
    from keras_mirror_kit.checkpoint.best import best_entries

    store = _store(directory)
    entries = store.entries()
    latest = (store.read_manifest() or (None, []))[0]
    scores = [e.score for e in entries if e.score is not None and e.score.value is not None]
    best = best_entries(entries, scores[-1].monitor)[:1] if scores else []
    result = []
    for entry in entries:
        path = store.directory / entry.file
        size = entry.size
        if size is None:
            size = _regular_size(path)
        result.append(
            {
                "file": entry.file,
                "epoch": entry.epoch,
                "step": entry.step,
                "epoch_end": entry.epoch_end,
                "global_step": entry.global_step,
                "size": size,
                "checksum": _checksum(entry),
                "monitor": entry.score.monitor if entry.score is not None else None,
                "score": entry.score.value if entry.score is not None else None,
                "latest": entry.file == latest,
                "best": bool(best) and entry.file == best[0].file,
                "listed": entry.listed,
                "unreadable": entry.unreadable,
            }
        )
    return result


def _regular_size(path: Any) -> int | None:
    """The size of a regular file (a link is not followed, not even for its size), or None."""
    try:
        info = os.lstat(path)
    except OSError:
        return None
    return info.st_size if stat.S_ISREG(info.st_mode) else None


def _size(size: Any) -> str:
    if not isinstance(size, int):
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024  # type: ignore[assignment]
    return "?"


def _ls(directory: str, as_json: bool) -> int:
    listed = rows(directory)
    if as_json:
        sys.stdout.write(json.dumps(listed, indent=2) + "\n")
        return 0
    if not listed:
        sys.stdout.write(f"no checkpoints in {directory}\n")
        return 0
    header = f"{'file':<18} {'epoch':>5} {'step':>5} {'at':<9} {'global':>7} {'size':>10}  "
    lines = [header + f"{'checksum':<19}  score"]
    for row in listed:
        at = "unreadable" if row["unreadable"] else ("epoch end" if row["epoch_end"] else "mid")
        score = "" if row["score"] is None else f"{row['monitor']}={row['score']:.6g}"
        flags = [f for f in ("latest", "best") if row[f]]
        digest = row["checksum"] or "(not listed)"
        lines.append(
            f"{row['file']:<18} {_cell(row['epoch']):>5} {_cell(row['step']):>5} {at:<9} "
            f"{_cell(row['global_step']):>7} {_size(row['size']):>10}  {digest:<19}  "
            f"{score}{'  ' + ', '.join(flags) if flags else ''}".rstrip()
        )
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


def _checksum(entry: Any) -> str | None:
    """`crc32:<8 hex>` (or `sha256:<first 12 hex>`, 0.1.0) as listed in the manifest."""
    if entry.crc32 is not None:
        return f"crc32:{entry.crc32}"
    return f"sha256:{entry.sha256[:12]}" if entry.sha256 is not None else None


def _cell(value: Any) -> str:
    return "-" if value is None else str(value)


def _verify(directory: str, name: str | None) -> int:
    store = _store(directory)
    entries = store.entries()
    if name is not None:
        entries = [e for e in entries if name in (e.file, e.file.removesuffix(".npz"))]
        entries = entries or [
            e for e in store.entries() if name.isdigit() and int(name) == e.index
        ]
        if not entries:
            raise ValueError(
                f"There is no checkpoint {name!r} in {directory!r} (keras-mirror-kit ckpt ls "
                f"lists them). Received: name={name!r}"
            )
    failed = 0
    for entry in entries:
        try:
            store.read(entry)
        except ValueError as err:
            failed += 1
            sys.stdout.write(f"{entry.file}: CORRUPT ({err})\n")
        else:
            how = (
                "size, checksum and CRCs ok"
                if entry.crc32 is not None
                else "size and SHA-256 ok"
                if entry.sha256 is not None
                else "not in the manifest; zip CRCs ok"
            )
            sys.stdout.write(f"{entry.file}: ok ({how})\n")
    total = len(entries)
    sys.stdout.write(f"{total - failed} of {total} checkpoint(s) verified, {failed} corrupt\n")
    return 1 if failed else 0


def _export(args: argparse.Namespace) -> int:
    from keras_mirror_kit.checkpoint.restore import export_checkpoint

    path = export_checkpoint(
        args.directory, args.to, name=args.name, model=args.model, overwrite=args.overwrite
    )
    sys.stdout.write(f"wrote {path}\n")
    return 0
