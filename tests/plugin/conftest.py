"""Fixtures of the plugin's own tests.

The tests drive inner pytest runs with ``pytester``. It is registered here from
``pytest_configure`` rather than with ``pytest_plugins = ["pytester"]``: pytest refuses
``pytest_plugins`` in a conftest below the rootdir whenever that conftest is not an initial one
(a plain ``python -m pytest`` of the whole suite collects this directory late and would stop
with "Defining 'pytest_plugins' in a non-top-level conftest is no longer supported").
"""

from __future__ import annotations

import importlib
import textwrap
from pathlib import Path

import pytest

# Inner runs are in process, and pytester restores sys.modules after each one: a module first
# imported by an inner run would be dropped and imported again by the next (torch does not
# survive that: a segfault). Import everything the inner tests use here, once.
PRELOAD = (
    "torch",
    "numpy.random",
    "asynccache.cache",
    "asynccache.l3",
    "asynccache.replay.kvgen",
    "asynccache.testing.cancel",
    "asynccache.testing.configs",
    "asynccache.testing.faultwrap",
    "asynccache.testing.kv",
    "asynccache.testing.s3",
    "asynccache.storage.file",
    "asynccache.storage.s3",
    "asynccache.storage.seaweed",
    "asynccache.transfers.engine",
)
for _name in PRELOAD:
    importlib.import_module(_name)


def pytest_configure(config: pytest.Config) -> None:
    if not config.pluginmanager.has_plugin("pytester"):
        config.pluginmanager.import_plugin("pytester")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.pluginmanager.has_plugin("asynccache"):
        return
    skip = pytest.mark.skip(reason="the asynccache plugin is disabled (-p no:asynccache)")
    here = str(Path(__file__).parent)
    for item in items:
        if str(item.path).startswith(here):
            item.add_marker(skip)


INNER_INI = """
[pytest]
asyncio_default_fixture_loop_scope = function
{extra}
"""


@pytest.fixture
def inner(pytester: pytest.Pytester) -> pytest.Pytester:
    """A pytester directory with a pytest.ini (strict asyncio mode unless a test writes its own)."""
    pytester.makeini(textwrap.dedent(INNER_INI.format(extra="")))
    return pytester
