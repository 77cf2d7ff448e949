"""Shared, session-scoped fixtures over ONE tiny config (tests/support/tiny.py).

The tests share the compiled engines (cached as .mef files under ``$SRM_MAX_CACHE``,
default ~/.cache/srm-max: later runs load in milliseconds); helpers that are not
fixtures live in tests/support/.
"""

from __future__ import annotations

import numpy as np
import pytest

from srm_max.models.srm.config import SRMConfig
from tests.support import op_graphs, virtual_gpu
from tests.support.cpu_guard import guard_graph_jobs
from tests.support.graphs import (
    KERNEL_GRAPHS_ONLY, compile_report, declared_graph_jobs, needs_only_float32_kernel_graphs, undeclared,
)
from tests.support.tiny import TINY, make_reference, weights_of


def pytest_addoption(parser):
    parser.addoption(KERNEL_GRAPHS_ONLY, action="store_true",
                     help="deselect the tests that declare a bfloat16 or a plain-op graph (the "
                          "x86-64-v3 guard's selection: tests/runtime/test_cpu_target.py)")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` run only with an accelerator; ``ray`` ones only with Ray.
    With --float32-kernel-graphs-only, only the tests whose graphs are all float32 graphs
    with the Mojo ops stay selected, so the session compiles only those."""
    import importlib.util

    if config.getoption(KERNEL_GRAPHS_ONLY):
        kept, dropped = [], []
        for item in items:
            (kept if needs_only_float32_kernel_graphs(item) else dropped).append(item)
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = kept

    from max.driver import accelerator_count

    skips = {"gpu": None if accelerator_count() > 0 else "needs a GPU (none found)",
             "ray": None if importlib.util.find_spec("ray") else "needs Ray: pip install 'srm-max[ray]'"}
    for item in items:
        for name, reason in skips.items():
            if reason and item.get_closest_marker(name):
                item.add_marker(pytest.mark.skip(reason=reason))


# the lines of compile_report for the session's summary
COMPILED = pytest.StashKey[list]()


@pytest.fixture(scope="session", autouse=True)
def suite_graphs(request):
    """Compile every graph the run needs up front, side by side (one process per core):
    a cold compile takes minutes on one core, and CI has two."""
    from srm_max.runtime.precompile import precompile
    from srm_max.shipped_graphs import install

    # with the graphs the x86-64-v3 guard's children will load when it runs (compiled for its
    # target here, beside the rest, rather than in each child one group at a time)
    jobs = declared_graph_jobs(request.session.items) + guard_graph_jobs(request.session.items)
    install(jobs)  # the embedded model's graphs ship with the package (checked, not compiled)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PYTHONPATH", op_graphs.pythonpath_with_repo_root())  # the workers build the op graphs
        seconds = precompile(jobs)
    request.config.stash[COMPILED] = compile_report(seconds, request.session.items) if seconds else []
    # the virtual GPU's compile check, a core's work for half a minute, runs beside the tests
    # (which leave a core idle) rather than in its own test's time
    if any(item.nodeid == virtual_gpu.TEST for item in request.session.items) and virtual_gpu.skip_reason() is None:
        virtual_gpu.start()
    return seconds


def pytest_terminal_summary(terminalreporter, config):
    """What the up-front compiles cost, graph by graph (a cold run's time is mostly these)."""
    lines = config.stash.get(COMPILED, [])
    if lines:
        terminalreporter.section("graphs compiled up front")
        for line in lines:
            terminalreporter.write_line(line)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    op_graphs.forget_uses()  # before the test's fixtures, which may load op graphs


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """Fail a test that used an op graph it does not declare: run alone, it would compile
    that graph inside the test, one at a time, instead of up front."""
    result = yield
    missing = undeclared(item, op_graphs.used())
    if missing:
        named = " and ".join(f"op_graphs({use.marker_args()})" for use in sorted(missing, key=str))
        pytest.fail(f"{item.nodeid} uses op graphs it does not declare: add {named} "
                    "(tests/support/graphs.py) to its marks")
    return result


@pytest.fixture(scope="session")
def tiny_config() -> SRMConfig:
    return TINY


@pytest.fixture(scope="session")
def reference():
    return make_reference()


@pytest.fixture(scope="session")
def tiny_weights(reference) -> dict[str, np.ndarray]:
    return weights_of(reference)


@pytest.fixture(scope="session")
def engine(tiny_weights):
    from srm_max.models.srm.engine import Engine

    return Engine(TINY, tiny_weights, dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def engine_bf16(tiny_weights):
    from srm_max.models.srm.engine import Engine

    return Engine(TINY, tiny_weights, dtype="bfloat16", device="cpu")


@pytest.fixture(scope="session")
def generator(engine):
    from srm_max.serve.generator import Generator

    return Generator.from_engine(engine)
