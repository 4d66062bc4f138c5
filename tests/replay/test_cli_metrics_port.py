"""``asynccache replay --metrics-port`` on a port already in use is a clear error naming the port,
before replaying (tests first)."""

from __future__ import annotations

import socket

from tests.replay.cli_run import cli_rc


def test_a_busy_metrics_port_is_refused_before_replaying(capsys) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        rc = cli_rc(["replay", "--limit", "3", "--progress", "off", "--metrics-port", str(port)])
    out, err = capsys.readouterr()
    assert rc == 2
    assert out == ""
    assert (f"asynccache: error: --metrics-port {port}: 127.0.0.1:{port} is already in use; "
            "choose another port, or 0 for a free one") in err
    assert "Traceback" not in err


def test_a_free_metrics_port_still_serves(capsys) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert cli_rc(["replay", "--limit", "3", "--progress", "off", "--json",
                "--metrics-port", str(port)]) == 0
    assert '"completed": 3' in capsys.readouterr().out
