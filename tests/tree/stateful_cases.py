"""Hypothesis settings and test-case construction shared by the tree's state machines.

A soak run: ``ASYNCCACHE_STATEFUL_EXAMPLES=2000 ASYNCCACHE_STATEFUL_RANDOM=1 pytest ...``
(``ASYNCCACHE_STATEFUL_STEPS`` sets the steps per example).
"""

from __future__ import annotations

import os
from typing import Any

from hypothesis import HealthCheck, settings


def stateful_settings(default_examples: int) -> settings:
    return settings(
        max_examples=int(os.environ.get("ASYNCCACHE_STATEFUL_EXAMPLES", str(default_examples))),
        stateful_step_count=int(os.environ.get("ASYNCCACHE_STATEFUL_STEPS", "40")),
        deadline=None,
        database=None,
        derandomize=not os.environ.get("ASYNCCACHE_STATEFUL_RANDOM"),
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )


def machine_case(base: type, name: str, how: settings, **attrs: Any) -> Any:
    """The TestCase of a subclass of the state machine ``base`` with class ``attrs`` set."""
    case = type(name, (base,), attrs).TestCase
    case.settings = how
    return case
