"""The `keras-mirror-kit` command line: `info`, `doctor`, `ckpt`, `bench` and `launch`.

```
keras-mirror-kit info                      # versions, devices, what distributed() picks
keras-mirror-kit doctor                    # checks and a self-test; exit 1 on a failure
keras-mirror-kit ckpt ls ckpts             # checkpoints (also: ckpt verify, ckpt export)
keras-mirror-kit bench --replicas 1,2 --steps 50 --json bench.json --plot bench.png
keras-mirror-kit launch -n 2 -- train.py --epochs 3
```

Each sub-command lives in its own module of this package and is imported only when it runs.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    from keras_mirror_kit.cli import bench, ckpt, doctor, info

    parser = argparse.ArgumentParser(
        prog="keras-mirror-kit",
        description="Data-parallel Keras 3 training on every replica of a host.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    info.register(sub)
    doctor.register(sub)
    ckpt.register(sub)
    bench.register(sub)
    launch = sub.add_parser(
        "launch",
        help="run a script (launch -n 2 train.py) or a command (launch -n 2 -- python3 "
        "train.py) as N local multi-worker processes; launch --help for details",
        add_help=False,
    )
    launch.add_argument("rest", nargs=argparse.REMAINDER)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs the `keras-mirror-kit` command line on `argv` (default `sys.argv[1:]`); the exit code.

    Invalid arguments exit through argparse's `SystemExit`, as usual.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "launch":
        from keras_mirror_kit.multi_worker.launch import main as launch_main

        return launch_main(argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command != "ckpt" or args.ckpt_command == "export":  # commands that use TensorFlow
        from keras_mirror_kit.cli.tf_start import start_tensorflow

        start_tensorflow()
    if args.command == "info":
        from keras_mirror_kit.cli import info

        return info.run(args)
    if args.command == "doctor":
        from keras_mirror_kit.cli import doctor

        return doctor.run(args)
    if args.command == "ckpt":
        from keras_mirror_kit.cli import ckpt

        return ckpt.run(args)
    from keras_mirror_kit.cli import bench

    return bench.run(args, parser)
