"""`python -m keras_mirror_kit.cli`: the same as the `keras-mirror-kit` command."""

import sys

from keras_mirror_kit.cli import main

sys.exit(main())
