"""`python -m keras_mirror_kit.multi_worker.launch`: the launcher as a program."""

from __future__ import annotations

import sys

from keras_mirror_kit.multi_worker.launch.supervisor import main

if __name__ == "__main__":
    sys.exit(main())
