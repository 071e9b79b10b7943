"""Suite-wide test settings.

Hypothesis runs under its built-in `ci` profile unless `HYPOTHESIS_PROFILE` names another: examples derived from
each test's name (the same on every run and every machine), no deadline (the machines differ several-fold in speed)
and no example database. The default suite's verdict then depends on the code, not on which random examples a run
drew. `make test-slow` runs the `default` profile, which draws new random examples on every run: exploration, with
the many-example property tests, belongs there.

Every command and server started here without `--model` serves the embedded canvas-6m (`DCANVAS_MODEL=embedded`,
inherited by subprocesses): on a machine whose cache holds the built Gemma conversion, or with the model extra
installed, the suite must neither switch to it (slow, other outputs) nor build it. A test of the model rule itself
(`tests/canvas/convert/test_resolve.py`) opts out with `monkeypatch.delenv`.
"""

import os

from hypothesis import settings

from canvas.env import MODEL

settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
os.environ[MODEL.name] = "embedded"
