"""Prints its arguments after $ECHO_PREFIX (tests/test_scenarios.py runs it as a background process)."""

import os
import sys

print(os.environ["ECHO_PREFIX"], sys.argv[1:])
