"""A preload whose import takes 2 s: a template that stays ``cold`` that long after
fiberd starts (tests/cli/test_fiberctl_wait.py)."""

import time

time.sleep(2.0)
