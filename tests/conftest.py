"""Suite-wide test settings.

Hypothesis runs under its built-in `ci` profile unless `HYPOTHESIS_PROFILE` names another: examples derived from
each test's name (the same on every run and every machine), no deadline (the machines differ several-fold in speed)
and no example database. The default suite's verdict then depends on the code, not on which random examples a run
drew. `make test-slow` runs the `default` profile, which draws new random examples on every run: exploration, with
the many-example property tests, belongs there.
"""

import os

from hypothesis import settings

settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
