"""`python -m prkit.envoy_config`: envoy/gen."""

import sys

from .cli import main

sys.exit(main())
