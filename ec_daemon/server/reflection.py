"""Server reflection, so that `grpcurl list` and `grpcurl describe` work without .proto files.

grpcio-reflection serves only `grpc.reflection.v1alpha`; current grpcurl asks for
`grpc.reflection.v1` first. The two protocols are the same messages under another package (same
fields, same numbers), so the one servicer answers both: v1 requests are parsed with the v1alpha
message classes, which read the same bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc
from grpc_reflection.v1alpha._async import ReflectionServicer

V1_SERVICE_NAME = "grpc.reflection.v1.ServerReflection"


def enable(server: grpc.aio.Server, service_names: Sequence[str]) -> None:
    names = (*service_names, reflection.SERVICE_NAME, V1_SERVICE_NAME)
    servicer = ReflectionServicer(names)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1 = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(V1_SERVICE_NAME, {"ServerReflectionInfo": v1}),)
    )
