"""The benchmarks' transport floor (benchmarks.echo) answers what it is asked, in-process (no Ray):
a wrong answer size would make the floor rows of bag_throughput and small_call_latency meaningless."""

from __future__ import annotations

from benchmarks.echo import EchoServer, echo_request, fan_out, raw_method
from client.channels import sync_channel


def test_echo_answers_the_asked_sizes() -> None:
    server = EchoServer()
    channel = sync_channel(server.address())
    try:
        echo = raw_method(channel)
        assert echo(b"", timeout=10) == b""  # the empty call
        assert echo(echo_request(0, 0), timeout=10) == b""
        answers = fan_out([(echo, echo_request(1000, 5)), (echo, echo_request(8, 3 << 20)), (echo, echo_request(100, 5))])
        assert [len(a) for a in answers] == [5, 3 << 20, 5]
        assert len(echo_request(1000, 5)) == 1000 and len(echo_request(3, 5)) == 8  # at least the header
    finally:
        channel.close()
        server.close()
