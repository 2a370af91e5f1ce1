import os

from hypothesis import settings

pytest_plugins = ["devmesh.testing"]

# CI runs the same examples every time (a failure found locally is reproduced by its seed);
# local runs keep exploring new ones.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


# The suite's folders, each a marker (`pytest -m unit` runs the tests that start no process):
# unit/ pure code; ranks/<area>/ real ranks over gloo, checked against one process;
# parity/ against torch's own implementation; system/ the CLI, examples, launches and faults.
KINDS = ("unit", "ranks", "parity", "system")


def pytest_collection_modifyitems(items):
    import pytest

    for item in items:
        parts = item.path.relative_to(item.config.rootpath).parts
        if len(parts) > 2 and parts[0] == "tests" and parts[1] in KINDS:
            item.add_marker(getattr(pytest.mark, parts[1]))
