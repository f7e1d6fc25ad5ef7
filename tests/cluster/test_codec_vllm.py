"""The codec is vLLM 0.33's own format, checked with vLLM's own functions
(`mooncake_store_embedding`: data.py's key and namespace, store_client.py's header)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.distributed.ec_transfer.ec_connector.mooncake_store_embedding import data, store_client

from ec_daemon.cluster import codec
from ec_protocol.types import TensorSpec


def vllm_namespace() -> str:
    """The namespace vLLM's connector derives (build_embedding_namespace), from the parts of a
    config it reads."""
    config = SimpleNamespace(
        model_config=SimpleNamespace(
            multimodal_config=SimpleNamespace(compute_hash=lambda: "0123abcd"),
            model="llava-hf/llava-1.5-7b-hf",
            revision=None,
            dtype=torch.bfloat16,
        ),
        ec_transfer_config=SimpleNamespace(ec_connector_extra_config={}),
    )
    return data.build_embedding_namespace(config)  # type: ignore[arg-type]


def test_a_key_is_vllms_make_embedding_key_of_the_identifier() -> None:
    namespace = vllm_namespace()
    identifier = "5c1e0e3b6f0f4c6e9d3b2a1f00aa11bb22cc33dd44ee55ff6677889900aabbcc"
    assert codec.store_key(namespace, identifier.encode()) == data.make_embedding_key(
        namespace, identifier
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_header_is_the_one_vllm_writes_and_vllm_accepts_it(dtype: torch.dtype) -> None:
    tensor = torch.empty(576, 4096, dtype=dtype)
    spec = TensorSpec((576, 4096), str(dtype).removeprefix("torch."), tensor.nbytes)
    raw = codec.header(spec)
    assert raw == store_client._encode_mooncake_tensor_metadata(tensor)
    expected = data.TensorSpec((576, 4096), str(dtype), tensor.nbytes)
    store_client._validate_mooncake_tensor_metadata("key", raw, expected)  # raises if refused
    assert codec.parse_header(store_client._encode_mooncake_tensor_metadata(tensor)) == spec
