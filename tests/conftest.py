import os

from hypothesis import settings

pytest_plugins = ["devmesh.testing"]

# CI runs the same examples every time (a failure found locally is reproduced by its seed);
# local runs keep exploring new ones.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")
