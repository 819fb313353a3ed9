"""The package's tests run against the library $PAGEDKV_LIBRARY names (tools/test sets it to the
build's), else the one the package finds. Random inputs come from one seed, printed in pytest's header
and in each failure's report: PKV_TEST_SEED=<n> replays a run."""
import os
import random

import numpy as np
import pytest

SEED = int(os.environ.get("PKV_TEST_SEED") or random.SystemRandom().randrange(1, 2**32))


def pytest_report_header(config):
    import pagedkv

    return [f"PKV_TEST_SEED={SEED}", f"pagedkv {pagedkv.__version__}, library {pagedkv.library_version()} "
            f"({os.environ.get('PAGEDKV_LIBRARY') or 'found by the package'})"]


@pytest.fixture
def rng(request):
    """A generator seeded from the run's seed and the test's name, so each test replays on its own."""
    request.node.user_properties.append(("PKV_TEST_SEED", SEED))
    return np.random.default_rng([SEED, sum(map(ord, request.node.name))])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        report.sections.append(("seed", f"PKV_TEST_SEED={SEED}"))
