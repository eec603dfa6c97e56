"""``python -m shardamp``: the same as ``python -m shardamp.report``."""
import sys

from shardamp.report import main

sys.exit(main())
