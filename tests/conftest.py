import os

from hypothesis import settings

pytest_plugins = ["devmesh.testing"]

# The test pool's workers are forked after importing what the suite's tasks use, torch's
# compiler (the compiled-model tests) and scikit-learn's datasets (the digits) included:
# each of the 16 workers, and each that replaces one a fault test broke, would otherwise
# import them again (~2.5 s of CPU apiece)
# (set once pytest has loaded devmesh.testing as a plugin: importing it here first would keep
# pytest from rewriting its asserts)
def pytest_configure(config):
    from devmesh.testing import DEFAULT_PRELOAD

    os.environ.setdefault("DEVMESH_TEST_PRELOAD", ",".join((
        *DEFAULT_PRELOAD, "torch._functorch.aot_autograd", "torch._inductor.compile_fx",
        "torch.testing._internal.distributed._tensor.common_dtensor", "sklearn.datasets")))

# CI runs the same examples every time (a failure found locally is reproduced by its seed);
# local runs keep exploring new ones.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


# The suite's folders, each a marker (`pytest -m unit` runs the tests that start no process):
# unit/ pure code; ranks/<area>/ real ranks over gloo, checked against one process;
# parity/ against torch's own implementation; system/ the CLI, examples, launches and faults.
KINDS = ("unit", "ranks", "parity", "system")


# `pytest -n 3` runs the suite on three pytest workers (xdist, whole files each: a module's
# fixtures are computed once). They take files in collection order, so the longest files —
# launches of fresh processes, timeouts waited out — come first and the short ones fill in
# at the end, rather than one worker finishing a long file alone; then system, ranks,
# parity, unit.
LONGEST_FIRST = ("system/test_multihost.py", "system/test_slurm.py",
                 "system/test_examples_and_cli.py",
                 "system/test_faults.py", "system/test_docs.py",
                 "system/test_checkpoint_safety.py", "ranks/pipeline/test_pipeline.py",
                 "system/test_elastic.py", "ranks/pipeline/test_pipeline_indivisible.py")
THEN = ("system", "ranks", "parity", "unit")
# last of all, beside the unit tests' tail: its ranks import torchtitan (and triton), seconds
# of CPU apiece that would slow the timed tests of a launch running beside them
LAST = ("ranks/models/test_torchtitan_llama.py", "ranks/models/test_torchtitan_moe.py")


def _file_order(item) -> tuple[int, int]:
    relative = item.path.relative_to(item.config.rootpath / "tests").as_posix()
    if relative in LONGEST_FIRST:
        return 0, LONGEST_FIRST.index(relative)
    if relative in LAST:
        return 2, LAST.index(relative)
    kind = relative.split("/")[0]
    return 1, THEN.index(kind) if kind in THEN else len(THEN)


def pytest_collection_modifyitems(items):
    import pytest

    for item in items:
        parts = item.path.relative_to(item.config.rootpath).parts
        if len(parts) > 2 and parts[0] == "tests" and parts[1] in KINDS:
            item.add_marker(getattr(pytest.mark, parts[1]))
    if os.environ.get("PYTEST_XDIST_WORKER"):  # under -n N only; one process keeps its order
        items.sort(key=_file_order)  # stable: each file's tests keep their order
