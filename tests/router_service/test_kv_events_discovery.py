"""What a worker's ``/server_info`` ``kv_events`` descriptor names (SGLang's shape)."""

from __future__ import annotations

from typing import Any

import pytest

from router_service.kv_events import EventSource, source_from_server_info


def described(**fields: Any) -> dict[str, Any]:
    base = {
        "publisher": "zmq",
        "endpoint_host": "*",
        "endpoint_port_base": 5557,
        "topic": "",
        "block_size": 16,
        "dp_size": 1,
    }
    return {"version": "0.5.23", "kv_events": {**base, **fields}}


@pytest.mark.parametrize("wildcard", ["*", "0.0.0.0", "::", "[::]", ""])
def test_a_wildcard_means_the_workers_own_host(wildcard: str) -> None:
    info = described(endpoint_host=wildcard, replay_endpoint_port_base=5558)
    assert source_from_server_info("http://10.1.2.3:30000", info) == EventSource(
        "tcp://10.1.2.3:5557", "tcp://10.1.2.3:5558"
    )


def test_an_ipv6_worker_keeps_its_brackets() -> None:
    source = source_from_server_info("http://[fd00::7]:30000", described())
    assert source == EventSource("tcp://[fd00::7]:5557", None)


def test_a_named_host_is_used_as_given() -> None:
    assert source_from_server_info(
        "http://worker-0:30000", described(endpoint_host="10.0.0.9")
    ) == EventSource("tcp://10.0.0.9:5557", None)
    assert source_from_server_info(
        "http://worker-0:30000", described(endpoint_host="fd00::9")
    ) == EventSource("tcp://[fd00::9]:5557", None)


@pytest.mark.parametrize(
    ("info", "says"),
    [
        ({"version": "0.5.23"}, "no KV-event publisher"),
        ({"kv_events": None}, "no KV-event publisher"),
        ([], "not a JSON object"),
        ({"kv_events": "tcp://x:1"}, "not an object"),
        (described(publisher="null"), "not 'zmq'"),
        (described(dp_size=2), "2 data-parallel ranks"),
        (described(endpoint_port_base=0), "endpoint_port_base is not a TCP port"),
        (described(endpoint_port_base="5557"), "endpoint_port_base is not a TCP port"),
        (described(endpoint_port_base=True), "endpoint_port_base is not a TCP port"),
        (described(replay_endpoint_port_base=70000), "replay_endpoint_port_base"),
    ],
)
def test_what_names_no_publisher_says_why(info: Any, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        source_from_server_info("http://10.1.2.3:30000", info)
