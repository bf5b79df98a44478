"""The cost of reading a checkpoint back (a resume's read): this checkout against a baseline.

A resume reads the newest checkpoint: the manifest, the file's zip directory and metadata,
every member's CRC, then each array once (`CheckpointStore.load_latest`, then every array
of `arrays`, which is what `SyncedCheckpoint` and `kmk.restore` do before assigning). Issue
33 added bounds and checks to that read (regular files only, the zip directory and every
member's header checked against its size before anything is read); this script shows what
they cost.

It writes one checkpoint of a 576 MiB state (the state of `checkpoint_memory.py`'s model:
weights and Adam's two moments of a 3 x Dense(4096) MLP, as float32 arrays) with this
checkout's store, then reads it in fresh processes, alternating this checkout's
`keras_mirror_kit` and the baseline's (`git archive` of `--baseline`, default `91cd166`,
the last commit before issue 33's changes), `--rounds` times each. Figures per side: CPU
time of the read (user + system, the median over rounds; the wall clock is printed too but
depends on the page cache and the host's load), and the process's peak RSS above its RSS
before the read (median). Neither process imports TensorFlow.

Usage:

    python benchmarks/checkpoint_read.py                 # 5 rounds, baseline 91cd166
    python benchmarks/checkpoint_read.py --rounds 9 --baseline HEAD~1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, os, resource, sys, time
from keras_mirror_kit.checkpoint.store import CheckpointStore
store = CheckpointStore(sys.argv[1])
before = resource.getrusage(resource.RUSAGE_SELF)
rss_before = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
start = time.perf_counter()
loaded = store.load_latest()
total = 0
with loaded.arrays as arrays:
    for key in arrays:
        total += arrays[key].nbytes
wall = time.perf_counter() - start
after = resource.getrusage(resource.RUSAGE_SELF)
cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
peak = after.ru_maxrss * 1024 - rss_before
print("RESULT " + json.dumps({"cpu_s": cpu, "wall_s": wall, "peak_mib": peak / 2**20,
                              "bytes": total, "module": os.path.dirname(
                                  sys.modules["keras_mirror_kit"].__file__)}))
"""


def _write_checkpoint(directory: Path) -> int:
    """One checkpoint of 3 x Dense(4096) + Adam moments (576 MiB), by this checkout."""
    import numpy as np

    from keras_mirror_kit.checkpoint.meta import CheckpointMeta
    from keras_mirror_kit.checkpoint.store import CheckpointStore

    shapes = [(4096, 4096), (4096,)] * 3
    rng = np.random.default_rng(0)
    # As the kit names them: variable i of `meta.variables` is "<group>/<i:05d>".
    names = [f"model:dense_{i // 2}/{'kernel' if i % 2 == 0 else 'bias'}" for i in range(6)]
    names += [f"optimizer:{m}_{v}" for m in ("m", "v") for v in range(6)]

    def arrays():
        for index, name in enumerate(names):
            group = name.split(":")[0]
            yield f"{group}/{index:05d}", rng.standard_normal(shapes[index % 6], np.float32)

    store = CheckpointStore(directory)
    store.prepare()
    meta = CheckpointMeta(epoch=1, step=0, epoch_end=True, variables=tuple(names))
    store.write(arrays(), meta)
    return sum(int(np.prod(s)) * 4 for s in shapes) * 3


def _baseline(rev: str, into: Path) -> Path:
    """The baseline's `keras_mirror_kit` package, extracted from git into `into`."""
    archive = subprocess.run(
        ["git", "archive", rev, "keras_mirror_kit"], cwd=REPO, check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=__import__("io").BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


def _read(pythonpath: Path, directory: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(directory)], env=env, capture_output=True,
        text=True, timeout=600, cwd=pythonpath,
    )  # fmt: skip
    if proc.returncode:
        raise SystemExit(f"the read failed:\n{proc.stderr[-3000:]}")
    line = next(x for x in reversed(proc.stdout.splitlines()) if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--baseline", default="91cd166", help="git revision to compare with")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kmk-read-") as tmp:
        root = Path(tmp)
        size = _write_checkpoint(root / "ckpts")
        sides = {"this checkout": REPO, f"baseline {args.baseline}": _baseline(
            args.baseline, root / "baseline")}  # fmt: skip
        results: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
        for i in range(args.rounds):
            order = list(sides) if i % 2 == 0 else list(sides)[::-1]
            for name in order:
                result = _read(sides[name], root / "ckpts")
                assert Path(result["module"]).parent == sides[name], result
                assert result["bytes"] == size
                results[name].append(result)
    print(f"checkpoint of {size / 2**20:.0f} MiB, {args.rounds} rounds, alternating")
    print(f"{'':>24} {'CPU s (median)':>15} {'wall s (median)':>16} {'peak MiB (median)':>18}")
    for name, runs in results.items():
        cpu = statistics.median(r["cpu_s"] for r in runs)
        wall = statistics.median(r["wall_s"] for r in runs)
        peak = statistics.median(r["peak_mib"] for r in runs)
        print(f"{name:>24} {cpu:>15.3f} {wall:>16.3f} {peak:>18.1f}")
    this, base = results.values()
    ratio = statistics.median(r["cpu_s"] for r in this) / statistics.median(
        r["cpu_s"] for r in base
    )
    print(f"CPU time, this checkout / baseline: {ratio:.3f}")


if __name__ == "__main__":
    main()
