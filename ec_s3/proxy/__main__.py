"""``python -m ec_s3.proxy``: the same as ``ec-s3 proxy`` (compose.yaml uses it); owns
nothing but the hand-over to :func:`ec_s3.proxy.main.main`."""

import sys

from ec_s3.proxy.main import main

sys.exit(main())
