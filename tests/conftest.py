"""Test-session settings shared by every test module."""

import os
import tempfile

# The engine keeps compiled code in the user's cache folder; the tests (and the
# command-line runs they start) use a folder of their own instead.
os.environ.setdefault(
    "PIPEDEJAVU_CACHE_DIR", tempfile.mkdtemp(prefix="pipedejavu-test-cache-")
)
