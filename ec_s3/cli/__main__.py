"""``python -m ec_s3.cli``: the same as the ``ec-s3`` console script."""

import sys

from ec_s3.cli.main import main

sys.exit(main())
