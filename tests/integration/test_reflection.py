"""Server reflection answers under both protocol versions, so grpcurl (which asks for v1 first)
and older tools (v1alpha) can list and describe the service without .proto files."""

from __future__ import annotations

import grpc
import pytest
from ecd_testing import Daemon
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2

VERSIONS = ["grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"]


def ask(daemon: Daemon, service: str, request: reflection_pb2.ServerReflectionRequest) -> object:
    with grpc.insecure_channel(daemon.address) as channel:
        call = channel.stream_stream(
            f"/{service}/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        [reply] = list(call(iter([request]), timeout=5))
        return reply


@pytest.mark.parametrize("service", VERSIONS)
def test_reflection_lists_the_services(daemon: Daemon, service: str) -> None:
    reply = ask(daemon, service, reflection_pb2.ServerReflectionRequest(list_services=""))
    names = {s.name for s in reply.list_services_response.service}  # type: ignore[attr-defined]
    assert {"ecd.v1.EncoderCache", "grpc.health.v1.Health", *VERSIONS} <= names


@pytest.mark.parametrize("service", VERSIONS)
def test_reflection_describes_the_cache_service(daemon: Daemon, service: str) -> None:
    request = reflection_pb2.ServerReflectionRequest(file_containing_symbol="ecd.v1.EncoderCache")
    reply = ask(daemon, service, request)
    [raw] = reply.file_descriptor_response.file_descriptor_proto  # type: ignore[attr-defined]
    described = descriptor_pb2.FileDescriptorProto.FromString(raw)
    assert described.package == "ecd.v1"
    assert "Acquire" in {m.name for m in described.service[0].method}
