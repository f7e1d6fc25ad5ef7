"""How the connector reads vLLM's config, and how vLLM finds the connector.

Proves: extra-config values given as strings (vLLM does not coerce them) are parsed; a missing
capacity or a bad pool name is refused naming the key; the pool geometry and compatibility key
come from the model; vLLM's factory loads the class by name and module path; importing
ec_client alone does not import vLLM; settings of earlier versions that mean nothing now are
ignored with a warning, not refused; the store namespace is vLLM's own store connector's, from
the same config; an engine that names images by their request (so nothing can ever hit) is
warned at start; a misspelt `ecd_` key stops the engine naming the setting meant, any other key
not read is warned about; the pool is read by consumers and encoder-only producers, not by a
producer that runs the whole model.
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import pytest
import torch
from ecd_testing import run_python
from vllm.config import CacheConfig, MultiModalConfig, VllmConfig
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
from vllm.distributed.ec_transfer.ec_connector.mooncake_store_embedding.data import (
    build_embedding_namespace,
)
from vllm.v1.executor.abstract import Executor
from vllm.v1.executor.multiproc_executor import MultiprocExecutor
from vllm_testing import CAPACITY, WIDTH, EngineSpec

from ec_client.vllm import ECDaemonConnector
from ec_client.vllm.config import ConnectorConfig
from ec_client.vllm.offline import OfflineVllmConfig

ADDRESS = "unix:///nonexistent/ecd.sock"


def config(**spec: Any) -> ConnectorConfig:
    return ConnectorConfig.from_vllm(EngineSpec(ADDRESS, **spec).vllm_config())


def test_numbers_given_as_strings_are_parsed() -> None:
    c = config(capacity="8GiB", extra={"ecd_wait_ms": "250", "ecd_connect_timeout_s": "1.5"})
    assert (c.capacity_bytes, c.wait_s, c.connect_timeout_s) == (8 << 30, 0.25, 1.5)
    assert config(capacity="1048576").capacity_bytes == 1 << 20


@pytest.mark.parametrize(
    ("spec", "key"),
    [
        ({"capacity": None}, "ec_cpu_bytes"),
        ({"capacity": "lots"}, "ec_cpu_bytes"),
        ({"capacity": 64}, "ec_cpu_bytes"),  # smaller than one block
        ({"pool": "../escape"}, "ecd_pool"),
        ({"extra": {"ecd_wait_ms": "soon"}}, "ecd_wait_ms"),
    ],
)
def test_a_bad_setting_is_refused_naming_its_key(spec: dict[str, object], key: str) -> None:
    with pytest.raises(ValueError, match=key):
        config(**spec)


def test_the_geometry_and_compat_key_come_from_the_model() -> None:
    c = config(model="org/vlm-7b")
    assert c.block_size_bytes == WIDTH * torch.float16.itemsize
    assert c.compat_key == f"org/vlm-7b|float16|{WIDTH}|vllm 0.33.0"
    assert c.address == ADDRESS and c.dtype == "float16"


def test_the_default_pool_is_named_like_vllms_region_and_is_private() -> None:
    spec = EngineSpec(ADDRESS)
    c = ConnectorConfig.from_vllm(spec.vllm_config())
    assert c.pool == f"{spec.instance_id}_dp0" and c.pool_is_private
    assert not config(pool="node-pool").pool_is_private


def config_on(backend: object, tp: int = 2) -> ConnectorConfig:
    vllm_config = EngineSpec(ADDRESS, tp=tp).vllm_config()
    vllm_config.parallel_config.distributed_executor_backend = backend  # type: ignore[assignment]
    return ConnectorConfig.from_vllm(vllm_config)


class GatheringExecutor(MultiprocExecutor):
    """An out-of-tree executor built on vLLM's multiprocess one: it folds every worker's output."""


@pytest.mark.parametrize("backend", ["mp", "ray", GatheringExecutor])
def test_loads_wait_for_every_tp_rank_when_the_executor_gathers_every_workers_output(
    backend: object,
) -> None:
    c = config_on(backend)
    assert (c.load_reports, c.worker_is_alone) == (2, False)


@pytest.mark.parametrize("backend", ["uni", "external_launcher"])
def test_a_scheduler_with_one_worker_of_its_own_waits_for_that_worker_alone(
    backend: str,
) -> None:
    c = config_on(backend)
    assert (c.load_reports, c.worker_is_alone) == (1, True)


def test_an_executor_that_hides_the_other_workers_copies_is_refused_with_tp() -> None:
    with pytest.raises(ValueError, match="cannot tell when all 2"):
        config_on(Executor)


def test_any_executor_will_do_with_one_worker() -> None:
    assert config_on(Executor, tp=1).load_reports == 1


def test_roles_map_to_producer_and_consumer() -> None:
    roles = {
        r: (config(role=r).is_producer, config(role=r).is_consumer)
        for r in ("ec_producer", "ec_consumer", "ec_both")
    }
    assert roles == {
        "ec_producer": (True, False),
        "ec_consumer": (False, True),
        "ec_both": (True, True),
    }


def test_the_pool_is_read_by_consumers_and_encoder_only_producers_alone() -> None:
    """A producer that runs the whole model encodes what it is sent: vLLM loads into the workers
    of a consumer alone."""
    reads = {
        (role, encoder_only): config(role=role, encoder_only=encoder_only).reads_pool
        for role in ("ec_producer", "ec_consumer", "ec_both")
        for encoder_only in (False, True)
    }
    assert reads == {
        ("ec_producer", False): False,
        ("ec_producer", True): True,
        ("ec_consumer", False): True,
        ("ec_consumer", True): True,
        ("ec_both", False): True,
        ("ec_both", True): True,
    }


def test_vllm_finds_the_connector_by_name_and_module_path() -> None:
    ec_config = EngineSpec(ADDRESS).vllm_config().ec_transfer_config
    assert ECConnectorFactory.get_connector_class(ec_config) is ECDaemonConnector


def test_importing_ec_client_does_not_import_vllm() -> None:
    done = run_python(
        "import sys, ec_client, ec_client.data.mover; assert 'vllm' not in sys.modules, 'imported'"
    )
    assert done.returncode == 0, done.stderr


def test_the_v1_model_runner_is_refused_with_the_setting_to_change() -> None:
    vllm_config = EngineSpec(ADDRESS).vllm_config()
    object.__setattr__(vllm_config, "use_v2_model_runner", False)
    with pytest.raises(ValueError, match="VLLM_USE_V2_MODEL_RUNNER=1"):
        ECDaemonConnector(vllm_config, ECConnectorRole.SCHEDULER)


def test_the_pin_settings_of_earlier_versions_are_ignored_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level("WARNING", logger="ec_client.vllm"):
        c = config(extra={"ecd_pins": "ahead", "ecd_pin_share": "0.5"})
    assert c.capacity_bytes > 0  # an upgraded engine with its old config still starts
    assert "ecd_pins='ahead' is ignored" in caplog.text and "ecd_pin_share" in caplog.text


def test_the_pending_wait_of_earlier_versions_is_ignored_with_a_warning_saying_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level("WARNING", logger="ec_client.vllm"):
        c = config(extra={"ecd_pending_wait_ms": 2000})
    assert c.capacity_bytes > 0
    assert "ecd_pending_wait_ms=2000 is ignored" in caplog.text
    assert "until that encode is committed or aborted" in caplog.text


def test_the_idle_wait_is_read_in_milliseconds() -> None:
    assert config(extra={"ecd_idle_wait_ms": "20"}).idle_wait_s == 0.02
    assert config().idle_wait_s == 0.05


@pytest.mark.parametrize(
    ("extra", "revision", "multimodal"),
    [
        ({}, None, None),
        ({}, "abc123", MultiModalConfig(mm_encoder_tp_mode="data")),
        ({"embedding_cache_prefix": "team-a", "embedding_model_identity": "llava"}, "v2", None),
    ],
)
def test_the_default_cluster_namespace_is_the_one_vllms_store_connector_derives(
    extra: dict[str, str], revision: str | None, multimodal: MultiModalConfig | None
) -> None:
    offline = cast(OfflineVllmConfig, EngineSpec(ADDRESS, extra=extra).vllm_config())
    model = dataclasses.replace(
        offline.model_config, revision=revision, multimodal_config=multimodal
    )
    vllm_config = cast(VllmConfig, dataclasses.replace(offline, model_config=model))

    c = ConnectorConfig.from_vllm(vllm_config)

    assert c.cluster_namespace == build_embedding_namespace(vllm_config)
    assert c.namespace_if_store


def test_a_cluster_namespace_given_is_used_as_it_is_whatever_the_daemon() -> None:
    c = config(extra={"ecd_cluster_namespace": "team-a@embedding"})
    assert (c.cluster_namespace, c.namespace_if_store) == ("team-a@embedding", False)


def test_a_cluster_namespace_that_is_not_a_string_is_refused_naming_the_key() -> None:
    with pytest.raises(ValueError, match="ecd_cluster_namespace"):
        config(extra={"ecd_cluster_namespace": False})


def naming(prefix_caching: bool, processor_cache_gb: float) -> VllmConfig:
    offline = cast(OfflineVllmConfig, EngineSpec(ADDRESS).vllm_config())
    model = dataclasses.replace(
        offline.model_config,
        multimodal_config=MultiModalConfig(mm_processor_cache_gb=processor_cache_gb),
    )
    cache = CacheConfig(enable_prefix_caching=prefix_caching)
    return cast(VllmConfig, dataclasses.replace(offline, model_config=model, cache_config=cache))


def test_an_engine_that_names_images_by_request_is_warned_that_nothing_can_hit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level("WARNING", logger="ec_client.vllm"):
        ConnectorConfig.from_vllm(naming(prefix_caching=False, processor_cache_gb=0))
    assert "names each image by its request" in caplog.text
    assert "--mm-processor-cache-gb" in caplog.text and "multi_modal_uuids" in caplog.text


@pytest.mark.parametrize(
    ("prefix_caching", "processor_cache_gb"), [(True, 0), (False, 4), (True, 4)]
)
def test_an_engine_that_names_images_by_content_is_not_warned(
    caplog: pytest.LogCaptureFixture, prefix_caching: bool, processor_cache_gb: float
) -> None:
    with caplog.at_level("WARNING", logger="ec_client.vllm"):
        ConnectorConfig.from_vllm(naming(prefix_caching, processor_cache_gb))
    assert "names each image by its request" not in caplog.text


def test_a_misspelt_setting_of_ours_is_refused_naming_the_one_meant() -> None:
    with pytest.raises(ValueError, match=r"'ecd_poool' \(did you mean 'ecd_pool'\?\)"):
        config(extra={"ecd_poool": "shared"})


def test_an_unknown_setting_of_ours_is_refused_listing_the_settings() -> None:
    with pytest.raises(ValueError, match=r"no setting 'ecd_colour'.*settings: ec_cpu_bytes"):
        config(extra={"ecd_colour": "blue"})


def test_a_key_that_is_not_ours_is_warned_about_once_and_the_engine_starts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level("WARNING", logger="ec_client.vllm"):
        c = config(extra={"shared_storage_path": "/tmp/ec", "ec_cpu_byte": "1GiB"})
    assert c.capacity_bytes == CAPACITY  # the engine starts, with what it was given
    [warning] = [r.getMessage() for r in caplog.records if "not read by" in r.getMessage()]
    assert "'shared_storage_path'" in warning
    assert "'ec_cpu_byte' (did you mean 'ec_cpu_bytes'?)" in warning
