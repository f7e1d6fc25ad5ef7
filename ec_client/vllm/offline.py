"""vLLM's side of a step, for driving a connector outside a running engine (benchmark, tests).

A real VllmConfig cannot be built without a GPU platform, so the config is a stand-in holding a
real ParallelConfig and a real ECTransferConfig, with a stand-in ModelConfig answering what
connectors ask (model name, dtype, input-embedding width; revision and multimodal config for the
store's namespace): the parts of VllmConfig that EC connectors read, and nothing else, so a
connector that reads more fails here loudly. Requests
are real vLLM Requests with real MultiModalFeatureSpec / PlaceholderRange features.
`schedule_step` and `finish_step` make the calls vLLM's scheduler makes into a connector, in its
order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from vllm.config import CacheConfig, MultiModalConfig, VllmConfig
from vllm.config.ec_transfer import ECRole, ECTransferConfig
from vllm.config.parallel import ParallelConfig
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase, ECConnectorMetadata
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import ECConnectorOutput
from vllm.v1.request import Request


def offline_config(
    extra: Mapping[str, Any],
    *,
    instance_id: str,
    role: ECRole = "ec_both",
    connector: str = "ECDaemonConnector",
    model: str = "offline/tiny-vlm",
    width: int = 64,
    dtype: torch.dtype = torch.float16,
    tp: int = 1,
    rank: int = 0,
    encoder_only: bool = False,
) -> VllmConfig:
    """An engine's config with `extra` as ec_connector_extra_config. The encoder output width of
    images is `width` (vLLM's EngineCore measures it at start on producers). `encoder_only`: an
    engine started with `--mm-encoder-only` (it runs the encoder alone), else one that runs the
    whole model."""
    ec = ECTransferConfig(
        ec_connector=connector,
        ec_connector_module_path="ec_client.vllm" if connector == "ECDaemonConnector" else None,
        ec_role=role,
        ec_connector_extra_config=dict(extra),
    )
    ec.mm_encoder_output_widths = {"image": width}
    config = OfflineVllmConfig(
        ec_transfer_config=ec,
        model_config=OfflineModelConfig(
            model,
            dtype,
            width,
            multimodal_config=MultiModalConfig(mm_encoder_only=True) if encoder_only else None,
        ),
        parallel_config=ParallelConfig(
            tensor_parallel_size=tp, distributed_executor_backend="mp", rank=rank
        ),
        instance_id=instance_id,
    )
    return cast(VllmConfig, config)


@dataclass(frozen=True)
class OfflineModelConfig:
    """What EC connectors ask of vLLM's ModelConfig."""

    model: str
    dtype: torch.dtype
    width: int
    multimodal_config: MultiModalConfig | None = None
    revision: str | None = None

    def get_inputs_embeds_size(self) -> int:
        return self.width


@dataclass(frozen=True)
class OfflineVllmConfig:
    """What EC connectors read of vLLM's VllmConfig."""

    ec_transfer_config: ECTransferConfig
    model_config: OfflineModelConfig
    parallel_config: ParallelConfig
    instance_id: str
    use_v2_model_runner: bool = True
    lora_config: None = None
    cache_config: CacheConfig = field(default_factory=CacheConfig)


def image_request(request_id: str, keys: Sequence[str], rows: int) -> Request:
    """A prompt with one image per key (its mm_hash), `rows` placeholder tokens each."""
    features = [
        MultiModalFeatureSpec(
            data=None,
            modality="image",
            identifier=key,
            mm_position=PlaceholderRange(offset=1 + i * (rows + 1), length=rows),
            mm_hash=key,
        )
        for i, key in enumerate(keys)
    ]
    return Request(
        request_id=request_id,
        prompt_token_ids=[0] * (len(keys) * (rows + 1) + 1),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        mm_features=features,
    )


@dataclass
class ScheduledStep:
    """What the scheduler decided in one step, and the connector metadata it built."""

    metadata: ECConnectorMetadata
    held: set[str]  # request IDs ensure_cache_available held back
    encode: dict[str, int]  # key -> rows, for the encoder
    load: set[str]  # keys has_cache_item said to load


def schedule_step(connector: ECConnectorBase, requests: Sequence[Request]) -> ScheduledStep:
    """vLLM's Scheduler.schedule() reduced to its calls into an EC connector, in its order: per
    request ensure_cache_available, has_cache_item per input not computed yet, then
    update_state_after_alloc for the inputs to encode and then those to load; once at the end
    build_connector_meta, told how many tokens the step schedules (a request's whole prompt,
    which counts as computed from then on: none for a step that only holds requests back)."""
    held: set[str] = set()
    tokens = 0
    encode: dict[str, int] = {}
    load: set[str] = set()
    for request in requests:
        if not connector.ensure_cache_available(request, request.num_computed_tokens):
            held.add(request.request_id)
            continue
        to_encode: list[int] = []
        to_load: list[int] = []
        for index, feature in enumerate(request.mm_features):
            key = feature.identifier
            if feature.mm_position.offset < request.num_computed_tokens:
                continue  # scheduled in an earlier step (its output is on the GPU)
            if key in encode or key in load:
                continue  # scheduled in this step already: shared
            (to_load if connector.has_cache_item(key) else to_encode).append(index)
        for index in to_encode + to_load:
            connector.update_state_after_alloc(request, index)
        for index in to_encode:
            feature = request.mm_features[index]
            encode[feature.identifier] = feature.mm_position.length
        load.update(request.mm_features[index].identifier for index in to_load)
        tokens += request.num_prompt_tokens - request.num_computed_tokens
        request.num_computed_tokens = request.num_prompt_tokens
    output = SchedulerOutput.make_empty()
    output.total_num_scheduled_tokens = tokens
    metadata = connector.build_connector_meta(output)
    return ScheduledStep(metadata, held, encode, load)


def finish_step(connector: ECConnectorBase, output: ECConnectorOutput | None) -> set[str]:
    """Scheduler.update_from_output() reduced to its calls into an EC connector: the requests to
    fail, then the workers' folded output; None when they reported nothing (vLLM's
    ECOutputAggregator leaves None then, and the scheduler skips the call)."""
    failed = connector.take_unavailable_requests()
    if output is not None:
        connector.update_connector_output(output)
    return failed
