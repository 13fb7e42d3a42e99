"""``python -m ec_s3.proxy``: the same as ``ec-s3 proxy`` (compose.yaml uses it)."""

import sys

from ec_s3.proxy.server import main

sys.exit(main())
