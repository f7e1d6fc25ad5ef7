"""Encoder engines (ec_producer with --mm-encoder-only) read the pool, as the engines that load
from it do: an image the pool holds READY is not encoded again, by another encoder engine on the
node or by one started again after a restart, and one another encoder engine is encoding (PENDING
in the pool) is waited for until it is committed (then not encoded) or aborted (then encoded):
single flight across encoder engines. An encoder engine needs the embeddings nowhere but in the
pool, so a request whose image the pool holds is done with no encode and no copy to its workers.
A producer that runs the whole model does not read the pool: vLLM loads nothing into its
workers, so it encodes; its session is a producer's, an encoder engine's `both`.
(docs/vllm.md, roles; docs/design.md §12.)
"""

from __future__ import annotations

from ecd_testing import Daemon, wait_until
from vllm_testing import EngineFactory, EngineSpec, held_while, request

from ec_client.vllm.config import ConnectorConfig
from ec_client.vllm.scheduler import connect_client
from ec_protocol.types import Role

SHARED = "encoders-pool"


def test_an_encoder_engine_given_an_image_its_pool_holds_neither_encodes_nor_copies_it(
    engine: EngineFactory,
) -> None:
    first = engine(role="ec_producer", encoder_only=True, pool=SHARED)
    second = engine(role="ec_producer", encoder_only=True, pool=SHARED)
    first.save("p1", "img-a")
    wait_until(lambda: second.scheduler.view.slot(b"img-a") is not None)
    result = second.step(request("p2", "img-a"))
    assert not result.step.held and not result.step.encode
    assert result.step.load == {"img-a"}  # vLLM schedules no encoder for it
    assert not result.step.metadata.loads and not result.step.metadata.saves
    assert result.loaded == {}  # its workers copied nothing out of the pool
    second.flush()
    assert second.locked() == (0, 0)  # and it holds no pin on it


def test_a_restarted_encoder_engine_encodes_none_of_the_images_its_pool_holds(
    engine: EngineFactory,
) -> None:
    images = ["img-a", "img-b", "img-c"]
    before = engine(role="ec_producer", encoder_only=True, pool=SHARED)
    for image in images:
        before.save(f"p-{image}", image)
    before.close()
    after = engine(role="ec_producer", encoder_only=True, pool=SHARED)
    wait_until(lambda: all(after.scheduler.view.slot(i.encode()) is not None for i in images))
    result = after.step(*(request(f"q-{image}", image) for image in images))
    assert not result.step.encode and result.step.load == set(images)


def test_two_encoder_engines_given_one_new_image_encode_it_once(engine: EngineFactory) -> None:
    first = engine(role="ec_producer", encoder_only=True, pool=SHARED)
    second = engine(role="ec_producer", encoder_only=True, pool=SHARED)
    encoding = first.schedule([request("a1", "img")])
    assert encoding.encode == {"img": 16}
    first.answered()  # allocated: PENDING in the pool
    wait_until(lambda: second.scheduler.view.pending(b"img"))
    held_while(second, "b1", 0.5)  # not encoded: its save is on its way
    first.finish(first.run(encoding))
    first.flush()
    wait_until(lambda: second.scheduler.view.has(b"img"))
    _, result = second.admit(request("b1", "img"))
    assert not result.step.encode and result.step.load == {"img"}


def test_an_encoder_engine_encodes_an_image_whose_other_encoder_engine_stopped_writing_it(
    engine: EngineFactory,
) -> None:
    first = engine(role="ec_producer", encoder_only=True, pool=SHARED)
    second = engine(role="ec_producer", encoder_only=True, pool=SHARED)
    first.schedule([request("a1", "img")])
    first.answered()  # allocated: PENDING in the pool
    wait_until(lambda: second.scheduler.view.pending(b"img"))
    held_while(second, "b1", 0.2)
    first.close()  # its session ends: the daemon aborts what it was writing
    wait_until(lambda: not second.scheduler.view.pending(b"img"))
    _, result = second.admit(request("b1", "img"))
    assert result.step.encode == {"img": 16} and not result.step.load


def test_a_producer_that_runs_the_whole_model_encodes_an_image_its_pool_holds(
    engine: EngineFactory,
) -> None:
    """Its forward pass needs the output in its workers, and vLLM loads none there on a producer
    (no start_load_caches): so the image is encoded, as on an engine with no pool."""
    encoder = engine(role="ec_producer", encoder_only=True, pool=SHARED)
    whole = engine(role="ec_producer", pool=SHARED)
    encoder.save("p1", "img-a")
    wait_until(lambda: whole.scheduler.view.slot(b"img-a") is not None)
    result = whole.step(request("p2", "img-a"))
    assert result.step.encode == {"img-a": 16} and not result.step.load
    assert not result.step.metadata.loads and result.loaded == {}


def test_an_encoder_engine_opens_its_session_as_both_one_running_the_whole_model_as_a_producer(
    daemon: Daemon,
) -> None:
    """Reading the pool pins what it holds (Acquire, in a pool shared through the store), which
    a producer's session may not; a producer that reads nothing keeps a producer's session."""
    roles = []
    for encoder_only in (True, False):
        spec = EngineSpec(daemon.address, role="ec_producer", encoder_only=encoder_only)
        with connect_client(ConnectorConfig.from_vllm(spec.vllm_config())) as client:
            roles.append(client.options.role)
    assert roles == [Role.BOTH, Role.PRODUCER]
